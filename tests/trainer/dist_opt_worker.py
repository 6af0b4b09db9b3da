"""Worker for test_distributed_optimizer.py, run under torchrun on 2 ranks (DP=2): the same steps
with and without Megatron's distributed optimizer, a resume from its checkpoint (each DP rank's
shard in its own file), and the optimizer's bytes per rank. Rank 0 saves the results to
argv[1]/result.pt; the checkpoint stays in argv[1]/run."""
import sys
import warnings
from pathlib import Path

import torch

warnings.simplefilter("ignore")
sys.path.insert(0, str(Path(__file__).parent))

from tests.conftest import tiny_args  # noqa: E402
from test_trainer import make_batch, nll_loss  # noqa: E402

from megarl.checkpoint.rl_state import load_checkpoint, save_checkpoint  # noqa: E402
from megarl.engine import Engine, EngineConfig  # noqa: E402
from megarl.models.llama import CausalLM  # noqa: E402
from megarl.parallel.checksum import tensor_checksum  # noqa: E402
from megarl.parallel.weight_sync import WeightSync  # noqa: E402
from megarl.parallel.dist import init_parallel, teardown  # noqa: E402
from megarl.trainer.trainer import Trainer, TrainerConfig  # noqa: E402


def main(out: str, dtype: str) -> None:
    dims = init_parallel()
    assert dims.dp == 2, dims
    args = tiny_args("qwen2", tie=True)
    rows = slice(dims.dp_rank * 3, dims.dp_rank * 3 + 3)
    halves = [{k: (v[rows] if v.dim() else v) for k, v in make_batch(args, seed=s).items()} for s in range(4)]
    res = {}
    for sharded in (False, True):
        cfg = TrainerConfig(lr=1e-2, weight_decay=0.1, micro_batch_size=2, dtype=dtype, distributed_optimizer=sharded)
        tr = Trainer(args, cfg, dims, seed=5)
        metrics = [tr.train_step(half, nll_loss) for half in halves[:2]]
        if sharded:
            path = save_checkpoint(Path(out) / "run", 2, tr.state_dict(), {}, dims=dims)
        metrics += [tr.train_step(half, nll_loss) for half in halves[2:]]
        res[sharded] = {"weights": tr.hf_state_dict(), "metrics": metrics,
                        "opt_bytes": [None] * dims.dp}
        torch.distributed.all_gather_object(res[sharded]["opt_bytes"], tr.optimizer_state_bytes())
        if sharded:  # every DP rank's engine gets the all-gathered weights (the sync checks all ranks agree)
            engine = Engine(CausalLM(args), EngineConfig(max_batch_size=2, max_seq_len=16, dtype=dtype), seed=0)
            WeightSync(tr, engine)()
            sums = [None] * dims.dp
            torch.distributed.all_gather_object(sums, tensor_checksum(engine.model.state_dict()))
            res["engine_checksums"] = sums + [tensor_checksum(tr.hf_state_dict())]
        if sharded:
            resumed = Trainer(args, cfg, dims, seed=77)
            resumed.load_state_dict(load_checkpoint(path, dims)[0])
            for half in halves[2:]:
                resumed.train_step(half, nll_loss)
            res["resumed"] = {"weights": resumed.hf_state_dict()}
    if dims.rank == 0:
        torch.save(res, Path(out) / "result.pt")
    teardown(dims)


if __name__ == "__main__":
    main(*sys.argv[1:])
