"""Worker for test_reference.py, run under torchrun on 2 ranks (TP=2): the sharded KL reference
against the whole plain-torch copy runs used to build on every rank. Rank 0 saves the results to
argv[1]/result.pt."""
import sys
import warnings
from pathlib import Path

import torch

warnings.simplefilter("ignore")
sys.path.insert(0, str(Path(__file__).parent))

from tests.conftest import tiny_args  # noqa: E402
from test_trainer import make_batch, nll_loss  # noqa: E402

from megarl.models.llama import CausalLM  # noqa: E402
from megarl.parallel.dist import init_parallel, teardown  # noqa: E402
from megarl.trainer.logprobs import ref_token_logprobs  # noqa: E402
from megarl.trainer.reference import ShardedReference  # noqa: E402
from megarl.trainer.trainer import Trainer, TrainerConfig  # noqa: E402


def main(out: str, tp: str) -> None:
    dims = init_parallel(tp=int(tp))
    # a vocabulary Megatron does not pad at TP=2 (it pads to a multiple of 128 x TP), as real ones
    # are nearly: the per-rank bytes then compare the sharding itself
    args = tiny_args("qwen2", tie=False, vocab_size=256)
    tr = Trainer(args, TrainerConfig(lr=1e-2, micro_batch_size=2, dtype="float64"), dims, seed=5)
    ref = ShardedReference(tr)
    full = CausalLM(args).double()  # what runs held before: a whole copy on every rank
    full.load_state_dict(tr.hf_state_dict())
    for s in range(2):
        tr.train_step(make_batch(args, seed=s), nll_loss)
    ids = make_batch(args, seed=9)["input_ids"]
    policy_before = tr.hf_state_dict()
    res = {
        "sharded": ref_token_logprobs(ref, ids, temperature=0.7),
        "plain": ref_token_logprobs(full, ids, temperature=0.7),
        "policy": tr.token_logprobs(ids, temperature=0.7),
        "policy_unchanged": all(torch.equal(v, tr.hf_state_dict()[k]) for k, v in policy_before.items()),
        "ref_state_equal": all(torch.equal(v, full.state_dict()[k]) for k, v in ref.state_dict().items()),
        "ref_bytes": [None] * dims.world_size,
        "full_bytes": sum(p.numel() * p.element_size() for p in full.parameters()),
    }
    resumed = ShardedReference(tr, full.state_dict())  # from a checkpoint's ref.pt
    res["resumed_equal"] = torch.equal(ref_token_logprobs(resumed, ids, temperature=0.7), res["sharded"])
    torch.distributed.all_gather_object(res["ref_bytes"], ref.nbytes())
    if dims.rank == 0:
        torch.save(res, Path(out) / "result.pt")
    teardown(dims)


if __name__ == "__main__":
    main(*sys.argv[1:])
