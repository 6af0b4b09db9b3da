"""The replica exchange of a rollout step (rollout data parallelism, docs/design.md §3): a replica
that has generated its share does bubble work until the step's last replica is done
(megarl/sched/bubble.py), then every replica's results and rewards go to every replica, and the
bubble units' measured lengths with them (megarl/sched/bubble_budget.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.engine import Result
from megarl.sched.bubble import BubbleWorker, PhaseEnd
from megarl.sched.bubble_budget import BubbleBudget
from megarl.sched.policy import BubbleUnit


class ReplicaExchange:
    """This replica's side of the exchange over the rollout data-parallel ``dp_group`` (rank
    ``replica`` of it); ``tp_group``: the replica's rollout TP ranks, which stop bubble work at the
    same unit; ``device``: where the phase-end flag lives (the engine's)."""

    def __init__(self, replica: int, replicas: int, dp_group, tp_group, device: torch.device):
        self.replica, self.replicas, self.dp_group, self.tp_group = replica, replicas, dp_group, tp_group
        self.device = device
        self.bubble_budget = BubbleBudget()  # which bubble units fit (megarl/sched/bubble_budget.py)
        self._worker: BubbleWorker | None = None  # bubble work of the last step, until wait_bubble()

    def bubble(self, plan: list[BubbleUnit], low_priority: bool) -> None:
        """Run ``plan``'s units (megarl/sched/policy.py's ``bubble_plan``) in their own thread (at
        the OS's idle priority with ``low_priority``) and return once every replica has finished
        its share. The work's last unit may still run: see :meth:`wait_bubble`."""
        end = PhaseEnd(self.dp_group, self.tp_group, self.device)
        end.post()
        stop = self.bubble_budget.start(end.over)
        self._worker = BubbleWorker(lambda: run_units(plan, stop), low_priority, flush_denormal=self.device.type == "cpu")
        end.wait()
        self.bubble_budget.phase_over()

    def wait_bubble(self) -> None:
        """Wait for the bubble work's last unit, if one is still in flight."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def gather(self, share: tuple) -> list[tuple]:
        """Every replica's ``share`` (this one's included, in replica order); the other replicas'
        bubble unit lengths are adopted on the way."""
        shares = [None] * self.replicas
        dist.all_gather_object(shares, (*share, dict(self.bubble_budget.unit_s)), group=self.dp_group)
        self.bubble_budget.adopt([s[-1] for r, s in enumerate(shares) if r != self.replica])
        return [s[:-1] for s in shares]


def run_units(plan: list[BubbleUnit], stop) -> dict:
    """The bubble units in order, until the phase is over; ``stop(kind)``: also when a unit of
    ``kind`` would not fit in the bubble (megarl/sched/bubble_budget.py)."""
    for unit in plan:
        if stop():
            break
        unit.run(lambda kind=unit.kind: stop(kind))
    return {}  # figures go to the timeline (summed over replicas there)


def in_uids_order(shares: list[tuple], assignment: list[list[int]], group_size: int,
                  n_uids: int) -> tuple[list[Result], list[float | None]]:
    """Every replica's ``(results, rewards, ...)`` share back in ``uids`` order: replica r
    generated ``uids[assignment[r]]``, in that order, ``group_size`` samples each."""
    g = group_size
    by_index: dict[int, tuple[list[Result], list[float]]] = {}
    for (res, rew, *_), indices in zip(shares, assignment):
        for k, j in enumerate(indices):
            by_index[j] = (res[k * g:(k + 1) * g], rew[k * g:(k + 1) * g])
    results = [x for j in range(n_uids) for x in by_index[j][0]]
    rewards = [x for j in range(n_uids) for x in by_index[j][1]]
    return results, rewards
