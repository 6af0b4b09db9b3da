"""Bubble work that fits its bubble: a unit starts only if it is expected to end before the rollout
phase does.

Bubble work stops after the unit in flight once the phase is over (megarl/sched/bubble.py), so a
unit started late delays the step by what is left of it. Where units are short next to bubbles (a
group's forward/backward on a GPU, a long tail) that is nothing; where they are not it is the whole
gain and more: SmolLM2 on 2 CPU processes (docs/benchmarks.md, "Long-tail scheduling on SmolLM2, 2
processes") had ~1-2 s bubbles and ~15 s stream-training units, and a replica that started one held
the other idle for ~13 s of every step (0.85x the baseline's step time).

So each replica remembers how long its bubbles were (the main thread times each, from its own
share done to the phase's end) and how long a unit of each kind of work took (the time between two
consecutive checks of that kind), both as moving averages, and before a unit asks whether
``elapsed + unit <= bubble``. A stream-training unit is also timed when the replica trains its
leftover groups after the rollout, and the replicas share their unit lengths at each exchange
(a unit in flight ends after it, so this lags a step). Until both
are measured the answer is yes (at most one unit's delay, once). The decision only moves work
between the bubble and the step's own time (stream training left over is trained after the
rollout; bubble drafts not made are not used): samples and updates are unchanged.
"""
from __future__ import annotations

import time
from typing import Callable

WEIGHT = 0.5  # of the newest measurement in each moving average


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new


class BubbleBudget:
    """One replica's estimates, kept across steps (its RolloutStage owns it)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.bubble_s: float | None = None
        """Moving average of this replica's bubble lengths, seconds."""
        self.unit_s: dict[str, float] = {}
        """Moving average of one unit's seconds, per kind of work."""
        self._start: float | None = None

    def start(self, phase_over: Callable[..., bool]) -> "BubbleGate":
        """This replica's share is done: the bubble starts now. ``phase_over(also=False)`` is
        ``PhaseEnd.over``. Returns the ``stop`` the bubble work checks before each unit."""
        self._start = self.clock()
        return BubbleGate(self, phase_over, self._start)

    def phase_over(self) -> None:
        """The rollout phase ended (every replica's share done): record this bubble's length."""
        if self._start is not None:
            self.bubble_s = _average(self.bubble_s, self.clock() - self._start)
            self._start = None

    def record_unit(self, kind: str, seconds: float) -> None:
        """One unit of ``kind`` took ``seconds`` (measured in a bubble, or outside one: stream
        training trains its leftover groups after the rollout, one unit each)."""
        self.unit_s[kind] = _average(self.unit_s.get(kind), seconds)

    def adopt(self, others: list[dict[str, float]]) -> None:
        """Unit lengths measured by the other replicas (their ``unit_s``): a kind this replica has
        not run yet takes their mean, so that a replica's first bubble after another's is judged
        too (units are the same work everywhere; bubble lengths stay each replica's own)."""
        for kind in {k for o in others for k in o} - set(self.unit_s):
            seen = [o[kind] for o in others if kind in o]
            self.unit_s[kind] = sum(seen) / len(seen)

    def fits(self, kind: str, elapsed: float) -> bool:
        """Whether a unit of ``kind`` started ``elapsed`` seconds into the bubble is expected to
        end inside it."""
        unit = self.unit_s.get(kind)
        return unit is None or self.bubble_s is None or elapsed + unit <= self.bubble_s


class BubbleGate:
    """``stop(kind=None)``: True once the phase is over or, for a unit of ``kind``, once the unit
    would not fit (megarl/sched/bubble.py run_units passes the kind). Called from the bubble worker's thread."""

    def __init__(self, budget: BubbleBudget, phase_over: Callable[..., bool], start: float):
        self.budget, self.phase_over, self.start = budget, phase_over, start
        self._last: dict[str, float] = {}  # kind -> when it was last checked (a unit started then)

    def __call__(self, kind: str | None = None) -> bool:
        b = self.budget
        now = b.clock()
        if kind is None:
            return self.phase_over()
        if kind in self._last:  # the unit started at the last check of this kind ended now
            b.record_unit(kind, now - self._last.pop(kind))
        stop = self.phase_over(also=not b.fits(kind, now - self.start))
        if not stop:
            self._last[kind] = now  # a unit of this kind starts
        return stop
