"""What a rollout replica does with its idle time, decided once per run (the ``schedule`` section).

With several rollout replicas, a replica that has finished its share of a step works in its
bubble (megarl/sched/bubble.py) until the step's last replica is done: it trains finished groups
(stream training), pre-generates the next step's responses as bubble drafts, or trains the
learned drafter, in ``schedule.bubble_work``'s order. With one replica (or work left out of that
list) stream training happens as groups finish, bubble drafts are made after the rollout and the
drafter takes ``steps_after_rollout`` steps then. None of it changes a sample or an update.
"""
from __future__ import annotations

from megarl.sched.bubble import BubbleUnit, ScheduleConfig
from megarl.sched.bubble_budget import BubbleBudget
from megarl.sched.timeline import StepTimeline
from megarl.spec.config import SpecConfig


class BubblePolicy:
    """Where this run's bubble work goes (``schedule`` section): with several rollout replicas,
    into each replica's idle time in the rollout phase; otherwise (or when not listed in
    ``schedule.bubble_work``) stream training happens as groups finish and bubble drafts are
    made after the rollout."""

    def __init__(self, schedule: ScheduleConfig, spec: SpecConfig, stream_train: bool, on_cpu: bool, replicas: int):
        work = schedule.bubble_work if replicas > 1 else ()
        pregen = spec.enabled and spec.bubble_pregen
        self.defer_stream = stream_train and "stream_train" in work
        self.pregen_in_bubble = pregen and "pregen" in work
        # The learned drafter (spec.drafter) trains in bubbles, or else a fixed number of steps after the rollout.
        self.drafter = spec.drafter if spec.enabled and spec.drafter.enabled else None
        self.drafter_in_bubble = self.drafter is not None and "drafter_train" in work
        self.order = [w for w in work if {"stream_train": self.defer_stream, "pregen": self.pregen_in_bubble,
                                          "drafter_train": self.drafter_in_bubble}[w]]
        self.pregen_after = pregen and not self.pregen_in_bubble
        self.low_priority = schedule.bubble_priority == "idle" and on_cpu
        self.drafter_steps = 0
        """The drafter's training steps taken so far (a step's figure is the difference)."""
        self._last_stream = None  # the last step's StreamUpdate: its groups' training time

    def drafter_after_rollout(self, spec, tl: StepTimeline, groups_dp) -> dict:
        """After the rollout phase (bubble work joined): the drafter's training steps when there was
        no bubble to take them in, then the same drafter weights on every rollout replica (their mean
        over the rollout data-parallel group). ``spec``: the engine's Speculator. Figures for
        metrics.jsonl."""
        if self.drafter is None or not spec.drafter_ready:  # (the drafter is built at the first generate call)
            return {}
        if not self.drafter_in_bubble and self.drafter.steps_after_rollout:
            with tl.phase("bubble"):
                spec.train_drafter(max_steps=self.drafter.steps_after_rollout)
        spec.average_drafter(groups_dp)
        figures = spec.drafter_figures()
        steps, self.drafter_steps = figures["drafter_train_steps"] - self.drafter_steps, figures["drafter_train_steps"]
        return {**figures, "drafter_train_steps": steps}

    def bubble_plan(self, units: list[BubbleUnit], budget: BubbleBudget, stream) -> list[BubbleUnit]:
        """The step's bubble work, for the bubble thread to run (megarl/sched/bubble.py): of
        the step's ``units`` (megarl/rollout/bubble.py), those this run puts into bubbles, in
        ``schedule.bubble_work``'s order (its priority); empty when there are none. ``budget``: the
        replica's (megarl/sched/bubble_budget.py), told the length of the last step's
        stream-training unit; ``stream``: the step's StreamUpdate, or None."""
        last, self._last_stream = self._last_stream, stream
        if last is not None and last.groups:  # every replica trained groups last step: a unit's length
            budget.record_unit("stream_train", last.seconds / last.groups)
        by_kind = {u.kind: u for u in units}
        return [by_kind[kind] for kind in self.order if kind in by_kind]
