"""Activation memory per rank with and without sequence parallelism, at TP=2 on gloo.

Run: ``python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_sequence_parallel.py``.

For one micro-batch of a small Qwen2-shaped model, counts the bytes of the tensors autograd keeps
for the backward at the end of the forward (each storage once; the weights excluded), as
tests/trainer/test_recompute.py does, with ``sequence_parallel`` off and on, alternated
A/B/A/B; prints one line per rank. Sequence parallelism divides by TP what the layernorms,
residuals and the embedding output keep; what the TP linears keep inside the attention and
MLP (already split over TP by heads / FFN columns) does not change.
"""
import dataclasses
import sys
import warnings
from pathlib import Path

import torch

warnings.simplefilter("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.models.config import ModelArgs  # noqa: E402
from megarl.parallel.dist import init_parallel, teardown  # noqa: E402
from megarl.trainer.trainer import Trainer, TrainerConfig  # noqa: E402

ARGS = ModelArgs(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=1024, model_type="qwen2")


def batch(rows: int = 4, width: int = 512) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ARGS.vocab_size, (rows, width), generator=g)
    mask = torch.zeros(rows, width - 1)
    mask[:, width // 2:] = 1
    return {"input_ids": ids, "loss_mask": mask}


def nll(lp, mb):
    return -(lp * mb["loss_mask"]).sum() / 1000.0, {}


def saved_bytes(trainer, b) -> int:
    weights = {p.untyped_storage().data_ptr() for p in trainer.gpt.parameters()}
    seen, state = set(), {"backward": False, "bytes": 0}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if not state["backward"] and ptr not in weights and ptr not in seen:
            seen.add(ptr)
            state["bytes"] += t.untyped_storage().nbytes()
        return t

    def unpack(t):
        state["backward"] = True
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        trainer.train_step(b, nll)
    return state["bytes"]


def measure(sp: bool) -> int:
    dims = init_parallel(tp=2, sequence_parallel=sp)
    trainer = Trainer(ARGS, TrainerConfig(micro_batch_size=4), dims, seed=0)
    n = saved_bytes(trainer, batch())
    teardown(dataclasses.replace(dims, owns_process_group=False))
    return n


def main() -> None:
    got = {False: [], True: []}
    for sp in (False, True, False, True):  # A/B/A/B
        got[sp].append(measure(sp))
    rank = torch.distributed.get_rank()
    off, on = got[False][-1], got[True][-1]
    print(f"rank {rank}: activation bytes kept for the backward, one micro-batch of 4 x 512 tokens, hidden "
          f"{ARGS.hidden_size}, {ARGS.num_hidden_layers} layers, TP=2: sequence_parallel off {off / 2**20:.2f} MiB, "
          f"on {on / 2**20:.2f} MiB ({on / off:.2f}x); runs {got}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
