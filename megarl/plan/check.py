"""The memory check at the start of ``megarl train``: a run whose plan cannot fit its devices is
refused before anything is written (megarl/setup_run.py calls it with the checked inputs)."""
from __future__ import annotations

import os

from megarl.models.config import ModelArgs


def device_memory(memory_cfg) -> tuple[float, str, str] | None:
    """(GiB per device, how the message names it, the plan's device kind), or None when the
    memory is unknown: on CPU without ``memory.device_memory_gb`` (no check)."""
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if memory_cfg.device_memory_gb > 0:
        return memory_cfg.device_memory_gb, f"memory.device_memory_gb={memory_cfg.device_memory_gb:g}", device
    if not cuda:
        return None
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    props = torch.cuda.get_device_properties(index)
    return props.total_memory / (1 << 30), f"the GPU ({props.name})", device


def check_memory(cfg, args: ModelArgs, world: int, seq_len: int) -> None:
    """Raise ValueError (the refusal, megarl/plan/advice.py) when the run's memory plan exceeds the
    device memory less ``memory.reserve_gb``; nothing when the check is off or the memory unknown."""
    if not cfg.memory.check:
        return
    known = device_memory(cfg.memory)
    if known is None:
        return
    gib, where, device = known
    from megarl.plan.advice import refusal, spec_from_run
    from megarl.plan.memory import plan

    p = plan(spec_from_run(cfg, args, world, seq_len, device, cfg.memory.reserve_gb))
    if not p.fits(gib):
        raise ValueError(refusal(p, gib, where))
