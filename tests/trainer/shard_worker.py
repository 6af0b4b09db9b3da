"""Worker for test_sharding.py, run under torchrun on 4 processes with argv = (out_dir,).

One launch covers every layout of ``LAYOUTS`` (TP2 x DP2, PP2 x DP2, TP2 x PP2, and PP2 with two
virtual stages per rank, x DP2 and x TP2): starting
processes and importing Megatron costs far more than the tiny models. For each layout and each
of ``CASES`` every rank builds its GPTModel stage/TP piece in fp64, records its initial state,
(each of its model chunks with virtual stages; pieces are kept by stage, ``ParallelDims.stage``)
loads its shard of the seeded reference weights, runs the forward (``gpt_logits`` for PP=1, with
the parameter gradients of a loss on the gathered logits; ``pipeline_logits`` for PP>1), then
trains a ``Trainer`` of that layout for 2 GRPO steps (each DP rank on its rows) and saves it all
to ``out_dir/rank<r>.pt``. The test asserts."""
import dataclasses
import sys
import warnings
from pathlib import Path

import torch

if __package__:  # imported by test_sharding.py (pytest): its package siblings
    from tests.conftest import tiny_args
    from .test_model import reference
else:  # run by torchrun as a script
    warnings.simplefilter("ignore")  # Megatron warns about missing apex/TE at import
    sys.path.insert(0, str(Path(__file__).parent))
    from tests.conftest import tiny_args
    from test_model import reference

from megarl.models import mcore_mapping as mm
from megarl.models import mcore_sharding as ms
from megarl.parallel.dist import init_parallel, teardown
from megarl.rl.batching import dp_rows
from megarl.rl.grpo import grpo_loss
from megarl.trainer.trainer import Trainer, TrainerConfig
from megarl.trainer.model import (
    build_gpt_model,
    gpt_logits,
    load_state,
    pipeline_logits,
)

# (model_type, tie): Qwen2 has a qkv bias, Llama none; tied embeddings need the last-stage copy.
CASES = [("qwen2", False), ("llama", True)]
LAYOUTS = [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2)]  # (tp, pp, vpp)
# PP=2: global layers 2, 3 become decoder.layers.0, 1 of the last stage; PP=2 x VPP=2: 4 stages of
# one layer, rank 0 holding layers 0 and 2, rank 1 layers 1 and 3 (interleaved 1F1B)
LAYERS = 4
VOCAB = 200  # > 128: with TP=2 (padded to 256) both vocab pieces hold real rows, not just padding


def case_args(model_type: str, tie: bool):
    return tiny_args(model_type, tie=tie, num_hidden_layers=LAYERS, vocab_size=VOCAB)


def case_inputs(args) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (3, 11), generator=torch.Generator().manual_seed(2))


def no_extra(sd):
    return {k: v.detach().clone() for k, v in sd.items() if not k.endswith("_extra_state")}


def logits_loss(logits: torch.Tensor) -> torch.Tensor:
    """A loss that mixes the whole vocab (like a log-softmax), for gradient checks."""
    return logits.logsumexp(-1).sum() + 0.1 * (logits ** 2).sum()


def grads_of_gathered(model, ids, dims, args) -> dict:
    """Parameter gradients of ``logits_loss`` on the TP-gathered logits (state-dict names)."""
    model.zero_grad()
    logits_loss(gpt_logits(model, ids, dims, args.vocab_size)).backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


TRAIN_STEPS = 2


def train_config() -> TrainerConfig:
    # lr large enough that 2 Adam steps move every weight; clip_grad below the grad norm (~0.7),
    # so the norm over all model-parallel pieces is used; micro-batches of 2 rows give each DP
    # rank several micro-batches (1F1B with PP=2 runs warm-up, steady state and cool-down).
    return TrainerConfig(lr=1e-2, micro_batch_size=2, dtype="float64", clip_grad=0.3, weight_decay=0.1)


def train_batch(args, step: int) -> dict:
    """8 right-padded rows of different lengths with a 3-token prompt, and GRPO advantages."""
    g = torch.Generator().manual_seed(100 + step)
    b, t = 8, 12
    ids = torch.randint(0, args.vocab_size, (b, t), generator=g)
    mask = torch.zeros(b, t - 1, dtype=torch.float64)
    for i, n in enumerate([12, 9, 7, 12, 5, 8, 11, 6]):
        ids[i, n:] = 0
        mask[i, 2:n - 1] = 1
    return {"input_ids": ids, "loss_mask": mask, "advantages": torch.randn(b, generator=g, dtype=torch.float64)}


def train_steps(trainer, args, dp_rank: int = 0, dp: int = 1) -> list:
    """TRAIN_STEPS GRPO steps; each DP rank trains on its slice with the global token count.
    Returns per step the old logprobs of the whole batch and the train_step outputs."""
    out = []
    for step in range(TRAIN_STEPS):
        batch = train_batch(args, step)
        batch["old_logprobs"] = old = trainer.masked_logprobs(batch["input_ids"], batch["loss_mask"])
        n = float(batch["loss_mask"].sum())

        def loss_fn(lp, mb):
            return grpo_loss(lp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], n,
                             clip_eps_low=0.2, clip_eps_high=0.2)

        out.append({"old_logprobs": old, "metrics": trainer.train_step(dp_rows(batch, dp_rank, dp), loss_fn)})
    return out


def run_layout(tp: int, pp: int, vpp: int) -> dict:
    dims = init_parallel(tp=tp, pp=pp, vpp=vpp)
    result = {"tp_rank": dims.tp_rank, "pp_rank": dims.pp_rank, "dp_rank": dims.dp_rank, "cases": {}}
    for model_type, tie in CASES:
        args = case_args(model_type, tie)
        chunks = [build_gpt_model(args, dims, torch.float64, seed=0, chunk=c) for c in range(vpp)]
        init = {dims.stage(c): no_extra(m.state_dict()) for c, m in enumerate(chunks)}
        full = mm.hf_to_mcore(reference(args, seed=3, dtype=torch.float64).hf_state_dict(), args)
        for c, m in enumerate(chunks):
            load_state(m, ms.shard_rank(full, args, tp, dims.stages, dims.tp_rank, dims.stage(c)))
        ids = case_inputs(args)
        with torch.no_grad():
            logits = (gpt_logits(chunks[0], ids, dims, args.vocab_size) if pp == 1
                      else pipeline_logits(chunks, ids, dims, args.vocab_size))
        result["cases"][(model_type, tie)] = {
            "init": init, "loaded": {dims.stage(c): no_extra(m.state_dict()) for c, m in enumerate(chunks)},
            "logits": None if logits is None else logits.detach().clone(),
            "grads": grads_of_gathered(chunks[0], ids, dims, args) if pp == 1 else None,
        }
        trainer = Trainer(args, train_config(), dims, hf_state=reference(args, seed=3, dtype=torch.float64)
                          .hf_state_dict(), seed=0)
        result["cases"][(model_type, tie)].update(
            train=train_steps(trainer, args, dims.dp_rank, dims.dp), trained_hf=trainer.hf_state_dict())
    # Keep the process group for the next layout; only Megatron's parallel state is rebuilt.
    teardown(dataclasses.replace(dims, owns_process_group=False))
    return result


def main(out_dir: str) -> None:
    results = {layout: run_layout(*layout) for layout in LAYOUTS}
    rank = torch.distributed.get_rank()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
