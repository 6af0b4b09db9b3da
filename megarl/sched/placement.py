"""Length-aware placement of a step's prompts on the rollout replicas (HistoPipe-like; docs/design.md §6).

A synchronous step ends when its slowest replica ends, so prompts are spread to balance the
*predicted* work, not their count. The prediction for a prompt is the mean response length of
its samples the last time it was seen (previous epochs); an unseen prompt gets the mean over all
prompts seen so far. Placement is longest-predicted-first onto the replica with the least
predicted work (LPT greedy, within 4/3 of optimal); ties break by position, so it is a pure
function of (uids, history) and every process computes the same one from the groups it already
holds. A GRPO group stays on one replica. Placement never changes a sample (docs/design.md §1: a
token depends on the prompt, seed, step, uid, sample and position, not on the batch).
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

PLACEMENTS = ("round_robin", "length")


class LengthHistory:
    """Mean response length of each prompt's last group, by uid."""

    def __init__(self) -> None:
        self.last: dict[int, float] = {}

    def update(self, uid: int, lengths: list[int]) -> None:
        if lengths:
            self.last[uid] = sum(lengths) / len(lengths)

    def state_dict(self) -> dict:
        """For the run checkpoint (JSON): a resumed run places prompts as the uninterrupted one."""
        return {"last": [[uid, mean] for uid, mean in sorted(self.last.items())]}

    def load_state_dict(self, state: dict) -> None:
        self.last = {int(uid): float(mean) for uid, mean in state["last"]}

    def predict(self, uid: int) -> float:
        if uid in self.last:
            return self.last[uid]
        # Unseen prompt: the mean over seen prompts (1.0 before any: round robin by position).
        return sum(self.last.values()) / len(self.last) if self.last else 1.0


def round_robin(n: int, replicas: int) -> list[list[int]]:
    """Indices ``0..n-1`` dealt to the replicas in turn (by position; what veRL does)."""
    return [list(range(r, n, replicas)) for r in range(replicas)]


def lpt(work: Sequence[float], replicas: int) -> list[list[int]]:
    """Indices into ``work`` for each replica (each list in ascending order): longest predicted
    work first onto the replica with the least predicted work so far; ties break by position.
    The one placement algorithm: the step (:func:`place`) and the simulator (megarl/sim/step.py)
    both call it."""
    order = sorted(range(len(work)), key=lambda j: (-work[j], j))
    heap = [(0.0, r) for r in range(replicas)]  # (predicted work, replica)
    out: list[list[int]] = [[] for _ in range(replicas)]
    for j in order:
        load, r = heapq.heappop(heap)
        out[r].append(j)
        heapq.heappush(heap, (load + work[j], r))
    return [sorted(x) for x in out]


def place(uids: list[int], replicas: int, policy: str, history: LengthHistory | None = None) -> list[list[int]]:
    """Indices into ``uids`` for each replica (each list in ascending order)."""
    if policy not in PLACEMENTS:
        raise ValueError(f"placement policy {policy!r} is invalid; valid choices: {list(PLACEMENTS)}")
    if policy == "round_robin" or history is None:
        return round_robin(len(uids), replicas)
    return lpt([history.predict(u) for u in uids], replicas)
