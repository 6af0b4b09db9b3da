"""What each process does in a step, by its role: generate, train, or both (colocated).

A process that does not generate gets :class:`NoRollout`, one that does not train
:class:`NoTrainer`: they answer every call the step makes with nothing, so the step itself
(megarl/stages/step.py) reads the same for every role. With disaggregated placement the trainers
receive the step's groups from the first generating process (:class:`Exchange`).
"""
from __future__ import annotations

import torch.distributed as dist

from megarl.rl.grpo import UpdateSpec, trained_groups
from megarl.rollout.bubble import Pregenerate, step_units
from megarl.rollout.scoring import GroupSink
from megarl.rollout.stage import RolloutStage
from megarl.sched.policy import BubblePolicy
from megarl.sched.prompts import Round
from megarl.sched.timeline import StepTimeline
from megarl.stages.update import grpo_update
from megarl.stream_train.stream import StreamUpdate


class RolloutSide:
    """A generating process: its rollout stage (and tail batching's long-round stage, with
    elastic rollout TP), the bubble policy, and what a step does around the generation."""

    def __init__(self, short: RolloutStage, long: RolloutStage | None, policy: BubblePolicy,
                 drop_zero_variance: bool):
        self.short, self.long, self.policy = short, long, policy
        self.drop_zero_variance = drop_zero_variance
        self._stage = short

    @property
    def replica(self) -> int:
        return self.short.replica

    @property
    def stages(self) -> tuple[RolloutStage, ...]:
        return (self.short,) if self.long is None else (self.short, self.long)

    def timeline(self, rank: int, rnd: Round) -> StepTimeline:
        """The step's timeline; picks the stage the round runs on (long rounds: the long stage)."""
        self._stage = self.long if rnd.long and self.long is not None else self.short
        return StepTimeline(rank, self._stage.replica)

    def generate(self, rnd: Round, step: int, next_uids: list[int] | None, tl: StepTimeline,
                 stream: StreamUpdate | None) -> tuple[list, dict]:
        """The round's groups (every replica's) and their rollout metrics; with stream training
        each finished group goes to ``stream`` as it completes."""
        stage = self._stage
        units = step_units(stage, stream, tl, next_uids, step, self.policy.drafter)
        groups = stage.run(rnd.uids, step, on_group=_stream_sink(stream, tl), timeline=tl,
                           bubble=self.policy.bubble_plan(units, stage.bubble_budget, stream),
                           low_priority=self.policy.low_priority, keep=rnd.keep)
        metrics = stage.metrics(groups)
        if self.long is not None:
            metrics["rollout_tp"] = float(stage.engine.tp_size)
        if self.drop_zero_variance:
            metrics["zero_var_dropped"] = len(groups) - len(trained_groups(groups, True))
        return groups, metrics

    def after_rollout(self, step: int, next_uids: list[int] | None, tl: StepTimeline) -> dict:
        """Once the rollout phase is over: the bubble work's last unit joined, bubble drafts made
        now if no idle replica made them, the drafter's training, drafts shared between replicas."""
        stage = self._stage
        stage.wait_bubble()  # a stream-training unit may still be in flight (its time is its own "train")
        if self.policy.pregen_after and next_uids is not None:
            # No idle replica to do it in (one replica, or pregen not in schedule.bubble_work):
            # bubble drafts made after the rollout, with the weights that sampled this step.
            Pregenerate(stage, next_uids, step + 1, tl).run(None)
        figures = self.policy.drafter_after_rollout(stage.spec, tl, groups_dp=stage.dp_group)
        stage.share_drafts(step)
        return figures

    @property
    def aborted(self) -> dict:
        """The prompts the last round left incomplete (tail batching), as the stop left them."""
        return self._stage.aborted

    def close(self) -> None:
        for s in self.stages:
            s.close()


def _stream_sink(stream: StreamUpdate | None, tl: StepTimeline) -> GroupSink | None:
    """Stream training's ``GroupSink``: each group the rollout hands on goes to ``stream``, its
    time recorded as the timeline's train phase (inside the rollout's own phases)."""
    if stream is None:
        return None

    def sink(group) -> None:
        with tl.phase("train"):
            stream.add_group(group)
    return sink


class NoRollout:
    """A process that only trains (disaggregated placement)."""

    aborted: dict = {}
    stages: tuple = ()

    def __init__(self, replica: int):
        self.replica = replica

    def timeline(self, rank: int, rnd: Round) -> StepTimeline:
        return StepTimeline(rank, self.replica)

    def generate(self, rnd, step, next_uids, tl, stream) -> tuple[list, dict]:
        return [], {}

    def after_rollout(self, step, next_uids, tl) -> dict:
        return {}

    def close(self) -> None:
        pass


class TrainerSide:
    """A training process: its Megatron trainer, the KL reference (if any) and the step's update,
    after the rollout or streamed group by group."""

    def __init__(self, trainer, spec: UpdateSpec, ref=None, stream_train: bool = False, defer_stream: bool = False):
        self.trainer, self.spec, self.ref = trainer, spec, ref
        self.stream_train, self.defer_stream = stream_train, defer_stream

    def begin_step(self) -> StreamUpdate | None:
        """The step's stream update (stream training), ready for groups; None otherwise."""
        if not self.stream_train:
            return None
        stream = StreamUpdate(self.trainer, self.spec, self.ref, defer=self.defer_stream)
        stream.begin()
        return stream

    def update(self, groups: list, stream: StreamUpdate | None, tl: StepTimeline) -> dict[str, float]:
        """The step's optimizer step over ``groups`` (every replica's)."""
        with tl.phase("train"):
            if stream is not None:
                return stream.finish(groups)
            return grpo_update(self.trainer, groups, self.spec, self.ref)

    def state(self) -> tuple[dict, dict | None]:
        """Trainer state and reference weights for a checkpoint."""
        return self.trainer.checkpoint_state(), self.ref.state_dict() if self.ref is not None else None


class NoTrainer:
    """A process that only generates (disaggregated placement)."""

    trainer = ref = None

    def begin_step(self) -> None:
        return None

    def update(self, groups, stream, tl) -> dict[str, float]:
        return {}

    def state(self) -> tuple[None, None]:
        return None, None


class Exchange:
    """Disaggregated placement: the trainers get, from the first generating process, what only
    the generating side has (the step's groups and figures, the length history). Colocated: every
    process has it already, and this passes it through."""

    def __init__(self, dims, first_generator: int, apart: bool):
        self.dims, self.first, self.apart = dims, first_generator, apart

    def from_generators(self, obj):
        """``obj`` as the first generating process has it, on every process."""
        if not self.apart:
            return obj
        box = [obj if self.dims.rank == self.first else None]
        dist.broadcast_object_list(box, src=self.first)
        return box[0]

    def rollout(self, groups: list, metrics: dict, tl: StepTimeline) -> tuple[list, dict]:
        """The step's groups and rollout metrics on every process; a trainer-only process's
        rollout phase ends when they arrive."""
        if not self.apart:
            return groups, metrics
        groups, metrics = self.from_generators((groups, metrics))
        if not self.dims.generates:
            tl.end_rollout()
        return groups, metrics
