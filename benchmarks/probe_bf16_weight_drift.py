"""How far a bf16 run's weights move between two of its checkpoints, against their bf16 spacing
(docs/benchmarks.md, "The same run on the vLLM backend and in bf16"): the fraction of bf16 weights
whose value changed, and quantiles of |fp32 master drift| / bf16 spacing (a sample of 20,000
weights per tensor). Reads the fp32 master weights of Megatron's mixed-precision optimizer, which
a bf16 run's ``trainer.pt`` holds (``optimizer.fp32_from_fp16_params``).

    PYTHONPATH=. .venv/bin/python benchmarks/probe_bf16_weight_drift.py \\
        RUN_DIR/checkpoints/step_000030/trainer.pt RUN_DIR/checkpoints/step_000040/trainer.pt
"""
from __future__ import annotations

import argparse

import torch


def masters(path: str) -> list[torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=False)
    groups = state.get("optimizer", {}).get("fp32_from_fp16_params")
    if groups is None:
        raise SystemExit(f"{path}: no fp32 master weights (optimizer.fp32_from_fp16_params); valid: the "
                         f"trainer.pt of a run with trainer.dtype=bfloat16 and the plain optimizer")
    return [t for g in groups for t in g]


def bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """The distance between neighbouring bf16 values at |x| (8 significant bits)."""
    exp = torch.floor(torch.log2(x.abs().clamp(min=torch.finfo(torch.float32).tiny)))
    return torch.ldexp(torch.ones_like(x), exp.int() - 7)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    n = changed = 0
    ratios = []
    for x, y in zip(masters(a.before), masters(a.after), strict=True):
        changed += int((x.bfloat16() != y.bfloat16()).sum())
        n += x.numel()
        r = ((y - x).abs() / bf16_spacing(x)).flatten()
        ratios.append(r[torch.randperm(r.numel(), generator=g)[:20000]])
    r = torch.cat(ratios)
    print(f"{n} weights; bf16 value changed: {changed / n:.4f}")
    print("master drift / bf16 spacing, quantiles 0.5 / 0.9 / 0.99:",
          " / ".join(f"{r.quantile(q).item():.3f}" for q in (0.5, 0.9, 0.99)))


if __name__ == "__main__":
    main()
