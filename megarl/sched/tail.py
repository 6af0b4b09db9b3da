"""Tail batching (RollPacker, docs/design.md §3 step 1; opt-in: ``tail.enabled``).

A synchronous step waits for its longest response. Tail batching stops waiting: a *short round*
starts ``ceil(overprovision * P)`` fresh prompts (G samples each) and ends as soon as P of them
have all their samples finished; the prompts still running are aborted and queued. Once the
queue holds P prompts, the next step is a *long round* over them, run to completion. Every step
trains the groups of its own round, all sampled by that step's weights: deferred prompts are
regenerated from scratch in their long round (with that step's noise), never resumed, so the run
stays on-policy. The data order stays a pure function of the seed: fresh prompts are taken from
the same per-epoch permutations as without tail batching, through a cursor, and both the cursor
and the queue are part of the checkpoint. Which prompts finish first is counted in engine
iterations, not seconds, so a run repeats bit for bit and resumes exactly.

Elastic rollout TP (``tail.long_rollout_tp``): long rounds are few long responses, decode-latency
bound, so they run on rollout groups of a larger TP (fewer, faster replicas); short rounds keep
``parallel.rollout_tp``. Both sets of rollout groups and engines exist from the start; after each
optimizer step the weight sync fills the engine the next round runs on (megarl/train.py), so a
switch costs no extra sync. Tokens do not depend on the rollout TP (docs/design.md §1; tested).

What is not done: response-level over-provisioning (start more than G samples of a prompt and
keep the first G to finish) would bias each group towards short responses, i.e. change GRPO's
estimator, so only prompts are over-provisioned.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.rl.data import epoch_order


@dataclass
class TailConfig:
    """Tail batching (the ``tail`` section)."""

    enabled: bool = False
    """Run short rounds that stop once ``rollout.prompts_per_step`` prompts are complete (the rest
    are queued) and, whenever the queue holds a step's worth, a long round over the queue."""
    overprovision: float = 1.25
    """Prompts a short round starts, as a multiple of ``rollout.prompts_per_step`` (RollPacker's
    eta), in [1, 2]; the surplus is what may be deferred. A short round defers at most
    (eta - 1) x prompts_per_step and a long round takes prompts_per_step, so the queue stays
    under 2 x prompts_per_step."""

    long_rollout_tp: int = 0
    """Rollout TP of long rounds (elastic rollout TP); 0: parallel.rollout_tp, as short rounds. Must
    divide the rollout processes, the attention and KV heads; colocated placement, without stream
    training or the learned drafter."""

    def __post_init__(self) -> None:
        if self.long_rollout_tp < 0:
            raise ValueError(f"tail.long_rollout_tp={self.long_rollout_tp} is invalid; valid: 0 (the run's "
                             f"parallel.rollout_tp) or a rollout TP size >= 1")
        if not 1.0 <= self.overprovision <= 2.0:
            raise ValueError(f"tail.overprovision={self.overprovision} is invalid; valid range: [1.0, 2.0] (a "
                             f"short round starts at least prompts_per_step prompts; past 2 it could defer more "
                             f"than a long round takes, and the queue would grow without bound)")


@dataclass
class Round:
    """One step's rollout under tail batching."""

    long: bool
    """A long round (the queue, run to completion) or a short one (fresh prompts, early stop)."""
    uids: list[int]
    """Prompts the round starts."""
    keep: int | None
    """Short round: complete prompts after which it stops (None: run to completion)."""


class TailBatcher:
    """Which prompts each step starts, and the queue of deferred ones (see the module docstring)."""

    def __init__(self, prompts_per_step: int, overprovision: float, n_prompts: int, seed: int):
        self.p, self.n, self.seed = prompts_per_step, n_prompts, seed
        self.short_size = min(n_prompts, math.ceil(overprovision * prompts_per_step))
        self.cursor = 0  # fresh prompts handed out so far (position in the concatenated epoch orders)
        self.queue: list[int] = []  # deferred prompts, oldest first
        self._orders: dict[int, list[int]] = {}

    def _fresh(self, start: int, count: int) -> list[int]:
        """Up to ``count`` prompts from position ``start`` of the data order; a block that reaches
        into the next epoch stops before a prompt it already holds (a round starts each prompt
        once: its samples are keyed by prompt and sample index)."""
        out: list[int] = []
        for i in range(start, start + count):
            e = i // self.n
            if e not in self._orders:
                self._orders = {e - 1: epoch_order(self.seed, e - 1, self.n), e: epoch_order(self.seed, e, self.n)}
            u = self._orders[e][i % self.n]
            if u in out:
                break
            out.append(u)
        return out

    def plan(self) -> Round:
        """The next step's round: long once the queue holds a step's worth of distinct prompts."""
        distinct = list(dict.fromkeys(self.queue))
        if len(distinct) >= self.p:
            return Round(long=True, uids=distinct[:self.p], keep=None)
        return Round(long=False, uids=self._fresh(self.cursor, self.short_size), keep=self.p)

    def commit(self, rnd: Round, finished: list[int]) -> list[int]:
        """Record the round's outcome (``finished``: the prompts it completed); returns the
        prompts it deferred."""
        if rnd.long:
            missing = sorted(set(rnd.uids) - set(finished))
            if missing:
                raise RuntimeError(f"a long round must complete every prompt; {missing} did not finish")
            for u in rnd.uids:  # one occurrence each, oldest first
                self.queue.remove(u)
            return []
        self.cursor += len(rnd.uids)
        done = set(finished)
        deferred = [u for u in rnd.uids if u not in done]
        self.queue += deferred
        return deferred

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "queue": list(self.queue)}

    def load_state_dict(self, state: dict) -> None:
        self.cursor, self.queue = int(state["cursor"]), [int(u) for u in state["queue"]]
