"""A training step's ``loss_fn`` metrics, from micro-batches to the step's values on every rank.

The loss contract (docs/design.md §1) makes metrics sums already normalised by the step's count:
they add up over micro-batches and data-parallel ranks. A metric named ``*_max`` is a maximum
instead (e.g. GRPO's on-policy check ``logprob_diff_max``): reduced by max, never scaled.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.parallel.collectives import group_device


def is_max(key: str) -> bool:
    """A metric reduced by max, not summed."""
    return key.endswith("_max")


def merge(step: dict[str, float], micro_batch: dict[str, float]) -> None:
    """Add one micro-batch's metrics into the step's (``*_max``: keep the larger), in place."""
    for k, v in micro_batch.items():
        if k not in step:
            step[k] = v
        else:
            step[k] = max(step[k], v) if is_max(k) else step[k] + v


def all_reduce(values: dict[str, float], dims) -> dict[str, float]:
    """``values`` summed (``*_max``: maximised) over ``dims``' data-parallel ranks. Every rank
    must hold the same keys."""
    if dims.dp == 1 or not values:
        return values
    out = {}
    for op, keys in ((dist.ReduceOp.SUM, sorted(k for k in values if not is_max(k))),
                     (dist.ReduceOp.MAX, sorted(k for k in values if is_max(k)))):
        if keys:
            buf = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=group_device(dims.dp_group))
            dist.all_reduce(buf, op=op, group=dims.dp_group)
            out.update(zip(keys, buf.tolist()))
    return out


def scaled(values: dict[str, float], scale: float) -> dict[str, float]:
    """Sums multiplied by ``scale`` (stream training's 1 / step count); maxima unchanged."""
    return {k: v if is_max(k) else v * scale for k, v in values.items()}
