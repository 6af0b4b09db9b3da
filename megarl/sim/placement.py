"""Placement of a step's prompts on rollout replicas: round robin (veRL) or length-aware LPT.

LPT (longest predicted first onto the least-loaded replica) is megarl/sched/placement.py's rule; the
prediction is noisy here: a prompt's expected length times ``exp(N(0, sigma))`` for prompts with
history, the mean of those for the others (what megarl's LengthHistory does). A group stays on
one replica. Ties break by position, so placement is a pure function of its inputs.
"""
from __future__ import annotations

import heapq

import numpy as np

PLACEMENTS = ("round_robin", "lpt")


def noisy_prediction(expected: np.ndarray, rng: np.random.Generator, sigma: float, coverage: float = 1.0
                     ) -> np.ndarray:
    """History-based length prediction: ``expected`` with log-normal noise for the ``coverage``
    share of prompts seen before; the mean of the seen predictions for the rest."""
    pred = np.asarray(expected, dtype=np.float64) * np.exp(rng.normal(0.0, sigma, len(expected)))
    seen = rng.random(len(expected)) < coverage
    if not seen.any():
        return np.ones(len(expected))
    return np.where(seen, pred, pred[seen].mean())


def place(pred: np.ndarray, replicas: int, policy: str) -> list[np.ndarray]:
    """Prompt indices for each replica (ascending). ``pred``: predicted work per prompt."""
    if policy not in PLACEMENTS:
        raise ValueError(f"placement {policy!r} is invalid; valid choices: {list(PLACEMENTS)}")
    n = len(pred)
    if policy == "round_robin":
        return [np.arange(r, n, replicas) for r in range(replicas)]
    order = sorted(range(n), key=lambda j: (-float(pred[j]), j))
    heap = [(0.0, r) for r in range(replicas)]
    out: list[list[int]] = [[] for _ in range(replicas)]
    for j in order:
        load, r = heapq.heappop(heap)
        out[r].append(j)
        heapq.heappush(heap, (load + float(pred[j]), r))
    return [np.asarray(sorted(x), dtype=np.int64) for x in out]


def to_matrix(values: np.ndarray, assignment: list[np.ndarray], fill=0) -> np.ndarray:
    """Per-prompt rows ``values[p]`` (shape [P, ...]) laid out as [replicas, max prompts per
    replica, ...], padded with ``fill``."""
    width = max((len(a) for a in assignment), default=0)
    out = np.full((len(assignment), width, *values.shape[1:]), fill, dtype=values.dtype)
    for r, a in enumerate(assignment):
        out[r, :len(a)] = values[a]
    return out
