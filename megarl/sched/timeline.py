"""Per-rank timeline of each RL step: what every process did when, from which
the bubble fraction is computed (docs/design.md §3 step 6).

Each process records its own phases (``generate``, ``reward``, ``bubble`` work, ``idle``,
``train``, ``sync``) in seconds from its own start of the step. Processes do not start a step
at the same moment (nothing synchronises them between the weight sync and the rollout), so
:func:`gather_records` puts the records on one clock (wall-clock time of each start: one host, or
hosts kept in sync by NTP): time 0 is the earliest start, and each record's ``start`` says when
its rank began the step. Rank 0 gathers
them into ``RUN_DIR/timeline.jsonl`` (one line per step; ``megarl report`` draws it) and every
process computes ``bubble_frac`` from the same records:

    bubble_frac = idle rank-seconds / rank-seconds of the rollout phase

where a rank's rollout phase runs from its start of the step until the step's responses have been
exchanged between the rollout replicas and scored (the last rank's end), and a rank is idle
whenever it is neither generating, nor scoring rewards, nor doing bubble work, nor training.
Time is wall-clock: on a GPU cluster a rank's idle seconds are its GPU's idle seconds.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch.distributed as dist

PHASES = ("generate", "reward", "bubble", "idle", "train", "sync")
MIN_EVENT_S = 1e-4  # shorter events (a deferred group being queued, a gap between phases) are noise
BUSY = ("generate", "reward", "bubble", "train")


class StepTimeline:
    """The phases of one RL step on this process (``perf_counter`` times, kept absolute until
    :meth:`record` makes them relative to the step's start)."""

    def __init__(self, rank: int = 0, replica: int = 0):
        self.rank, self.replica = rank, replica
        self.t0 = time.perf_counter()
        self.t0_wall = time.time()  # the clock shared by the processes (gather_records)
        self.events: list[tuple[str, float, float]] = []
        self.rollout_end: float | None = None  # absolute end of this rank's rollout phase
        self.tokens = 0  # response tokens this rank generated for the step
        self.bubble_tokens = 0  # tokens it generated as bubble work
        self.bubble_groups = 0  # stream-training groups it trained in its idle time

    def add(self, phase: str, start: float, end: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"timeline phase {phase!r} is not one of {PHASES}")
        if end - start > MIN_EVENT_S:
            self.events.append((phase, start, end))

    def fill(self, phase: str, start: float, end: float) -> None:
        """Record ``phase`` for the parts of [start, end] no event covers yet (e.g. generation
        around the stream-training calls made from inside it)."""
        t = start
        for _, a, b in sorted((e for e in self.events if e[2] > start and e[1] < end), key=lambda e: e[1]):
            self.add(phase, t, min(a, end))
            t = max(t, b)
        self.add(phase, t, end)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter())

    def end_rollout(self) -> None:
        """The rollout phase ends now on this rank; what no phase covers in it is idle (filled in
        by :meth:`record`, once the bubble work's last unit, which may outlast the phase, is in)."""
        self.rollout_end = time.perf_counter()

    def record(self) -> dict:
        if self.rollout_end is not None:
            self.fill("idle", self.t0, self.rollout_end)
        end = self.rollout_end if self.rollout_end is not None else self.t0
        return {"rank": self.rank, "replica": self.replica,
                "events": [{"phase": p, "start": round(a - self.t0, 6), "end": round(b - self.t0, 6)}
                           for p, a, b in sorted(self.events, key=lambda e: e[1])],
                "rollout_end": round(end - self.t0, 6), "tokens": self.tokens, "bubble_tokens": self.bubble_tokens,
                "bubble_groups": self.bubble_groups, "start": 0.0, "t0_wall": self.t0_wall}


def rollout_end(records: list[dict]) -> float:
    return max(r["rollout_end"] for r in records)


def bubble_fraction(records: list[dict], end: float | None = None) -> float:
    """Idle share of the rollout phase over every rank: time between a rank's start of the step
    (``start``, 0 if absent) and the end of the phase that it spent neither generating, nor
    scoring, nor on bubble work, nor training (gaps count as idle). ``end``: the phase's end
    (default: the latest of the records' ``rollout_end``)."""
    if not records:
        return 0.0
    end = rollout_end(records) if end is None else end
    total = sum(max(0.0, end - r.get("start", 0.0)) for r in records)
    if total <= 0:
        return 0.0
    busy = sum(max(0.0, min(e["end"], end) - max(e["start"], r.get("start", 0.0)))
               for r in records for e in r["events"] if e["phase"] in BUSY)
    return max(0.0, 1.0 - busy / total)


def gather_records(record: dict) -> list[dict]:
    """Every process's record, in rank order (one small object per rank: all-gathered so each
    process logs the same ``bubble_frac``)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        out = [record]
    else:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, record)
    return align(out)


def align(records: list[dict]) -> list[dict]:
    """Put records made on each rank's own clock (``t0_wall``: its start of the step) on one:
    0 is the earliest start; each record's times move by its rank's lateness, kept as ``start``."""
    base = min(r["t0_wall"] for r in records)
    out = []
    for r in records:
        off = r["t0_wall"] - base
        r = {k: v for k, v in r.items() if k != "t0_wall"}
        r["start"] = round(off, 6)
        r["rollout_end"] = round(r["rollout_end"] + off, 6)
        r["events"] = [{**e, "start": round(e["start"] + off, 6), "end": round(e["end"] + off, 6)} for e in r["events"]]
        out.append(r)
    return out


def replica_sum(records: list[dict], key: str) -> int:
    """``key`` summed over rollout replicas (the TP ranks of a replica record the same figures)."""
    per_replica = {}
    for r in records:
        per_replica.setdefault(r["replica"], r[key])
    return sum(per_replica.values())


def timeline_line(step: int, records: list[dict], response_lengths: list[int]) -> dict:
    """One line of ``timeline.jsonl``."""
    return {"step": step, "ranks": records, "rollout_end": rollout_end(records),
            "response_lengths": [int(x) for x in response_lengths]}
