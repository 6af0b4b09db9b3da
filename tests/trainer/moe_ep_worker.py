"""Worker for test_moe_ep.py, run under torchrun on 2 processes with argv = (out_dir,).

Expert parallelism EP=2 (TP=1, PP=1, so the dense part is DP=2): each rank holds 2 of the 4
experts of every layer. One launch covers every case of ``CASES``: each rank builds its GPTModel
in fp64, records its initial state, loads its EP shard of the seeded reference weights, and runs
its OWN batch (``rank_inputs``: the ranks' batches differ, in shape too, so the all-to-all splits
are uneven): logits, the tokens it sent to each EP rank (the dispatcher's ``input_splits``), and
the parameter gradients of ``logits_loss`` on its batch. Saved to ``out_dir/rank<r>.pt``; the test
compares with the EP=1 model:
- logits of rank r = EP=1 logits of batch r;
- dense and router gradients of rank r = EP=1 gradients of loss(batch r) (before any DP reduce);
- an expert's gradients on its EP rank = EP=1 gradients of loss(batch 0) + loss(batch 1): the
  all-to-all brings every rank's tokens routed to that expert to it.
"""
import sys
import warnings
from pathlib import Path

import torch

if __package__:  # imported by test_moe_ep.py (pytest): its package siblings
    from tests.conftest import tiny_args
    from .shard_worker import logits_loss, no_extra
    from .test_model import reference
else:  # run by torchrun as a script
    warnings.simplefilter("ignore")  # Megatron warns about missing apex/TE at import
    sys.path.insert(0, str(Path(__file__).parent))
    from tests.conftest import tiny_args
    from shard_worker import logits_loss, no_extra
    from test_model import reference

from megarl.models import mcore_mapping as mm
from megarl.models import mcore_sharding as ms
from megarl.parallel.dist import init_parallel, teardown
from megarl.trainer.model import build_gpt_model, gpt_logits, load_state

EP = 2
# (model_type, norm_topk_prob): Megatron routes post-softmax (top-k logits, softmax over k) for
# renormalised routing and pre-softmax (softmax over all, top-k kept as is) for unnormalised.
CASES = [("qwen3_moe", True), ("qwen3_moe", False)]


def case_args(model_type: str, norm: bool):
    """4 experts of width 24, top-2, 2 layers (GQA 4/2 heads, head_dim 8, q/k norm)."""
    return tiny_args(model_type, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                     norm_topk_prob=norm)


def rank_inputs(args, rank: int) -> torch.Tensor:
    """Rank ``rank``'s batch: rank 0 gets 2 rows of 9 tokens, rank 1 3 rows of 7."""
    shape = [(2, 9), (3, 7)][rank]
    return torch.randint(0, args.vocab_size, shape, generator=torch.Generator().manual_seed(10 + rank))


def main(out_dir: str) -> None:
    dims = init_parallel(ep=EP)
    result = {"ep_rank": dims.ep_rank, "dp_rank": dims.dp_rank, "ep": dims.ep, "dp": dims.dp, "cases": {}}
    for case in CASES:
        args = case_args(*case)
        model = build_gpt_model(args, dims, torch.float64, seed=0)
        init = no_extra(model.state_dict())
        full = mm.hf_to_mcore(reference(args, seed=3, dtype=torch.float64).hf_state_dict(), args)
        load_state(model, ms.shard_rank(full, args, 1, 1, 0, 0, ep=EP, ep_rank=dims.ep_rank))
        ids = rank_inputs(args, dims.ep_rank)
        with torch.no_grad():
            logits = gpt_logits(model, ids, dims, args.vocab_size)
        splits = [layer.mlp.token_dispatcher.input_splits.tolist() for layer in model.decoder.layers]
        model.zero_grad()
        logits_loss(gpt_logits(model, ids, dims, args.vocab_size)).backward()
        result["cases"][case] = {
            "init": init, "loaded": no_extra(model.state_dict()), "logits": logits.clone(),
            "input_splits": splits,
            "grads": {k: p.grad.detach().clone() for k, p in model.named_parameters()},
        }
    torch.save(result, Path(out_dir) / f"rank{dims.rank}.pt")
    teardown(dims)


if __name__ == "__main__":
    main(sys.argv[1])
