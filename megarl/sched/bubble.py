"""Bubble work: what a rollout replica does between finishing its share of a step and the end of
the step's rollout phase (docs/design.md §3 step 2; BubbleSpec, RollPacker, TLT).

The work comes in small units (one engine iteration of pre-generation, one group's
forward/backward of stream training), and before each unit the replica asks whether the rollout
phase is over (every replica finished its share); once it is, the work stops after the unit in
flight, so bubble work delays the step by at most one unit, and a unit is started only if it is
expected to end inside the bubble (megarl/sched/bubble_budget.py). The answer comes from an
asynchronous all-reduce that each replica posts when its own share is done: it completes when
the last replica posts it. Within a rollout TP group the ranks must stop at the same unit (their
forwards pair up in collectives), so they agree on the answer with one tiny all-reduce per unit.

On CPU the work runs in a thread at the OS's idle priority (``schedule.bubble_priority``): where
several processes share cores, as in the CPU test runs, bubble work then only takes cycles the
generating ranks leave unused, as it would on a cluster where every rank owns its GPU. On GPU
the priority is left alone (the device work is what matters there).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Literal, Protocol

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

BUBBLE_WORK = ("stream_train", "pregen", "drafter_train")


@dataclass
class ScheduleConfig:
    """What rollout replicas do with their idle time (the ``schedule`` section; multi-process
    runs with several rollout replicas: a one-replica run has no idle replica)."""

    bubble_work: tuple[str, ...] = ("stream_train", "pregen")
    """Work a replica does, in this order, once its share of the step is generated and until the
    step's last replica is done: ``stream_train`` trains the replica's finished groups (with
    ``stream_train: true``; without it in the list they are trained as they finish, in between
    decode steps), ``pregen`` pre-generates the next step's responses as bubble drafts (with
    ``spec.bubble_pregen``; without it in the list they are generated after the rollout phase),
    ``drafter_train`` trains the learned drafter on recent rollouts' hidden states (with
    ``spec.drafter.enabled``; without it in the list it takes ``spec.drafter.steps_after_rollout``
    steps after the rollout phase). None of them changes a sample or an update."""
    bubble_priority: Literal["idle", "normal"] = "idle"
    """``idle``: on CPU, bubble work runs at the OS's idle priority, so that on shared cores it
    never slows a replica that is still generating; ``normal``: same priority as generation."""

    def __post_init__(self) -> None:
        self.bubble_work = tuple(self.bubble_work)
        bad = [w for w in self.bubble_work if w not in BUBBLE_WORK]
        if bad or len(set(self.bubble_work)) != len(self.bubble_work):
            raise ValueError(f"schedule.bubble_work={list(self.bubble_work)} is invalid; valid entries "
                             f"(each at most once, in priority order): {list(BUBBLE_WORK)}")
        if self.bubble_priority not in ("idle", "normal"):
            raise ValueError(f"schedule.bubble_priority={self.bubble_priority!r} is invalid; "
                             f"valid choices: ['idle', 'normal']")


class BubbleUnit(Protocol):
    """One kind of bubble work, ready for a step (megarl/rollout/bubble.py): ``kind`` is its
    ``schedule.bubble_work`` entry; ``run(stop)`` works, a unit at a time, until ``stop()`` says
    the rollout phase is over or its next unit would not fit in the bubble. The bubble thread
    calls it (:func:`run_units`): the one way this layer calls up into the rollout's work."""

    kind: str

    def run(self, stop: Callable[[], bool]) -> None: ...


def run_units(plan: list[BubbleUnit], stop: Callable[..., bool]) -> dict:
    """The bubble work of a step: ``plan``'s units in order (megarl/sched/policy.py's
    ``bubble_plan``) until ``stop()`` says the phase is over; ``stop(kind)`` also says that a unit
    of ``kind`` would not fit (megarl/sched/bubble_budget.py). Figures go to the timeline."""
    for unit in plan:
        if stop():
            break
        unit.run(functools.partial(stop, unit.kind))  # the budget's own stop, for this kind
    return {}


class PhaseEnd:
    """Tells the replicas of a rollout phase when the last one has finished its share.

    :meth:`post` (after this replica's share) starts an asynchronous all-reduce over the rollout
    data-parallel group; :meth:`over` asks, without blocking, whether it completed, agreeing
    across ``tp_group`` (every TP rank must call it at the same points); :meth:`wait` blocks."""

    def __init__(self, dp_group, tp_group=None, device: str | torch.device = "cpu"):
        self.dp_group, self.tp_group, self.device = dp_group, tp_group, device
        self._work = None
        self._over = False

    def post(self) -> None:
        self._flag = torch.ones(1, dtype=torch.int32, device=self.device)
        self._work = dist.all_reduce(self._flag, group=self.dp_group, async_op=True)

    def over(self, also: bool = False) -> bool:
        """Whether the phase is over, or, with ``also`` (this rank's own reason to stop now: the
        bubble budget, megarl/sched/bubble_budget.py), whether to stop anyway; both agreed across
        the TP group, the first remembered."""
        if self._over:
            return True
        done = self._work.is_completed()
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            t = torch.tensor([int(done), int(also)], dtype=torch.int32, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.tp_group)
            done, also = bool(t[0].item()), bool(t[1].item())
        self._over = done
        return done or also

    def wait(self) -> None:
        self._work.wait()


def lower_thread_priority() -> str:
    """Move the calling thread to the OS's idle scheduling class (Linux: SCHED_IDLE, else nice
    19). Per thread on Linux, so the process's other threads keep theirs; returns what was done."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0 = the calling thread
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return "nice 19"
    except (AttributeError, OSError) as e:
        return f"unchanged ({e})"


def raise_priority(tid: int, group: "AutogroupNice | None") -> None:
    """Undo :func:`lower_thread_priority` for thread ``tid`` (from any thread) and, if ``group``
    lowered the process's autogroup, restore its nice value. Best effort: raising a priority can
    need privileges (root, or RLIMIT_NICE), and without them the work just keeps its priority."""
    try:
        if os.sched_getscheduler(tid) == os.SCHED_IDLE:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        elif os.getpriority(os.PRIO_PROCESS, tid) > 0:
            os.setpriority(os.PRIO_PROCESS, tid, 0)
    except (AttributeError, OSError):
        pass
    if group is not None and group.saved is not None:
        AutogroupNice._write(group.saved)


class AutogroupNice:
    """Lower this process's autogroup to nice 19 for a while, then restore it (Linux).

    torchrun starts every worker in its own session, and Linux gives each session its own
    scheduling group (``/proc/sys/kernel/sched_autogroup_enabled``), shared fairly with the other
    groups whatever its threads' policies: a process whose only runnable thread is SCHED_IDLE
    still takes a full share from its neighbours. The group's nice value is what counts between
    groups. Raising it back needs the privilege to raise priority (root or RLIMIT_NICE), so it is
    only lowered where a probe (nice 1, then back to the original) shows it can be restored."""

    PATH = "/proc/self/autogroup"
    _can_restore: bool | None = None

    def __init__(self, nice: int = 19):
        self.nice, self.saved = nice, None

    @staticmethod
    def _read() -> int | None:
        try:
            with open(AutogroupNice.PATH) as f:
                return int(f.read().split("nice")[1])  # "/autogroup-1136 nice 0"
        except (OSError, IndexError, ValueError):
            return None

    @staticmethod
    def _write(nice: int) -> bool:
        try:
            with open(AutogroupNice.PATH, "w") as f:
                f.write(str(nice))
            return True
        except OSError:
            return False

    @classmethod
    def available(cls) -> bool:
        if cls._can_restore is None:
            now = cls._read()
            cls._can_restore = (now is not None and now < 19 and cls._write(now + 1) and cls._write(now)
                                and cls._read() == now)
        return cls._can_restore

    def __enter__(self) -> bool:
        if self.available():
            self.saved = self._read()
            if not self._write(self.nice):
                self.saved = None
        return self.saved is not None

    def __exit__(self, *exc) -> None:
        if self.saved is not None and not self._write(self.saved):
            log.warning("could not restore this process's autogroup nice value to %d", self.saved)


_logged_priority = False


class BubbleWorker:
    """Runs ``fn`` (bubble work that checks its own stop condition) in its own thread, started at
    once; :meth:`join` waits for it and raises its exception, if any. With ``low_priority``
    the thread runs at the OS's idle priority (and the process's autogroup at nice 19, where
    that can be undone). ``flush_denormal`` repeats the engine's ``torch.set_flush_denormal``
    in the thread: the flag lives in a per-thread CPU register, and without it the thread's
    results (and speed) would differ from the main thread's.

    The caller may go on while the work finishes its last unit: the replicas exchange their
    groups as soon as the last one is done, and a stream-training unit still in flight then
    overlaps the exchange instead of delaying it (it uses no collective of the exchange's group).

    Once the caller waits in :meth:`join`, the unit in flight is on the step's critical path: the
    thread (and the autogroup) go back to normal priority first. At idle priority on a machine
    busy with other work it could otherwise wait for a free core indefinitely."""

    def __init__(self, fn: Callable[[], dict], low_priority: bool, flush_denormal: bool = False):
        self.out: dict = {}
        self._err: list[BaseException] = []
        self._tid: int | None = None  # the worker's native thread id, once it runs
        self._group: AutogroupNice | None = None
        self._lowered = threading.Lock()  # the priority is lowered, or raised back, under it
        self._thread = threading.Thread(target=self._run, args=(fn, low_priority, flush_denormal),
                                        name="megarl-bubble", daemon=True)
        self._thread.start()

    def _run(self, fn, low_priority: bool, flush_denormal: bool) -> None:
        global _logged_priority
        if flush_denormal:
            torch.set_flush_denormal(True)
        with self._lowered:  # (join may raise it back right away: not before it was lowered)
            self._tid = threading.get_native_id()
            how = lower_thread_priority() if low_priority else "normal"
            self._group = AutogroupNice() if low_priority else None
        with self._group if self._group is not None else contextlib.nullcontext(False) as group_lowered:
            if not _logged_priority:
                log.info("bubble work runs at OS priority: %s%s", how,
                         ", process autogroup nice 19" if group_lowered else "")
                _logged_priority = True
            try:
                self.out.update(fn())
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self._err.append(e)

    def join(self) -> dict:
        with self._lowered:
            if self._thread.is_alive() and self._tid is not None:
                raise_priority(self._tid, self._group)
        self._thread.join()
        if self._err:
            raise self._err[0]
        return self.out

