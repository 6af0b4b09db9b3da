"""Runs a module as ``__main__`` the way the GPU runbook needs its child processes run:
``python -m benchmarks.gpu.runbook.child [--strict] INFO_JSON MODULE ARGS...``.

- At exit it writes ``INFO_JSON``: the process's peak GPU memory (``torch.cuda.max_memory_allocated``,
  None if it never used CUDA) and the ops that have no deterministic CUDA kernel.
- ``torch.use_deterministic_algorithms(True)`` (what ``deterministic: true`` sets) is made
  ``warn_only``: an op without a deterministic kernel then warns instead of raising, and is
  recorded, so one such op costs the run its bitwise repeatability (said in the report) rather
  than the whole part (a rerun with ``deterministic=false`` would cost its time limit twice).
  ``--strict`` leaves it as it is (the gpu-marked tests: a test may expect the error).
"""
from __future__ import annotations

import atexit
import json
import runpy
import sys
import warnings

from benchmarks.gpu.runbook.rows import cuda_peak_gib
from megarl.utils.fs import atomic_write_text


def main() -> None:
    args = sys.argv[1:]
    strict = bool(args) and args[0] == "--strict"
    args = args[1:] if strict else args
    if len(args) < 2:
        raise SystemExit("usage: python -m benchmarks.gpu.runbook.child [--strict] INFO_JSON MODULE [ARGS...]")
    info_path, module, rest = args[0], args[1], args[2:]
    import torch

    nondeterministic: list[str] = []
    real = torch.use_deterministic_algorithms

    def deterministic(mode: bool, *, warn_only: bool = False) -> None:
        real(mode, warn_only=True if mode else warn_only)

    if not strict:
        torch.use_deterministic_algorithms = deterministic
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "deterministic" in str(message) and len(nondeterministic) < 20:
            nondeterministic.append(str(message)[:400])
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = record
    warnings.filterwarnings("always", message=".*deterministic.*")

    def write_info() -> None:
        atomic_write_text(info_path, json.dumps({"peak_gib": cuda_peak_gib(),
                                                 "nondeterministic_ops": nondeterministic}) + "\n")

    atexit.register(write_info)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
