"""``python -m megarl.launch [torchrun options] COMMAND [megarl options]``: torchrun running
``megarl COMMAND ...`` on every process, with megarl's error contract (megarl/cli.py).

Why: under plain torchrun, bad input ends every process with megarl's one ``megarl: error:``
line, once per process, and then torchrun's own ``ChildFailedError`` traceback and failure table,
exit status 1. Here the launcher runs torchrun in-process (``torch.distributed.run.main``, the
same options) and, when processes fail:

- rank 0 with megarl's user-error status 2: it printed the error, once (the other ranks check
  the same input and stay silent, ``MEGARL_LAUNCHER`` in their environment: they wait a moment
  so that rank 0's line is out before the agent stops every process); exit 2;
- otherwise: one ``megarl: error:`` line naming the rank that failed first and its exit status
  (a signal as its name), after that process's own output; exit with that status (70, 75, ...
  keep their meaning: docs/design.md §5).
torchrun's agent logs (the failure table, "closing signal" notices) are left out on failure; its
own errors (bad torchrun options) end the same way as under torchrun.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

ENV = "MEGARL_LAUNCHER"
"""Set (to 1) in the workers' environment by this launcher."""


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun options, megarl command and its options): split at the first megarl command."""
    import argparse

    from megarl.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    commands = set(sub.choices)  # train, config, bench, ...
    for i, arg in enumerate(argv):
        if arg in commands:
            return argv[:i], argv[i:]
    raise ValueError(f"no megarl command among {argv}; usage: python -m megarl.launch [torchrun options] "
                     f"{{{','.join(sorted(commands))}}} ..., e.g. python -m megarl.launch --nproc_per_node 2 "
                     f"train --config configs/tp2.yaml --run-dir runs/tp2")


def exit_line(failures: dict) -> tuple[str | None, int]:
    """The launcher's error line (None: the workers said it) and exit status for torchrun's
    ``ChildFailedError.failures`` ({rank: ProcessFailure})."""
    if 0 in failures and failures[0].exitcode == 2:  # rank 0 printed its megarl: error: line
        return None, 2
    rank = min(failures, key=lambda r: failures[r].timestamp)
    code = failures[rank].exitcode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    others = sorted(r for r in failures if r != rank)
    more = f" (then rank(s) {', '.join(map(str, others))})" if others else ""
    return f"megarl: error: rank {rank} {how}{more}: its output above says why", (128 - code if code < 0 else code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        torchrun_args, megarl_args = split_args(argv)
    except ValueError as e:
        print(f"megarl: error: {e}", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    os.environ[ENV] = "1"  # inherited by every worker
    try:
        torchrun([*torchrun_args, "-m", "megarl.cli", *megarl_args])
    except ChildFailedError as e:
        line, code = exit_line(e.failures)
        if line is not None:
            print(line, file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    # The agent's failure logs repeat what the workers and the line above say.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    sys.exit(main())
