"""The simulator's configuration: workload, cluster, and the model's knobs.

Scaling is *weak*: a preset states P prompts per step at ``ref_gpus`` GPUs (megarl/sim/lengths.py),
and a run on ``gpus`` GPUs has ``P * gpus / ref_gpus`` prompts (``prompts`` overrides it), i.e.
the same responses per GPU at every scale. Strong scaling of a fixed batch to thousands of GPUs
would leave most of them without a response.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.sim.hardware import Profile, load_profile
from megarl.sim.lengths import PRESETS, LengthPreset, ReplayLengths
from megarl.sim.spec import SpecModel
from megarl.sim.step import StepKnobs


@dataclass
class SimConfig:
    """One ``megarl simulate`` run."""

    preset: str = "A"
    """Length preset: one of ``PRESETS`` (A: RollPacker-like 16k; B: long CoT 64k)."""
    lengths: str | None = None
    """A megarl run's ``timeline.jsonl`` or ``rollouts.jsonl`` to replay instead of a preset."""
    gpus: int = 128
    """GPUs (= trainer ranks; rollout replicas = gpus / gpus_per_replica)."""
    gpus_per_replica: int = 1
    """Rollout tensor-parallel size."""
    profile: str = "h100"
    """Device profile: ``h100`` (first principles) or a calibrated one (``cpu``), megarl/sim/hardware.py."""
    prompts: int | None = None
    """Prompts per step (default: the preset's, scaled with the GPUs)."""
    group: int | None = None
    """Samples per prompt (default: the preset's; replays need it)."""
    steps: int = 3
    """Steps simulated per feature combination; the first only warms up carried state (bubble
    drafts, drafter) and is not reported."""
    seed: int = 0
    """Seed of the length draws (shared by every combination: common random numbers) and noise."""
    tail_overprovision: float = 1.25
    """Tail batching's eta: a short round starts ceil(eta * P) prompts."""
    knobs: StepKnobs = field(default_factory=StepKnobs)
    """Placement, drafter, stream-training and engine knobs (megarl/sim/step.py)."""
    spec: SpecModel = field(default_factory=SpecModel)
    """Acceptance per draft source (megarl/sim/spec.py); ``sources`` is set per combination."""

    def __post_init__(self) -> None:
        if self.lengths is None and self.preset not in PRESETS:
            raise ValueError(f"--preset={self.preset!r} is invalid; valid choices: {sorted(PRESETS)}")
        if self.gpus < 1:
            raise ValueError(f"--gpus={self.gpus} is invalid; valid range: >= 1")
        if self.gpus_per_replica < 1:
            raise ValueError(f"--gpus-per-replica={self.gpus_per_replica} is invalid; valid range: >= 1")
        if self.gpus % self.gpus_per_replica:
            raise ValueError(f"--gpus={self.gpus} is not divisible by --gpus-per-replica={self.gpus_per_replica}; "
                             f"valid: a multiple of {self.gpus_per_replica}")
        if self.steps < 2:
            raise ValueError(f"--steps={self.steps} is invalid; valid range: >= 2 (the first step only warms up)")
        if not 1.0 < self.tail_overprovision <= 2.0:
            raise ValueError(f"--tail-overprovision={self.tail_overprovision} is invalid; valid range: (1, 2]")
        if self.prompts is not None and self.prompts < self.replicas:
            raise ValueError(f"--prompts={self.prompts} is invalid: fewer prompts than the {self.replicas} rollout "
                             f"replicas; valid range: >= {self.replicas}")
        self.knobs.tp = self.gpus_per_replica
        if self.group is not None:
            self.knobs.group = self.group
        elif self.lengths is None:
            self.knobs.group = PRESETS[self.preset].group

    @property
    def replicas(self) -> int:
        return self.gpus // self.gpus_per_replica

    @property
    def length_preset(self) -> LengthPreset:
        return PRESETS[self.preset]

    def step_prompts(self) -> int:
        if self.prompts is not None:
            return self.prompts
        p = self.length_preset
        return max(self.replicas, round(p.prompts * self.gpus / p.ref_gpus))

    def make_profile(self) -> Profile:
        return load_profile(self.profile, tp=self.gpus_per_replica)

    def replay(self) -> ReplayLengths:
        if self.group is None:
            raise ValueError("--lengths needs --group (samples per prompt of the replayed run)")
        return ReplayLengths(self.lengths, self.group)
