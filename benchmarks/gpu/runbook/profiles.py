"""The GPU runbook's profiles: which parts run in which order, each part's time limit, and the
shapes each part measures, every one settable from the command line.

``full`` measures at the shapes the design's targets name; ``quick`` keeps the same parts and
targets at smaller shapes, with limits that sum to what one command of 420 s can hold (imports,
the wheel install and the report included; docs/gpu/README.md gives the estimate per part).
``--dry-run`` keeps a profile's parts and order but measures tiny models on the CPU, each part
limited to ``DRY_BUDGET_S``.

Shapes: ``--set PART.FIELD=VALUE`` (value parsed as YAML: ``--set engine.batch_sizes=[1,8]``),
checked against the dataclasses below before anything runs (one ``megarl: error:`` line naming
the valid keys). Each part process gets its section as JSON (``--shapes``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megarl.utils.dataclass_config import ConfigError, apply_overrides, check_number, from_dict, to_dict

ORDER = ("env", "pytest", "engine", "grpo", "grpo_spec", "identity")
"""The run order of both profiles: the cheap checks first, then the figures by priority."""
BUDGETS_S = {
    # Seconds per part on a GPU: the part's process is killed at its limit.
    "full": {"env": 60, "pytest": 180, "engine": 330, "grpo": 150, "grpo_spec": 210, "identity": 180},
    "quick": {"env": 30, "pytest": 90, "engine": 80, "grpo": 60, "grpo_spec": 70, "identity": 50},
}
DEADLINE_S = {"full": 23 * 60, "quick": 390}
"""All parts together: a part gets at most what is left. quick: 420 s less ~30 s of interpreter
start, wheel install and report."""
DRY_BUDGET_S = 180.0  # per part in a CPU dry run (tiny shapes, shared cores)


@dataclass
class EnvShapes:
    copy_mib: int = 2048
    """Size of the device-to-device copy (past the L2, so HBM is what is timed)."""
    matmul_n: int = 8192
    """Side of the square bf16 matrix product."""
    allreduce_mib: int = 256
    """Size of the one-rank NCCL all-reduce (gloo on a CPU)."""
    iters: int = 10
    """Timed repetitions (median), after 3 warm-ups."""

    def __post_init__(self):
        for k in ("copy_mib", "matmul_n", "allreduce_mib", "iters"):
            check_number(f"env.{k}", getattr(self, k), ge=1, integer=True)


@dataclass
class PytestShapes:
    files: tuple[str, ...] = ()
    """Test files to run (empty: every file under tests/ that marks a test ``gpu``)."""
    test_timeout_s: int = 150
    """Per-test limit where pytest-timeout is installed."""

    def __post_init__(self):
        check_number("pytest.test_timeout_s", self.test_timeout_s, ge=1, integer=True)


@dataclass
class EngineShapes:
    model_size: str = "1.5b"
    """``megarl bench engine`` model (``1.5b``: Qwen2.5-1.5B's shapes, random weights)."""
    batch_sizes: tuple[int, ...] = (1, 64, 16, 256)
    """Decode batches, measured and written in this order (the targets' 1 and 64 first)."""
    prompt_len: int = 128
    new_tokens: int = 128
    kv_caches: tuple[str, ...] = ("slots", "paged")
    repeats: int = 2
    """Fastest of this many timed generations."""
    verify: bool = True
    """Also time a verify step (K=4 at batch 16) against one decode step, per KV cache."""

    def __post_init__(self):
        for k in ("prompt_len", "new_tokens", "repeats"):
            check_number(f"engine.{k}", getattr(self, k), ge=1, integer=True)
        check_number("engine.new_tokens", self.new_tokens, ge=2, integer=True,
                     note="decode time is time(N) - time(1)")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"engine.batch_sizes={list(self.batch_sizes)} is invalid; valid: a non-empty list of "
                             f"batch sizes >= 1")
        bad = [kv for kv in self.kv_caches if kv not in ("slots", "paged")]
        if bad or not self.kv_caches:
            raise ValueError(f"engine.kv_caches={list(self.kv_caches)} is invalid; valid: a non-empty list of "
                             f"'slots', 'paged'")


@dataclass
class GrpoShapes:
    rl_steps: int = 6
    sft_steps: int = 60
    """SFT steps first, so that groups hold mixed rewards and GRPO really moves the policy."""
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 96
    extra: tuple[str, ...] = ()
    """Any further ``megarl train --set`` overrides (``KEY=VALUE``), for both runs."""

    def __post_init__(self):
        for k in ("rl_steps", "prompts_per_step", "group_size", "max_new_tokens"):
            check_number(f"grpo.{k}", getattr(self, k), ge=1, integer=True)
        check_number("grpo.sft_steps", self.sft_steps, ge=0, integer=True)
        check_number("grpo.rl_steps", self.rl_steps, ge=2, integer=True, note="bubble drafts start at step 2")
        bad = [x for x in self.extra if "=" not in x]
        if bad:
            raise ValueError(f"grpo.extra={list(self.extra)} is invalid; valid: a list of KEY=VALUE overrides of "
                             f"megarl train")

    def overrides(self) -> list[str]:
        return [f"rl_steps={self.rl_steps}", f"sft.steps={self.sft_steps}",
                f"rollout.prompts_per_step={self.prompts_per_step}", f"rollout.group_size={self.group_size}",
                f"rollout.max_new_tokens={self.max_new_tokens}", *self.extra]


@dataclass
class IdentityShapes:
    prompts: int = 24
    group_size: int = 4
    prompt_len: int = 32
    max_new_tokens: int = 128
    max_batch_size: int = 96
    kv_caches: tuple[str, ...] = ("slots", "paged")

    def __post_init__(self):
        for k in ("prompts", "group_size", "prompt_len", "max_new_tokens", "max_batch_size"):
            check_number(f"identity.{k}", getattr(self, k), ge=1, integer=True)
        check_number("identity.max_new_tokens", self.max_new_tokens, ge=4, integer=True,
                     note="responses are drawn between a quarter of it and it")
        if not self.kv_caches or any(kv not in ("slots", "paged") for kv in self.kv_caches):
            raise ValueError(f"identity.kv_caches={list(self.kv_caches)} is invalid; valid: a non-empty list of "
                             f"'slots', 'paged'")


@dataclass
class Shapes:
    env: EnvShapes = field(default_factory=EnvShapes)
    pytest: PytestShapes = field(default_factory=PytestShapes)
    engine: EngineShapes = field(default_factory=EngineShapes)
    grpo: GrpoShapes = field(default_factory=GrpoShapes)
    identity: IdentityShapes = field(default_factory=IdentityShapes)


PROFILE_SHAPES = {
    "full": {},
    # ~1/2 to 1/4 of the full shapes' work per part; the estimate per part is in docs/gpu/README.md.
    "quick": {"env": {"copy_mib": 1024, "iters": 5, "allreduce_mib": 128},
              "pytest": {"test_timeout_s": 60},
              "engine": {"batch_sizes": [1, 64], "prompt_len": 64, "new_tokens": 64, "repeats": 1, "verify": True},
              "grpo": {"rl_steps": 4, "prompts_per_step": 8, "group_size": 8, "max_new_tokens": 64},
              "identity": {"prompts": 8, "group_size": 4, "max_new_tokens": 64, "max_batch_size": 32}},
}
DRY_SHAPES = {  # tiny shapes on the CPU: every code path, seconds per part
    "env": {"copy_mib": 4, "matmul_n": 128, "allreduce_mib": 1, "iters": 3},
    "engine": {"model_size": "gpu-dry", "batch_sizes": [1, 64, 2], "prompt_len": 8, "new_tokens": 6, "repeats": 1},
    "grpo": {"rl_steps": 2, "sft_steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
    "identity": {"prompts": 2, "group_size": 2, "prompt_len": 6, "max_new_tokens": 8, "max_batch_size": 4},
}


def part_shapes_key(part: str) -> str | None:
    """The ``Shapes`` section a part reads (both GRPO runs share ``grpo``: they must compare)."""
    key = "grpo" if part in ("grpo", "grpo_spec") else part
    return key if key in {f.name for f in dataclasses.fields(Shapes)} else None


def build_shapes(profile: str, dry_run: bool, sets: list[str]) -> Shapes:
    """The profile's shapes (the dry run's tiny ones on top with ``dry_run``), then ``sets``."""
    if profile not in PROFILE_SHAPES:
        raise ConfigError(f"--profile={profile!r} is invalid; valid choices: {list(PROFILE_SHAPES)}")
    data = {k: dict(v) for k, v in PROFILE_SHAPES[profile].items()}
    if dry_run:
        for k, v in DRY_SHAPES.items():
            data.setdefault(k, {}).update(v)
    for item in sets:
        if "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set {item!r} is invalid; valid: PART.FIELD=VALUE with PART one of "
                              f"{[f.name for f in dataclasses.fields(Shapes)]} (e.g. --set engine.prompt_len=32)")
    data = apply_overrides(data, sets, Shapes)
    return from_dict(Shapes, data)


def shapes_json(shapes: Shapes, part: str) -> dict:
    key = part_shapes_key(part)
    return to_dict(getattr(shapes, key)) if key else {}
