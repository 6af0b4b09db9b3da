"""Every collective's tensors on the device its group's backend takes (megarl/parallel/collectives.py).

The CPU suite runs gloo only, where a CPU tensor works; NCCL refuses one. Here a real gloo group
(a world of one) is marked as NCCL: ``dist.get_backend`` answers "nccl" for it, and the
collectives, wrapped, refuse a tensor not on CUDA before gloo would do the work. On a torch
without CUDA a tensor cannot be put on CUDA, so ``torch.cuda.current_device`` is made to raise
:class:`AskedForCuda`: a code path passes when it asks for the group's CUDA device before its
collective, and fails (:class:`CpuTensorOverNccl`) when it hands the collective a CPU tensor.
"""
from __future__ import annotations

import functools
import importlib.util
import types

import pytest
import torch
import torch.distributed as dist

from megarl.parallel import collectives
from megarl.parallel.collectives import all_gather_single, group_device

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="simulates NCCL on a CPU-only torch")


class AskedForCuda(Exception):
    """The code asked for the current CUDA device (what putting a tensor on an NCCL group needs)."""


class CpuTensorOverNccl(AssertionError):
    """A collective over a group marked NCCL got a tensor not on CUDA."""


_WRAPPED = ("all_reduce", "broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor", "send", "recv",
            "reduce_scatter_tensor", "broadcast_object_list", "all_gather_object")


@pytest.fixture(scope="module")
def world():
    """A gloo world of one process (the default group), destroyed at the end if made here."""
    from megarl.parallel.dist import _free_port

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    if made:
        dist.destroy_process_group()


@pytest.fixture
def nccl_marked(world, monkeypatch):
    """Mark groups as NCCL: returns ``mark(group)``; the default group is ``None`` or WORLD."""
    marked: set = set()
    backend = dist.get_backend

    def is_marked(group) -> bool:
        return (group if group is not None else dist.group.WORLD) in marked

    def get_backend(group=None):
        return "nccl" if is_marked(group) else backend(group)

    def current_device():
        raise AskedForCuda

    def checked(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if is_marked(kwargs.get("group")):
                tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
                tensors += [t for a in args if isinstance(a, list) for t in a if torch.is_tensor(t)]
                device = kwargs.get("device")
                if fn.__name__.endswith("_object_list") and (device is None or torch.device(device).type != "cuda"):
                    raise CpuTensorOverNccl(f"{fn.__name__} over an NCCL group without device=cuda (got {device})")
                bad = [t.device for t in tensors if t.device.type != "cuda"]
                if bad:
                    raise CpuTensorOverNccl(f"{fn.__name__} over an NCCL group got tensors on {bad}")
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(dist, "get_backend", get_backend)
    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    for name in _WRAPPED:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, checked(getattr(dist, name)))

    def mark(group):
        marked.add(group)
        return group
    return mark


def test_group_device_follows_the_backend(world, nccl_marked):
    assert group_device(world) == torch.device("cpu")  # gloo
    nccl_marked(world)
    with pytest.raises(AskedForCuda):
        group_device(world)


def test_the_wrapper_refuses_a_cpu_tensor(nccl_marked):
    """The check itself can fail: a CPU tensor over a marked group is refused."""
    group = nccl_marked(dist.group.WORLD)
    with pytest.raises(CpuTensorOverNccl):
        dist.all_reduce(torch.ones(1), group=group)


def test_step_metrics_reduce_on_the_group_device(nccl_marked):
    from megarl.trainer import step_metrics

    dims = types.SimpleNamespace(dp=2, dp_group=nccl_marked(dist.group.WORLD))
    with pytest.raises(AskedForCuda):
        step_metrics.all_reduce({"loss": 1.0, "logprob_diff_max": 0.5}, dims)


def test_pipeline_broadcast_on_the_group_device(nccl_marked):
    from megarl.trainer.trainer import Trainer

    trainer = object.__new__(Trainer)
    trainer.dims = types.SimpleNamespace(pp=2, pp_group=nccl_marked(dist.group.WORLD), device=torch.device("cpu"))
    with pytest.raises(AskedForCuda):
        trainer._broadcast_from_last_stage(torch.zeros(2, 3))


def test_preempt_agreement_on_the_group_device(nccl_marked):
    from megarl.parallel.preempt import PreemptSignals

    signals = PreemptSignals(group=nccl_marked(dist.group.WORLD), signals=())
    signals.signum = 10
    # a world of one skips the collective: make it look like two ranks
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "get_world_size", lambda group=None: 2)
        with pytest.raises(AskedForCuda):
            signals.agree()


def test_weight_sync_agreement_on_the_group_device(nccl_marked):
    from megarl.parallel.weight_sync import WeightSync

    sync = object.__new__(WeightSync)
    sync.dims = types.SimpleNamespace(world_size=2, device=torch.device("cpu"))
    nccl_marked(dist.group.WORLD)
    with pytest.raises(AskedForCuda):
        sync._agree([], "00" * 32)


@pytest.mark.parametrize("torch_has_it", [True, False])
def test_all_gather_single_and_its_fallback(world, monkeypatch, torch_has_it):
    """torch 2.13's ``all_gather_single``, or ``all_gather_into_tensor`` where torch has no such name."""
    if not torch_has_it:
        monkeypatch.delattr(dist, "all_gather_single", raising=False)
        assert not hasattr(dist, "all_gather_single")
    x = torch.arange(5, dtype=torch.int64)
    out = torch.empty(5, dtype=torch.int64)
    all_gather_single(out, x, group=world)
    assert torch.equal(out, x)
    assert collectives.group_device(world).type == "cpu"


def test_te_name_patch_applies_with_cuda(monkeypatch):
    """Without Transformer Engine an MoE router on a GPU reads ``moe_utils.te_general_gemm``:
    ``install`` binds it whatever the device (it used to patch only on CPU)."""
    from megatron.core.transformer.moe import moe_utils

    from megarl.trainer import cpu_compat

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed")
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.install() is False  # CUDA: the CPU patches stay off
    assert moe_utils.te_general_gemm is None
