"""The memory plan for Qwen2.5-7B and 32B (configs/models/, their public config.json) on 8, 16 and
64 GPUs of 80 GiB, as a markdown table (docs/memory_plan.md).

The run: a reasoning-RL step (prompts up to 512 tokens, responses up to 4096), the trainer in bf16
with micro-batches of one row, the engine in bf16 on CUDA with 64 requests in flight, colocated,
3 GiB per GPU kept for the CUDA context and NCCL. Per model and GPU count: the plain layout (TP=1,
the optimizer not sharded, no recompute), then the first layout that fits, searched with the
cheapest changes first (distributed optimizer, then recompute, then the smallest trainer TP, PP
and rollout TP).

    PYTHONPATH=. .venv/bin/python benchmarks/plan_table.py
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

from megarl.models.config import ModelArgs
from megarl.plan.memory import GIB, PlanSpec, plan

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"Qwen2.5-7B": "configs/models/qwen2.5-7b.json", "Qwen2.5-32B": "configs/models/qwen2.5-32b.json"}
DEVICE_GIB, PROMPT, RESPONSE = 80.0, 512, 4096


def base_spec(args: ModelArgs, gpus: int) -> PlanSpec:
    return PlanSpec(args=args, gpus=gpus, trainer_dtype="bfloat16", micro_batch_size=1, seq_len=PROMPT + RESPONSE,
                    response_len=RESPONSE, rows_per_dp_rank=max(1, 256 // gpus), rollout_dtype="bfloat16",
                    max_batch_size=64, device="cuda", reserve_gib=3.0)


def layouts(s: PlanSpec):
    """Candidate layouts, cheapest first."""
    a = s.args
    sizes = [x for x in (1, 2, 4, 8) if a.num_attention_heads % x == 0 and a.num_key_value_heads % x == 0]
    for tp, pp, rc, dist, rtp in itertools.product(sizes, (1, 2, 4), ("none", "selective", "full"), (False, True),
                                                   sizes):
        if s.gpus % (tp * pp) == 0 and s.gpus % rtp == 0 and a.num_hidden_layers % pp == 0:
            yield s.replace(tp=tp, pp=pp, recompute=rc, distributed_optimizer=dist, rollout_tp=rtp)


def cost(s: PlanSpec) -> tuple:
    """Order of preference: less model parallelism, then less recompute, then no sharding."""
    return (s.tp * s.pp, s.pp, s.rollout_tp, ("none", "selective", "full").index(s.recompute),
            not s.distributed_optimizer)


def describe(s: PlanSpec) -> str:
    return (f"TP={s.tp} PP={s.pp} DP={s.dp}, {'dist. opt.' if s.distributed_optimizer else 'plain opt.'}, "
            f"recompute {s.recompute}, rollout TP={s.rollout_tp}")


def row(name: str, s: PlanSpec) -> str:
    p = plan(s)
    kind, need = p.peak()
    terms = {t.name: t.bytes / GIB for t in p.gpus[kind]}
    big = p.biggest(kind)
    return (f"| {name} | {s.gpus} | {describe(s)} | {terms['trainer weights'] + terms['gradients']:.1f} | "
            f"{terms['optimizer state']:.1f} | {next(v for k, v in terms.items() if k.startswith('activations')):.1f} | "
            f"{terms['engine weights']:.1f} | {terms['KV cache']:.1f} | **{need / GIB:.1f}** | "
            f"{'yes' if p.fits(DEVICE_GIB) else 'no: ' + big.name} |")


def main() -> None:
    print("| model | GPUs | layout | weights + grads | optimizer | activations | engine weights | KV cache | "
          "total GiB/GPU | fits 80 GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, path in MODELS.items():
        args = ModelArgs.from_hf_config(json.loads((ROOT / path).read_text()))
        for gpus in (8, 16, 64):
            s = base_spec(args, gpus)
            print(row(name, s))
            fitting = [c for c in layouts(s) if plan(c).fits(DEVICE_GIB)]
            if fitting:
                print(row(name, min(fitting, key=cost)))
            else:
                print(f"| {name} | {gpus} | no layout of TP <= 8, PP <= 4 fits | | | | | | | no |")


if __name__ == "__main__":
    main()
