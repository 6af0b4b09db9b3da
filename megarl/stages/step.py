"""One synchronous GRPO step: rollout -> rewards -> update -> weight sync (docs/design.md: one step).

``run_step`` is the whole step for every process, whatever its role (megarl/stages/roles.py):
the prompts of the step (megarl/sched/prompts.py), generation with rewards scored as responses
finish and bubble work on idle replicas, what follows the rollout (bubble drafts, the learned
drafter), one optimizer step, the weight sync into the engine the next round runs on, and the
step's figures and timeline.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from megarl.rollout.backend import WeightSyncFn
from megarl.sched.prompts import PromptSchedule
from megarl.sched.timeline import bubble_fraction, gather_records, replica_sum
from megarl.stages.roles import Exchange, NoRollout, NoTrainer, RolloutSide, TrainerSide


@dataclass
class RoundSync:
    """The weight sync after a step, into the engine the next round runs on: ``short``, this
    process's engine, or ``long`` for tail batching's long rounds when they run on an engine of
    their own (elastic rollout TP, megarl/sched/tail.py; None without). Each is a
    ``WeightSyncFn`` (megarl/rollout/backend.py)."""

    short: WeightSyncFn
    long: WeightSyncFn | None = None

    def __call__(self, long_round: bool) -> dict:
        return self.long() if long_round and self.long is not None else self.short()


@dataclass
class Run:
    """Everything a step needs, built once per run by megarl/train.py."""

    rank: int
    prompts: PromptSchedule
    rollout: RolloutSide | NoRollout
    trainer: TrainerSide | NoTrainer
    exchange: Exchange
    sync: RoundSync
    """Weight sync into the engine of the next round (``sync(long_round)``)."""
    rl_steps: int


@dataclass
class StepResult:
    metrics: dict
    """The step's line of metrics.jsonl."""
    records: list[dict]
    """Every process's timeline record (megarl/sched/timeline.py)."""
    groups: list
    """The step's GRPO groups (every replica's)."""


def run_step(run: Run, step: int) -> StepResult:
    rnd = run.prompts.round(step)
    next_uids = run.prompts.next_uids(step, rnd)  # bubble drafts for the next step are made ahead
    tl = run.rollout.timeline(run.rank, rnd)
    t0 = tl.t0
    stream = run.trainer.begin_step()  # stream training: groups are trained as they finish
    groups, rollout_metrics = run.exchange.rollout(*run.rollout.generate(rnd, step, next_uids, tl, stream), tl)
    rollout_metrics.update(run.prompts.commit(rnd, [g.problem.uid for g in groups]))
    t1 = time.perf_counter()
    drafter_metrics = run.rollout.after_rollout(step, next_uids, tl)
    t_bubble = time.perf_counter()
    metrics = run.trainer.update(groups, stream, tl)
    t2 = time.perf_counter()
    with tl.phase("sync"):  # into the engine the next round runs on
        next_long = step + 1 < run.rl_steps and run.prompts.round(step + 1).long
        metrics.update(run.sync(next_long))
    drafter_metrics = run.exchange.from_generators(drafter_metrics)
    records = gather_records(tl.record())
    generating = [r for r in records if r["replica"] >= 0]  # (trainer-only processes have none)
    metrics.update(step=step + 1, **rollout_metrics, **drafter_metrics, rollout_time_s=t1 - t0,
                   bubble_time_s=t_bubble - t1, train_time_s=t2 - t_bubble, step_time_s=time.perf_counter() - t0,
                   bubble_frac=bubble_fraction(generating), bubble_tokens=replica_sum(generating, "bubble_tokens"),
                   bubble_groups=replica_sum(generating, "bubble_groups"))
    return StepResult(metrics, records, groups)
