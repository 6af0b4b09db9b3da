"""Preemption: on a signal, every rank finishes the current RL step, checkpoints, and exits 75.

Clusters take nodes back with a warning signal: Slurm sends ``--signal=USR1@<seconds>`` before
the time limit (``B:USR1`` to the batch script, which forwards it to the srun step:
scripts/slurm/), and SIGTERM on preemption or ``scancel`` (SIGKILL follows after ``KillWait`` /
``GraceTime``). A handler only sets a flag: nothing is written from inside a signal handler, and a
step is never cut in half. At the step boundary the ranks agree (an all-reduce of the flag: a
signal delivered to some ranks only, or between two ranks' checks, still stops every rank after
the same step, where the collective checkpoint needs them all), the loop writes a regular
checkpoint and returns, and leaving :class:`PreemptSignals` raises :class:`Preempted`: the
process exits with :data:`EXIT_CODE`. ``megarl train --resume`` continues from that checkpoint and
ends where the uninterrupted run ends (docs/design.md §1).

Handled signals: SIGUSR1 always (its default action would kill the process, losing the work since
the last checkpoint); SIGTERM too, except in workers of torchrun's agent
(``TORCHELASTIC_RUN_ID`` set), which SIGTERMs its workers to tear down a failed run: those must
end at once, not at the next step boundary. A signal that arrives before the first step (during
start-up or SFT) stops the run after its first RL step.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.parallel.collectives import group_device
from megarl.utils.fs import atomic_write_text

log = logging.getLogger(__name__)

EXIT_CODE = 75
"""Exit status of a run stopped by a preemption signal after writing its checkpoint (sysexits.h
EX_TEMPFAIL: "temporary failure, the user is invited to retry"). The Slurm scripts requeue the
job on this status and on no other: megarl's other failures exit 1 (an exception), 2 (bad input)
or 70 (the rank watchdog, megarl/parallel/watchdog.py)."""
RECORD_NAME = "preempted.json"
"""Written into the run directory by rank 0 once the stop's checkpoint is complete
(``{"step", "signal", "exit_code"}``), removed when a run starts there. A launcher that sees a
rank's exit status may see another rank's (srun reports the first task to exit, and may kill the
rest while they tear down); this file says the stop happened and its checkpoint is whole."""


class Preempted(SystemExit):
    """Raised (after the checkpoint, the watchdog's clean stop) by a run stopped by a signal; as
    a ``SystemExit`` it ends the ``megarl`` command with :data:`EXIT_CODE` without a traceback."""

    def __init__(self, step: int, signum: int):
        super().__init__(EXIT_CODE)
        self.step = step
        """RL steps completed, i.e. the step of the checkpoint written."""
        self.signum = signum
        """This rank's first signal (0: the stop came from another rank's signal)."""

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name if self.signum else "a signal on another rank"
        return f"preempted by {name}: checkpoint of step {self.step} written, exit {EXIT_CODE}"


def handled_signals(env=None) -> tuple[signal.Signals, ...]:
    """The signals that ask for a checkpoint-and-stop in this process (see the module docstring)."""
    env = os.environ if env is None else env
    return (signal.SIGUSR1,) if "TORCHELASTIC_RUN_ID" in env else (signal.SIGUSR1, signal.SIGTERM)


class PreemptSignals:
    """Context manager around a run: installs the handlers (main thread only: Python delivers
    signals there), restores the previous ones on exit, and raises :class:`Preempted` on leaving
    a block in which :meth:`stop` was called. Put it *outside* the rank watchdog's block, so that
    the watchdog has stopped cleanly before the exit status says "preempted"."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                 signals: tuple[signal.Signals, ...] | None = None, record: str | Path | None = None):
        self.group = group
        """Process group the ranks agree over (None: the default group, when initialised)."""
        self.device = device
        """Device of the agreement's one-element tensor (None: the group's, ``group_device``)."""
        self.signals = handled_signals() if signals is None else signals
        self.signum = 0
        """The first signal this process received (0: none)."""
        self.record = Path(record) if record is not None else None
        """Where :meth:`stop` writes the :data:`RECORD_NAME` file (rank 0's run dir; None elsewhere)."""
        self.stopped_at: int | None = None
        """The step the run stopped after (set by :meth:`stop`)."""
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum, frame) -> None:
        self.signum = self.signum or signum  # only a flag: the loop acts at the step boundary

    @property
    def requested(self) -> bool:
        """A signal reached this process (not yet agreed with the other ranks)."""
        return self.signum != 0

    def agree(self) -> bool:
        """Collective (every rank, once per step): True on every rank if any rank was signalled."""
        flag = self.requested
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            t = torch.tensor([int(flag)], dtype=torch.int32, device=self.device or group_device(self.group))
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            flag = bool(t.item())
        return flag

    def stop(self, step: int) -> None:
        """Record that the run stopped after ``step``. Collective (every rank, once its checkpoint
        is complete): no rank leaves before the record is written, so a launcher that reacts to
        the first exit already finds it."""
        self.stopped_at = step
        if self.record is not None:
            name = signal.Signals(self.signum).name if self.signum else "another rank's signal"
            atomic_write_text(self.record, json.dumps({"step": step, "signal": name, "exit_code": EXIT_CODE}) + "\n")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.barrier(group=self.group)
        log.warning("stopping after step %d on %s: checkpoint written; resume with --resume (exit status %d)",
                    step, signal.Signals(self.signum).name if self.signum else "another rank's signal", EXIT_CODE)

    def __enter__(self) -> PreemptSignals:
        if self.record is not None:  # an earlier stop's record: this run supersedes it
            self.record.unlink(missing_ok=True)
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        else:  # e.g. a run inside a test's thread: no handlers, agree() still joins the collective
            log.debug("not in the main thread: no preemption signal handlers")
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()
        if exc is None and self.stopped_at is not None:
            raise Preempted(self.stopped_at, self.signum)
        return False
