"""Where the processes of a run go: trainer and rollout layouts, checked before anything starts.

A run is N processes (torchrun or srun). Trainers run Megatron-core TP x PP x DP (EP for MoE
models inside the data-parallel ranks); rollout groups run the engine with their own TP, and
their DP is the number of groups. Two placements:

- ``colocated``: every process trains and generates (the rollout groups re-slice the same
  ranks), so weights move within a process or a node;
- ``disaggregated``: the last ``rollout_ranks`` processes only generate, the others only train.

:class:`Layout` is pure arithmetic (no torch.distributed): the rank lists of every group, in
Megatron's rank order for the trainer (TP fastest, then DP, then PP) and in consecutive blocks of
``rollout_tp`` ranks for the rollout groups. It is computed, and every bad combination rejected,
before any process group exists, so a wrong layout fails at start on every rank with the same
message. :func:`create_rollout_groups` then creates the rollout groups once, on every rank, in
one fixed order (``new_group`` is collective: every rank must call it for every group).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist

PLACEMENTS = ("colocated", "disaggregated")


@dataclass
class ParallelConfig:
    """Process layout of a run (the ``parallel`` section)."""

    placement: Literal["colocated", "disaggregated"] = "colocated"
    """``colocated``: every process trains and generates; ``disaggregated``: the last
    ``rollout_ranks`` processes only generate, the others only train."""
    trainer_tp: int = 1
    """Tensor-parallel size of the trainer (divides attention heads and KV heads)."""
    trainer_pp: int = 1
    """Pipeline-parallel size of the trainer (divides the number of layers)."""
    trainer_vpp: int = 1
    """Virtual pipeline stages per pipeline rank (Megatron's interleaved 1F1B schedule, which
    shrinks the pipeline bubble by this factor): the layers are cut into trainer_pp * trainer_vpp
    stages, each rank holding every pp-th one. Needs trainer_pp >= 2; trainer_pp * trainer_vpp
    must divide the number of layers."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism in the trainer (needs trainer_tp >= 2): the activations outside
    the TP linears (embedding output, layernorms, residuals) are split along the sequence over the
    TP ranks, 1/trainer_tp of them per rank; a micro-batch's packed tokens are padded to a multiple
    of trainer_tp. The same update, up to rounding."""
    trainer_ep: int = 1
    """Expert-parallel size of the trainer (MoE models; divides the experts and the trainer's
    data-parallel size)."""
    rollout_tp: int = 1
    """Tensor-parallel size of one rollout group (divides attention heads and KV heads)."""
    rollout_ranks: int = 0
    """Processes that only generate (``disaggregated``; must be 0 when ``colocated``)."""
    weight_sync_bucket_mb: float = 64.0
    """Size of the buffers in which the weights go from the trainer's pieces to the rollout
    engines after each optimizer step (megarl/parallel/weight_sync.py): the extra memory of a
    sync is about one bucket."""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"parallel.placement={self.placement!r} is invalid; valid choices: {list(PLACEMENTS)}")
        for name in ("trainer_tp", "trainer_pp", "trainer_vpp", "trainer_ep", "rollout_tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name}={getattr(self, name)} is invalid; valid range: >= 1")
        if self.trainer_vpp > 1 and self.trainer_pp < 2:
            raise ValueError(f"parallel.trainer_vpp={self.trainer_vpp} needs pipeline parallelism (trainer_pp >= 2, "
                             f"got trainer_pp={self.trainer_pp}); valid: trainer_pp >= 2 or trainer_vpp=1")
        if self.sequence_parallel and self.trainer_tp < 2:
            raise ValueError(f"parallel.sequence_parallel=true splits the sequence over the trainer's tensor-parallel "
                             f"ranks and needs parallel.trainer_tp >= 2 (got trainer_tp={self.trainer_tp}): set "
                             f"trainer_tp >= 2 or sequence_parallel=false")
        if not 0 < self.weight_sync_bucket_mb < float("inf"):
            raise ValueError(f"parallel.weight_sync_bucket_mb={self.weight_sync_bucket_mb} is invalid; valid range: > 0")
        if self.rollout_ranks < 0:
            raise ValueError(f"parallel.rollout_ranks={self.rollout_ranks} is invalid; valid range: >= 0")
        if self.placement == "colocated" and self.rollout_ranks != 0:
            raise ValueError(f"parallel.rollout_ranks={self.rollout_ranks} needs placement=disaggregated "
                             f"(colocated runs generate on every process: set rollout_ranks=0)")
        if self.placement == "disaggregated" and self.rollout_ranks < 1:
            raise ValueError(f"parallel.rollout_ranks={self.rollout_ranks} is invalid with placement=disaggregated; "
                             f"valid range: >= 1 (the processes that only generate)")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _need_divides(what: str, size: int, of: str, n: int) -> None:
    if n % size:
        raise ValueError(f"{what}={size} does not divide {of}={n}; valid choices: {_divisors(n)}")


@dataclass(frozen=True)
class Layout:
    """Rank lists of every trainer and rollout group of a world (see the module docstring)."""

    world_size: int
    cfg: ParallelConfig
    trainer_ranks: tuple[int, ...]
    rollout_ranks: tuple[int, ...]

    @classmethod
    def build(cls, cfg: ParallelConfig, world_size: int, num_attention_heads: int, num_key_value_heads: int,
              num_layers: int, num_experts: int = 0) -> "Layout":
        """Check ``cfg`` against the world and the model; raise ValueError naming the field."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} is invalid; valid range: >= 1")
        if cfg.placement == "disaggregated":
            if cfg.rollout_ranks >= world_size:
                raise ValueError(f"parallel.rollout_ranks={cfg.rollout_ranks} leaves no trainer in a world of "
                                 f"{world_size} processes; valid range: 1..{world_size - 1}")
            n_train = world_size - cfg.rollout_ranks
            trainer, rollout = tuple(range(n_train)), tuple(range(n_train, world_size))
        else:
            trainer = rollout = tuple(range(world_size))
        where = f"the {len(trainer)} trainer processes"
        if len(trainer) % (cfg.trainer_tp * cfg.trainer_pp):
            raise ValueError(f"parallel.trainer_tp * trainer_pp = {cfg.trainer_tp} * {cfg.trainer_pp} does not divide "
                             f"{where} (world_size={world_size}, placement={cfg.placement}); choose sizes whose "
                             f"product is one of {_divisors(len(trainer))}")
        _need_divides("parallel.trainer_tp", cfg.trainer_tp, "num_attention_heads", num_attention_heads)
        _need_divides("parallel.trainer_tp", cfg.trainer_tp, "num_key_value_heads", num_key_value_heads)
        _need_divides("parallel.trainer_pp", cfg.trainer_pp, "num_hidden_layers", num_layers)
        if cfg.trainer_vpp > 1:
            _need_divides("parallel.trainer_pp * trainer_vpp", cfg.trainer_pp * cfg.trainer_vpp, "num_hidden_layers",
                          num_layers)
        dp = len(trainer) // (cfg.trainer_tp * cfg.trainer_pp)
        if cfg.trainer_ep > 1:
            if num_experts == 0:
                raise ValueError(f"parallel.trainer_ep={cfg.trainer_ep} needs a MoE model (num_experts=0); "
                                 f"valid choice for a dense model: 1")
            _need_divides("parallel.trainer_ep", cfg.trainer_ep, "num_experts", num_experts)
            _need_divides("parallel.trainer_ep", cfg.trainer_ep, "the trainer's data-parallel size", dp)
        _need_divides("parallel.rollout_tp", cfg.rollout_tp, f"the {len(rollout)} rollout processes", len(rollout))
        _need_divides("parallel.rollout_tp", cfg.rollout_tp, "num_attention_heads", num_attention_heads)
        _need_divides("parallel.rollout_tp", cfg.rollout_tp, "num_key_value_heads", num_key_value_heads)
        return cls(world_size, cfg, trainer, rollout)

    # ------------------------------------------------------------------ trainer (Megatron order)
    @property
    def trainer_dp(self) -> int:
        return len(self.trainer_ranks) // (self.cfg.trainer_tp * self.cfg.trainer_pp)

    def _trainer_rank(self, tp: int, dp: int, pp: int) -> int:
        c = self.cfg
        return self.trainer_ranks[tp + c.trainer_tp * (dp + self.trainer_dp * pp)]

    def trainer_tp_groups(self) -> list[list[int]]:
        c = self.cfg
        return [[self._trainer_rank(t, d, p) for t in range(c.trainer_tp)]
                for p in range(c.trainer_pp) for d in range(self.trainer_dp)]

    def trainer_dp_groups(self) -> list[list[int]]:
        c = self.cfg
        return [[self._trainer_rank(t, d, p) for d in range(self.trainer_dp)]
                for p in range(c.trainer_pp) for t in range(c.trainer_tp)]

    def trainer_pp_groups(self) -> list[list[int]]:
        c = self.cfg
        return [[self._trainer_rank(t, d, p) for p in range(c.trainer_pp)]
                for d in range(self.trainer_dp) for t in range(c.trainer_tp)]

    # ------------------------------------------------------------------ rollout
    @property
    def rollout_dp(self) -> int:
        """Number of rollout groups (each generates its share of the step's prompts)."""
        return len(self.rollout_ranks) // self.cfg.rollout_tp

    def rollout_tp_groups(self) -> list[list[int]]:
        """Consecutive blocks of ``rollout_tp`` ranks: a group's TP traffic stays on a node."""
        tp = self.cfg.rollout_tp
        return [list(self.rollout_ranks[i:i + tp]) for i in range(0, len(self.rollout_ranks), tp)]

    def rollout_dp_groups(self) -> list[list[int]]:
        """Rank i of every rollout group: the ranks that exchange rollout-DP data."""
        return [list(g) for g in zip(*self.rollout_tp_groups())]

    def describe(self) -> str:
        c = self.cfg
        return (f"{c.placement}: world={self.world_size}; trainer ranks {self.trainer_ranks[0]}..{self.trainer_ranks[-1]} "
                f"TP={c.trainer_tp} PP={c.trainer_pp} DP={self.trainer_dp} EP={c.trainer_ep}; rollout ranks "
                f"{self.rollout_ranks[0]}..{self.rollout_ranks[-1]} TP={c.rollout_tp} DP={self.rollout_dp}")


@dataclass
class RolloutGroups:
    """This rank's rollout groups (None on a rank that does not generate)."""

    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    group_index: int
    """Which rollout group this rank belongs to (-1: none)."""
    bridge: dist.ProcessGroup | None = None
    """Disaggregated placement: trainer rank 0 and the generating-only ranks (the weight sync's
    last hop, megarl/parallel/weight_sync.py); None when colocated."""


def create_rollout_groups(layout: Layout) -> RolloutGroups:
    """Create every rollout TP and DP group, on every rank, in one fixed order; return this
    rank's. Must be called by all ranks of the default group (``new_group`` is collective)."""
    rank = dist.get_rank()
    tp_group = dp_group = None
    index = -1
    for i, ranks in enumerate(layout.rollout_tp_groups()):
        g = dist.new_group(ranks)
        if rank in ranks:
            tp_group, index = g, i
    for ranks in layout.rollout_dp_groups():
        g = dist.new_group(ranks)
        if rank in ranks:
            dp_group = g
    bridge = None
    if layout.cfg.placement == "disaggregated":
        bridge = dist.new_group([layout.trainer_ranks[0], *layout.rollout_ranks])
    return RolloutGroups(tp_group, dp_group, index, bridge)


def check_trainer_groups(layout: Layout, tp_group, pp_group, dp_group) -> None:
    """Raise unless this rank's trainer groups (as Megatron-core built them) are the ones the
    layout computed. The rollout groups, the data split and stream training rely on the layout's
    rank order (e.g. a trainer's TP group being a rollout group); a Megatron-core whose rank order
    differs must fail here, at start, not mis-assign data."""
    rank = dist.get_rank()
    for name, group, expected in (("tp", tp_group, layout.trainer_tp_groups()),
                                  ("pp", pp_group, layout.trainer_pp_groups()),
                                  ("dp", dp_group, layout.trainer_dp_groups())):
        got = dist.get_process_group_ranks(group)
        want = next(g for g in expected if rank in g)
        if got != want:
            raise RuntimeError(f"rank {rank}: Megatron-core's trainer {name} group is {got}, the layout expects "
                               f"{want} ({layout.describe()}); the installed megatron-core orders ranks "
                               f"differently from megarl/parallel/layout.py")
