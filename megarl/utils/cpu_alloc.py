"""Keep freed memory in the process on CPU (glibc ``mallopt``), so that large temporaries do not
page-fault on every allocation.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap``
and returns it with ``munmap`` when freed; the next allocation of that size page-faults all of
its pages again, zero-filled by the kernel. A decode step allocates several [rows, vocab]
tensors (logits, the sampler's and the logprob math's temporaries): at SmolLM2's 49k vocabulary
a speculative step of 64 requests x 9 rows makes ~110 MiB tensors. Measured on the 2-core VM
(``benchmarks/bench_verify_cost.py --model smollm2 --threads 2``, batch 1-64, K=2-8, fp32;
2026-11-25): 67 s of system time in a 68 s run (page faults), 8-13 s with the settings below.
Intel's PyTorch CPU guides reach the same by preloading jemalloc/tcmalloc; this is the
in-process equivalent, applied once by the engine on a CPU device, as ``set_flush_denormal``.

- ``M_MMAP_MAX = 0``: no allocation is served by ``mmap``; large blocks come from the heap and
  are reused after they are freed.
- ``M_TRIM_THRESHOLD = 1 GiB``: freed memory at the top of the heap stays mapped (up to 1 GiB
  is kept), so the heap does not shrink and grow again every step.

The cost: the process keeps its peak heap mapped. Without glibc (musl, macOS) nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
TRIM_THRESHOLD_BYTES = 1 << 30
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings above once per process; True when glibc took them."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not _applied:
        log.warning("mallopt refused the CPU allocation settings; large decode temporaries will page-fault")
    return _applied
