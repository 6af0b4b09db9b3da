"""torch.distributed + Megatron parallel state, handed out as one explicit object.

Megatron-core keeps its process groups in module globals (``parallel_state``). megarl reads them
exactly once, here, into a :class:`ParallelDims`, and passes that object around; code outside
``megarl/parallel`` never calls ``parallel_state`` itself (docs/design.md §2).

Launch modes:
- under torchrun/srun-with-torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set):
  join that world;
- as a task of an srun step or under mpirun: the same, after ``launch_env.export_launch_env``
  has written those variables from Slurm's / MPI's;
- otherwise: a world of one process on localhost with a free port.
The backend is gloo on CPU and nccl when CUDA is available.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist

from megarl.parallel.launch_env import export_launch_env

logger = logging.getLogger(__name__)


@dataclass
class ParallelDims:
    """Parallel sizes and process groups of this process (no context parallelism yet)."""

    world_size: int
    """Number of processes in the default group."""
    rank: int
    """This process's rank in the default group."""
    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    dp: int
    """Data-parallel size (world_size // (tp * pp))."""
    tp_group: dist.ProcessGroup
    """Tensor-parallel group of this rank."""
    pp_group: dist.ProcessGroup
    """Pipeline-parallel group of this rank."""
    dp_group: dist.ProcessGroup
    """Data-parallel group of this rank (without context parallelism)."""
    pg_collection: object = field(repr=False)
    """Megatron's ``ProcessGroupCollection`` of the same groups, passed explicitly to Megatron
    constructors (GPTModel, DDP, optimizer) so they never look groups up themselves."""
    backend: str = "gloo"
    """torch.distributed backend: ``gloo`` (CPU) or ``nccl`` (GPU)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Device this rank computes on."""
    owns_process_group: bool = False
    """True when :func:`init_parallel` created the default process group (teardown destroys it)."""
    ep: int = 1
    """Expert-parallel size: the MoE experts are split over ``ep`` ranks of the data-parallel
    dimension (dense weights stay replicated over them). The expert-tensor-parallel size is ``tp``."""
    ep_group: dist.ProcessGroup | None = None
    """Expert-parallel group of this rank (the ranks that hold the other experts of the same
    layers); None only in a hand-built ``ParallelDims``."""
    expt_dp_group: dist.ProcessGroup | None = None
    """Expert-data-parallel group: the ranks holding the same experts (world / (tp*ep*pp) of them);
    expert gradients are averaged over it, dense ones over ``dp_group``."""
    vpp: int = 1
    """Virtual pipeline stages per pipeline rank (interleaved 1F1B): the layers are cut into
    ``pp * vpp`` stages and pipeline rank ``p`` holds the ``vpp`` model chunks of stages
    ``p, p + pp, p + 2 pp, ...`` (:meth:`stage`)."""
    role: str = "both"
    """``both``: this process trains and generates (colocated placement); ``trainer`` or
    ``rollout``: it only trains / only generates (disaggregated placement). A ``rollout`` process
    has the trainer's sizes (tp, pp, ep, vpp: the weight sync's plan) but no trainer groups."""
    trainer_group: dist.ProcessGroup | None = None
    """The trainer processes when they are not the whole world (disaggregated placement: Megatron's
    "world"); None when every process trains (then it is the default group)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs ``tp`` > 1): outside the TP linears (embedding output,
    layernorms, residuals) each TP rank holds 1/tp of the sequence instead of all of it."""

    @property
    def trains(self) -> bool:
        return self.role != "rollout"

    @property
    def generates(self) -> bool:
        return self.role != "trainer"

    @property
    def trainer_world_size(self) -> int:
        """Number of trainer processes (``tp * pp * dp``)."""
        return self.tp * self.pp * self.dp

    @property
    def stages(self) -> int:
        """Pipeline stages the layers are cut into: ``pp * vpp`` (virtual stages)."""
        return self.pp * self.vpp

    def stage(self, chunk: int) -> int:
        """Pipeline stage (of :attr:`stages`) held by this rank's model chunk ``chunk``."""
        if not 0 <= chunk < self.vpp:
            raise ValueError(f"model chunk {chunk} out of range: this rank holds {self.vpp} (vpp={self.vpp})")
        return chunk * self.pp + self.pp_rank

    def _group_rank(self, what: str, group) -> int:
        if not self.trains:  # dist.get_rank(None) would answer with the default group's rank
            raise RuntimeError(f"rank {self.rank} only generates (disaggregated placement): it has no trainer "
                               f"{what}")
        return dist.get_rank(group)

    @property
    def tp_rank(self) -> int:
        return self._group_rank("tp_rank", self.tp_group)

    @property
    def pp_rank(self) -> int:
        return self._group_rank("pp_rank", self.pp_group)

    @property
    def dp_rank(self) -> int:
        return self._group_rank("dp_rank", self.dp_group)

    @property
    def ep_rank(self) -> int:
        return 0 if self.ep_group is None else self._group_rank("ep_rank", self.ep_group)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _default_group_is(size: int, group: dist.ProcessGroup | None):
    """Within the block, torch.distributed calls that name no group act as if the default group
    were ``group`` (of ``size`` processes): Megatron-core sizes its "world" with
    ``get_world_size()`` and aligns optimizer parameter groups with a world ``all_gather_object``.
    Only around set-up code (no other thread calls torch.distributed then)."""
    if group is None:
        yield
        return
    world_size, gather = dist.get_world_size, dist.all_gather_object

    def get_world_size(group=None):
        return size if group is None else world_size(group)

    def all_gather_object(object_list, obj, group=None):
        return gather(object_list, obj, group=trainer if group is None else group)

    trainer = group
    with mock.patch.object(dist, "get_world_size", get_world_size), \
            mock.patch.object(dist, "all_gather_object", all_gather_object):
        yield


def trainer_world(dims: ParallelDims):
    """Context for Megatron-core set-up calls on a trainer rank (e.g. building the optimizer):
    with disaggregated placement the trainers are a sub-world, which Megatron must take for its
    whole world; with colocated placement nothing changes."""
    return _default_group_is(dims.trainer_world_size, dims.trainer_group)


def _init_process_group(backend: str, cuda: bool, timeout_minutes: int) -> None:
    """The default process group: torchrun's world (env:// rendezvous), srun's or mpirun's as
    torchrun's variables, or a world of one on a free localhost port."""
    export_launch_env()  # srun / mpirun ranks as torchrun's variables (torchrun's own kept)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: env:// rendezvous
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_method = "env://"
    else:  # standalone: a world of one on a free localhost port
        rank, world = 0, 1
        init_method = f"tcp://127.0.0.1:{_free_port()}"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=timeout_minutes))


def _check_trainer_world(world: int, everyone: int, tp: int, pp: int, ep: int, trainer_ranks: int | None) -> None:
    """Megatron's world (``world`` trainer processes of ``everyone``) splits into TP x EP x PP."""
    if not 1 <= world <= everyone:
        raise ValueError(f"trainer_ranks={trainer_ranks} is invalid in a world of {everyone}; valid range: "
                         f"1..{everyone}")
    what = "world_size" if world == everyone else "the trainer processes"
    if world % (tp * pp):
        raise ValueError(f"{what}={world} is not a multiple of tp*pp={tp * pp}")
    if world % (tp * ep * pp):
        raise ValueError(f"{what}={world} is not a multiple of tp*ep*pp={tp * ep * pp}: the expert-"
                         f"parallel size ep={ep} must divide the data-parallel size {world // (tp * pp)}")


def _check_sizes(tp: int, pp: int, ep: int, vpp: int, sequence_parallel: bool) -> None:
    """The parallel sizes make sense on their own (the world is checked by _check_trainer_world)."""
    if sequence_parallel and tp < 2:
        raise ValueError(f"sequence_parallel=True splits the sequence over the tensor-parallel ranks and needs tp >= 2 "
                         f"(got tp={tp}): set tp >= 2 or sequence_parallel=False")
    if tp < 1 or pp < 1 or ep < 1 or vpp < 1:
        raise ValueError(f"tp={tp}, pp={pp}, ep={ep} and vpp={vpp} must be >= 1")
    if vpp > 1 and pp < 2:
        raise ValueError(f"vpp={vpp} (virtual pipeline stages) needs pipeline parallelism: pp={pp}; valid: pp >= 2 "
                         f"or vpp=1")


def init_parallel(tp: int = 1, pp: int = 1, timeout_minutes: int = 30, ep: int = 1, vpp: int = 1,
                  trainer_ranks: int | None = None, sequence_parallel: bool = False) -> ParallelDims:
    """Initialise torch.distributed (if needed) and Megatron's model-parallel state; return the
    groups as a :class:`ParallelDims`. (Megatron's CPU patches, megarl/trainer/cpu_compat.py, go in
    when the trainer builds its model: the parallel state needs none.)

    ``ep`` is the expert-parallel size (MoE models): Megatron lays out experts as
    ``tp x ep x expert-dp x pp`` with expert-TP = ``tp``, so ``tp * ep * pp`` must divide the world.
    ``vpp`` > 1 (virtual pipeline stages per pipeline rank, interleaved 1F1B) needs ``pp`` >= 2.

    ``trainer_ranks`` (disaggregated placement): only the first ``trainer_ranks`` processes train;
    Megatron's parallel state is built over them as its whole world (every process still takes
    part in creating the groups, which is collective), and the others get a ``role="rollout"``
    :class:`ParallelDims` without trainer groups. None: every process trains.
    ``sequence_parallel``: the trainer's sequence parallelism (:attr:`ParallelDims.sequence_parallel`)."""
    _check_sizes(tp, pp, ep, vpp, sequence_parallel)
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    owns = not dist.is_initialized()
    if owns:
        _init_process_group(backend, cuda, timeout_minutes)
    everyone, rank = dist.get_world_size(), dist.get_rank()
    world = everyone if trainer_ranks is None else trainer_ranks  # Megatron's world: the trainers
    _check_trainer_world(world, everyone, tp, pp, ep, trainer_ranks)
    # new_group is collective over the default group: every process creates the trainers' group
    trainer_group = dist.new_group(list(range(world))) if world < everyone else None

    if ps.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is already initialised; call teardown() first")
    # Gloo side groups are only needed by the distributed optimizer's CPU paths; on CPU the
    # main groups already are gloo, so do not create a second copy of every group.
    # With a trainer sub-world every process runs Megatron's set-up over the first `world` ranks
    # (the same new_group calls in the same order); a generating-only rank is in none of them.
    with _default_group_is(world, trainer_group):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep,
                                     virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                     distributed_timeout_minutes=timeout_minutes,
                                     create_gloo_process_groups=cuda)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sizes = dict(world_size=everyone, rank=rank, tp=tp, pp=pp, dp=world // (tp * pp), ep=ep, vpp=vpp,
                 backend=backend, device=device, owns_process_group=owns, trainer_group=trainer_group,
                 sequence_parallel=sequence_parallel)
    if rank >= world:
        dims = ParallelDims(tp_group=None, pp_group=None, dp_group=None, pg_collection=None, role="rollout", **sizes)
    else:
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        dims = ParallelDims(tp_group=pgs.tp, pp_group=pgs.pp, dp_group=pgs.dp, pg_collection=pgs,
                            ep_group=pgs.ep, expt_dp_group=pgs.expt_dp,
                            role="both" if world == everyone else "trainer", **sizes)
    logger.info("parallel init: backend=%s world=%d trainers=%d tp=%d pp=%d vpp=%d dp=%d ep=%d sp=%s role=%s", backend,
                everyone, world, tp, pp, vpp, dims.dp, ep, sequence_parallel, dims.role)
    return dims


def teardown(dims: ParallelDims | None = None) -> None:
    """Destroy Megatron's parallel state, and the default process group when we created it
    (or when ``dims`` is None and one exists)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    owns = dims.owns_process_group if dims is not None else True
    if owns and dist.is_initialized():
        dist.destroy_process_group()


# Names used by megarl/train.py.
init_distributed = init_parallel
shutdown_distributed = teardown
