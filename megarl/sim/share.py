"""Work seconds -> wall seconds when the processes of a run share CPU cores.

On a GPU cluster each rank owns its device: a rank's work takes its work seconds. On this
machine N processes share 2 cores (torchrun gives each one thread), so megarl's CPU runs are a
processor-sharing system, and the simulator must be one too to predict them:

- ``n`` processes computing at normal priority each progress at ``profile.speed(n)`` work
  seconds per second: ``min(1, cores / n)`` (time slicing past ``cores``) divided by the measured
  slowdown of ``n`` processes computing side by side (shared caches and memory bandwidth, and
  past ``cores`` what each context switch costs on top of the split; ``benchmarks/calibrate_sim.py``
  measures it, for decoding and for training apart).
- Bubble work runs at the OS's idle priority (megarl/sched/bubble.py: SCHED_IDLE, nice 19): it gets
  only the cores the normal-priority processes leave free; while it runs on them, it competes
  with the normal processes for caches and memory bandwidth like any process computing beside
  them (``slowdown`` of all the busy cores), and while it is pending at all, the generating
  processes are slowed by ``profile.interference(kind)`` of the kinds of bubble work pending
  (the largest one): even at idle priority it is scheduled now and then, and a backward pass
  evicts more of a neighbour's cache than a decode step (benchmarks/calibrate_sim.py).

A *phase* here: every process first does its normal work, then its idle-priority work, until
the last process's normal work is done (the barrier: the rollout replicas' exchange, or the
gradient all-reduce); idle work still pending then is cut off there.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megarl.sim.hardware import Profile


@dataclass
class PhaseTimes:
    """Per process: ``normal_end`` (wall seconds from the phase start), ``idle_done`` (idle work
    seconds done by the barrier), ``idle_busy`` (wall seconds it spent with idle work pending
    before the barrier), ``barrier``; and ``curve[i]`` = (wall, work) breakpoints of process i's
    normal work, for :meth:`wall_at`."""

    normal_end: np.ndarray
    idle_done: np.ndarray
    idle_busy: np.ndarray
    barrier: float
    curve: list[tuple[np.ndarray, np.ndarray]] | None

    def wall_at(self, i: int, work: np.ndarray) -> np.ndarray:
        """Wall time at which process ``i`` reached ``work`` seconds of its normal work."""
        if self.curve is None:
            return np.asarray(work, dtype=np.float64)
        wall, done = self.curve[i]
        return np.interp(work, done, wall)


def run_phase(normal: np.ndarray, idle, profile: Profile, work: str = "decode") -> PhaseTimes:
    """Wall times of one phase (see the module docstring). ``normal[i]``: work seconds of
    process ``i``, of kind ``work`` (``decode``, or ``train``: the trainers' forward/backward
    passes, whose contention is ``train_slowdown``). ``idle``: its idle-priority work, either
    seconds per process (one kind) or a list of ``(kind, seconds per process)`` segments done in
    that order (seconds may be ``inf``: pre-generation never runs out)."""
    normal = np.asarray(normal, dtype=np.float64)
    n = normal.size
    segs = (idle if isinstance(idle, list) else [("bubble", idle)]) or [("bubble", 0.0)]
    kinds = [k for k, _ in segs]
    amount = np.stack([np.broadcast_to(np.asarray(x, dtype=np.float64), normal.shape) for _, x in segs], axis=1)
    total = amount.sum(axis=1)
    if profile.cores is None:  # one device per rank: no sharing, closed form
        barrier = float(normal.max(initial=0.0))
        gap = barrier - normal
        done = np.minimum(total, gap)
        return PhaseTimes(normal.copy(), done, done, barrier, None)
    bounds = np.cumsum(amount, axis=1)  # idle work done at the end of each segment
    factor = np.array([profile.interference(k) for k in kinds])
    rem, idle_rem = normal.copy(), total.copy()
    busy = np.zeros(n)
    idle_done = np.zeros(n)
    now = 0.0
    end = np.where(rem <= 0, 0.0, np.nan)
    curve = [([0.0], [0.0]) for _ in range(n)]
    while np.isnan(end).any():
        run_n = np.isnan(end)
        run_i = ~run_n & (idle_rem > 1e-12)
        k, m = int(run_n.sum()), int(run_i.sum())
        free = max(0.0, profile.cores - k)
        # Idle work on the free cores competes for caches and memory like a normal process would.
        sharing = max(k, min(k + m, int(np.ceil(profile.cores)))) if free > 0 else k
        speed = min(1.0, profile.cores / k) / profile.speed_slowdown(sharing, work)
        seg = np.argmax(bounds > idle_done[:, None] + 1e-12, axis=1)  # each process's current segment
        if m:
            speed /= max(1.0, float(factor[seg[run_i]].max()))
        idle_speed = (min(1.0, free / m) / profile.speed_slowdown(sharing) if m and free > 0 else 0.0)
        dt = float(np.min(rem[run_n]) / speed)
        if m and idle_speed > 0:  # next event: an idle process done with its current segment
            dt = min(dt, float(np.min(bounds[run_i, seg[run_i]] - idle_done[run_i]) / idle_speed))
        now += dt
        rem[run_n] -= dt * speed
        idle_rem[run_i] -= dt * idle_speed
        idle_done[run_i] += dt * idle_speed
        busy[run_i] += dt
        for i in np.flatnonzero(run_n):
            curve[i][0].append(now)
            curve[i][1].append(normal[i] - max(rem[i], 0.0))
        done_now = run_n & (rem <= 1e-12)
        end[done_now] = now
    barrier = float(end.max(initial=0.0))
    return PhaseTimes(end, idle_done, busy, barrier,
                      [(np.asarray(w), np.asarray(d)) for w, d in curve])
