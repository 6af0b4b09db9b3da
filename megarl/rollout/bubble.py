"""The bubble work a rollout replica can do in a step, as units (``schedule.bubble_work``'s
entries, docs/design.md §3): each a ``BubbleUnit`` (megarl/sched/bubble.py) whose ``run(stop)``
works until ``stop()`` says the phase is over or its next piece would not fit. The policy picks
and orders them (megarl/sched/policy.py); the bubble thread runs them (megarl/sched/bubble.py).
Each records its own figures and phase on the step's timeline.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from megarl.sched.bubble import BubbleUnit
from megarl.sched.timeline import StepTimeline
from megarl.spec.config import DrafterConfig
from megarl.spec.speculator import Speculator
from megarl.stream_train.stream import StreamUpdate

if TYPE_CHECKING:
    from megarl.rollout.stage import RolloutStage


class StreamTrain:
    """Train the replica's finished groups that stream training queued (``stream_train``)."""

    kind = "stream_train"

    def __init__(self, stream: StreamUpdate, tl: StepTimeline):
        self.stream, self.tl = stream, tl

    def run(self, stop: Callable[[], bool]) -> None:
        with self.tl.phase("train"):
            self.tl.bubble_groups = self.stream.drain(stop)


class Pregenerate:
    """Generate step ``step``'s samples of ``uids`` now, as that step's bubble drafts (``pregen``;
    RolloutStage.pregenerate)."""

    kind = "pregen"

    def __init__(self, stage: RolloutStage, uids: list[int], step: int, tl: StepTimeline):
        self.stage, self.uids, self.step, self.tl = stage, uids, step, tl

    def run(self, stop: Callable[[], bool] | None) -> None:
        """``stop`` None (after the rollout, no bubble): this replica's own share, to the end."""
        with self.tl.phase("bubble"):
            self.tl.bubble_tokens = self.stage.pregenerate(self.uids, self.step, should_stop=stop)


class TrainDrafter:
    """Training steps of the learned drafter (``drafter_train``), up to ``max_steps`` per bubble
    (0: no limit); nothing before the drafter is built (at the engine's first generate call)."""

    kind = "drafter_train"

    def __init__(self, spec: Speculator, max_steps: int, tl: StepTimeline):
        self.spec, self.max_steps, self.tl = spec, max_steps, tl

    def run(self, stop: Callable[[], bool]) -> None:
        if self.spec.drafter_ready:
            with self.tl.phase("bubble"):
                self.spec.train_drafter(stop, max_steps=self.max_steps)


def step_units(stage: RolloutStage, stream: StreamUpdate | None, tl: StepTimeline, next_uids: list[int] | None,
               step: int, drafter: DrafterConfig | None) -> list[BubbleUnit]:
    """The bubble units step ``step`` has: stream training (with a ``stream``), the next step's
    bubble drafts (when its prompts are known, ``next_uids``), the drafter's training (with a
    ``drafter``). Which of them go into bubbles is the policy's."""
    units: list[BubbleUnit] = []
    if stream is not None:
        units.append(StreamTrain(stream, tl))
    if next_uids is not None:
        units.append(Pregenerate(stage, next_uids, step + 1, tl))
    if drafter is not None and stage.spec is not None:
        units.append(TrainDrafter(stage.spec, drafter.steps_per_bubble, tl))
    return units
