"""Megatron-core on CPU: the one place that patches Megatron-core 0.16.1 to run without CUDA.

Megatron-core assumes a GPU in a handful of places: ``torch.cuda.current_device()`` as a device,
``device="cuda"`` literals in tensor factories, CUDA streams, the CUDA RNG tracker,
``Tensor.type() == 'torch.cuda.FloatTensor'`` assertions, and names that only exist when
Transformer Engine is installed. On a CUDA-less torch each of these raises, so every patch here
only replaces behaviour that would otherwise fail; with CUDA present ``install()`` applies only the
missing-Transformer-Engine patches (a GPU without TE lacks those names too).

How it is done, from least to most invasive:
- **Scoped torch shim.** Inside the listed Megatron modules (and nowhere else) the module global
  ``torch`` is replaced by :class:`_CpuTorch`, a proxy that forwards everything to the real
  ``torch`` except that tensor factories map a CUDA ``device=`` to CPU and ``torch.cuda`` is a
  CPU stand-in (current device = cpu, streams are no-ops, RNG calls use the CPU generator).
  megarl's own code and torch itself keep the real module.
- **Function replacements** where a Megatron function checks a CUDA tensor type or reads the CUDA
  RNG through private torch APIs.
- **Missing names** that Megatron references without defining them when TE is absent.

Later work adds module names to ``_SHIMMED_MODULES`` (this file being full: to a module beside it,
as ``cpu_compat_sp.py``) or a ``_patch_*`` function to ``_PATCHES``, with a comment saying why.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import types
from typing import Any, Callable

import torch

from megarl.trainer.cpu_compat_optimizer import patch_optimizer_param_sort
from megarl.trainer.cpu_compat_sp import SEQUENCE_PARALLEL_SHIMS

logger = logging.getLogger(__name__)

_installed = False

# Megatron modules whose global ``torch`` is replaced by the CPU proxy, each with why.
_SHIMMED_MODULES = {
    # RotaryEmbedding.get_emb moves inv_freq to ``torch.cuda.current_device()`` on first forward.
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "current_device",
    # DDP builds a ``torch.cuda.Stream`` for overlapped grad reduce and the buffers allocate
    # grad/param storage on ``torch.cuda.current_device()`` (and a ``device="cuda"`` warm-up tensor).
    "megatron.core.distributed.distributed_data_parallel": "cuda stream",
    "megatron.core.distributed.param_and_grad_buffer": "current_device, streams, device='cuda'",
    # finalize_model_grads allocates reduction buffers on the current CUDA device.
    "megatron.core.distributed.finalize_model_grads": "current_device",
    # The optimizers keep found_inf / overflow buffers / grad-scale tensors on device='cuda'.
    "megatron.core.optimizer.optimizer": "device='cuda'",
    # The distributed optimizer allocates loaded moments on ``torch.cuda.current_device()``.
    "megatron.core.optimizer.distrib_optimizer": "current_device in load_state_dict",
    # Grad-norm / clip / count-zeros buffers are created with device='cuda'.
    "megatron.core.optimizer.clip_grads": "device='cuda'",
    # local_multi_tensor_l2_norm (the apex/TE-free fallback) returns its norm on device='cuda'.
    "megatron.core.utils": "device='cuda' in local_multi_tensor_l2_norm",
    # The RNG tracker seeds and snapshots the CUDA generator (torch.cuda.manual_seed / get_rng_state).
    "megatron.core.tensor_parallel.random": "cuda rng",
    # The schedules count tokens in ``device="cuda"`` tensors; p2p allocates receive buffers and
    # shape messages on ``torch.cuda.current_device()`` and synchronizes the device.
    "megatron.core.pipeline_parallel.schedules": "device='cuda' token counts",
    "megatron.core.pipeline_parallel.p2p_communication": "current_device, synchronize",
    # MoE: TopKRouter.gating moves its weight to ``torch.cuda.current_device()`` on first forward.
    "megatron.core.transformer.moe.router": "current_device",
    # MoE: the all-to-all dispatcher creates a ``torch.cuda.Stream`` for its device-to-host copies
    # of the split sizes and synchronises on its events (no-ops on CPU: copies are in order).
    "megatron.core.transformer.moe.token_dispatcher": "cuda stream, events",
    # MoE: _AllToAll (the EP token exchange) allocates its output on torch.cuda.current_device().
    "megatron.core.tensor_parallel.mappings": "current_device in _AllToAll",
    # Distributed checkpoints (torch_dist): the writer synchronises the device before it stages
    # tensors; the save's finalisation all-reduces its failure flags in tensors on the device.
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "synchronize",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "device='cuda' flags",
}

# Tensor factories whose ``device=`` the proxy maps from CUDA to CPU.
_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "empty_strided",
)


def _cpu_device(device: Any) -> Any:
    """CPU for anything naming a CUDA device (``"cuda"``, ``"cuda:0"``, a cuda ``torch.device``,
    or a bare device index as returned by ``torch.cuda.current_device()`` on GPU)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _remap_factory(fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "factory")
    wrapper.__doc__ = fn.__doc__
    return wrapper


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is issued in order, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullEvent:
    """Stands in for ``torch.cuda.Event``."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class _CpuCuda(types.SimpleNamespace):
    """``torch.cuda`` as seen by shimmed Megatron modules: the CPU plays the device.

    The CPU default generator plays the CUDA generator, so the RNG tracker forks/restores CPU
    RNG state with the same semantics it has for the device generator on GPU.
    """

    def __getattr__(self, name: str) -> Any:  # anything not overridden: the real torch.cuda
        return getattr(torch.cuda, name)


_cpu_cuda = _CpuCuda(
    is_available=lambda: False,
    current_device=lambda: torch.device("cpu"),
    device_count=lambda: 0,
    set_device=lambda device: None,
    synchronize=lambda device=None: None,
    empty_cache=lambda: None,
    Stream=_NullStream,
    Event=_NullEvent,
    stream=lambda s=None: contextlib.nullcontext(),
    current_stream=lambda device=None: _NullStream(),
    default_stream=lambda device=None: _NullStream(),
    get_rng_state=lambda device="cuda": torch.get_rng_state(),
    set_rng_state=lambda state, device="cuda": torch.set_rng_state(state),
    manual_seed=lambda seed: torch.manual_seed(seed),
    manual_seed_all=lambda seed: torch.manual_seed(seed),
    memory_allocated=lambda device=None: 0,
    max_memory_allocated=lambda device=None: 0,
)


class _CpuTorch(types.ModuleType):
    """The ``torch`` module as seen by shimmed Megatron modules (see module docstring)."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _cpu_cuda
        for name in _FACTORIES:
            setattr(self, name, _remap_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_cpu_torch = _CpuTorch()


# --------------------------------------------------------------------------------------------
# Patches. Each is idempotent on its own and documents the failure it removes.


def _patch_shim_modules() -> None:
    """Replace the global ``torch`` of each module in ``_SHIMMED_MODULES`` (and ``cpu_compat_sp``'s) by the CPU proxy."""
    for name in (*_SHIMMED_MODULES, *SEQUENCE_PARALLEL_SHIMS):
        mod = importlib.import_module(name)
        if getattr(mod, "torch", None) is torch:
            mod.torch = _cpu_torch


def _patch_rng_tracker() -> None:
    """``tensor_parallel.random`` reads/writes the CUDA generator through private torch APIs
    (``torch.cuda.default_generators[idx]``, ``_C._cuda_setRNGState``, ``_lazy_call``), which the
    torch proxy cannot intercept; route them to the CPU default generator instead."""
    from megatron.core.tensor_parallel import random as mrandom

    def _get_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()  # already a copy

    def _set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get_rng_state
    mrandom._set_cuda_rng_state = _set_rng_state


def _patch_clip_grads() -> None:
    """``clip_grad_by_total_norm_fp32`` asserts ``grad.type() == 'torch.cuda.FloatTensor'``; a CPU
    fp32 (or fp64, used by exactness tests) grad fails it. Same function with a dtype check.
    ``optimizer.py`` imported the name directly, so it is rebound there too."""
    from megatron.core.optimizer import clip_grads, optimizer as moptimizer
    from megatron.core.utils import to_local_if_dtensor

    if getattr(clip_grads.clip_grad_by_total_norm_fp32, "_megarl_cpu", False):
        return

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        grads = []
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        for param in parameters:
            grad = getattr(param, attr, None)
            if grad is not None:
                if grad.dtype not in (torch.float32, torch.float64, torch.bfloat16):
                    raise TypeError(f"gradient of dtype {grad.dtype} cannot be clipped in fp32")
                grads.append(to_local_if_dtensor(grad).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            for g in grads:
                g.mul_(clip_coeff)

    clip_grad_by_total_norm_fp32._megarl_cpu = True
    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    moptimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _patch_moe_te_names() -> None:
    """``moe_utils.RouterGatingLinearFunction`` tests ``te_general_gemm is not None``, but the name
    is only bound when Transformer Engine imports: define it as None so the torch path runs.
    Not a CPU patch: a GPU without Transformer Engine hits the same NameError, so
    :func:`install_te_absent` applies it on any device."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_tied_embedding_copy() -> None:
    """With tied embeddings and PP > 1 the last stage keeps a copy of the word embeddings, which
    ``LanguageModule.setup_embeddings_and_output_layer`` moves with ``weight.data.cuda()`` before
    all-reducing it with the first stage's; ``Tensor.cuda`` raises on a CUDA-less torch (and is a
    tensor method, out of the torch proxy's reach). Run that method with ``Tensor.cuda`` as the
    identity: on CPU the weight already is on the compute device."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer
    if getattr(setup, "_megarl_cpu", False):
        return

    def setup_embeddings_and_output_layer(self) -> None:
        real_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
        try:
            setup(self)
        finally:
            torch.Tensor.cuda = real_cuda

    setup_embeddings_and_output_layer._megarl_cpu = True
    setup_embeddings_and_output_layer.__doc__ = setup.__doc__
    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


class _Fp64SoftmaxTorch(_CpuTorch):
    """``torch`` as seen by Megatron's ``moe_utils``: the CPU proxy, except that a float32 softmax
    of a float64 tensor stays in float64 (see :func:`_patch_moe_router_fp64`)."""

    @staticmethod
    def softmax(input: torch.Tensor, dim: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        if dtype == torch.float32 and input.dtype == torch.float64:
            dtype = None
        return torch.softmax(input, dim, dtype=dtype)


def _patch_moe_router_fp64() -> None:
    """Megatron's softmax router (``moe_utils.topk_routing_with_score_function``) computes the
    routing probabilities with ``torch.softmax(..., dtype=torch.float32)`` whatever the model
    dtype, so an fp64 model routes with fp32-rounded weights and its logits differ from megarl's
    fp64 ``CausalLM`` (whose router softmax runs in at least fp32, fp64 for fp64) by ~1e-8
    instead of ~1e-15. fp64 is the dtype of the CPU exactness tests (docs/design.md §1), so on CPU an
    fp64 router keeps fp64; fp32 and bf16 models still route in fp32, exactly as on GPU. Not a
    CUDA failure like the other patches: the one place where Megatron hard-codes a precision
    below the model's."""
    from megatron.core.transformer.moe import moe_utils

    if not isinstance(moe_utils.torch, _Fp64SoftmaxTorch):
        moe_utils.torch = _Fp64SoftmaxTorch()


def _patch_moe_host_splits() -> None:
    """The all-to-all token dispatcher fetches its split sizes with
    ``maybe_move_tensor_to_cpu(t, as_numpy=True)``, which only converts CUDA tensors: on CPU the
    sizes stay tensors and ``all_to_all_single`` rejects them (it takes sequences of ints; the
    CUDA path hands it numpy arrays). Convert CPU tensors the same way. ``token_dispatcher``
    imported the name directly, so it is rebound there."""
    from megatron.core.transformer.moe import token_dispatcher

    move = token_dispatcher.maybe_move_tensor_to_cpu
    if getattr(move, "_megarl_cpu", False):
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy().copy()  # a host copy, as the CUDA path's non-blocking D2H gives
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._megarl_cpu = True
    maybe_move_tensor_to_cpu.__doc__ = move.__doc__
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# Tags of pipeline p2p messages over gloo: a message's direction, so that a receive can only
# match a send going the same way (see _patch_p2p_directions).
_TAG_FORWARD, _TAG_BACKWARD, _TAG_SHAPE_FORWARD, _TAG_SHAPE_BACKWARD = 1, 2, 3, 4


def _directed_p2p(send_prev, recv_prev, send_next, recv_next, prev_rank, next_rank, group, tags):
    """isend/irecv of one pipeline exchange, each tagged by its direction: ``tags`` = (forward,
    backward); forward messages go to the next stage and come from the previous one."""
    fwd, bwd = tags
    reqs = []
    if send_prev is not None:
        reqs.append(torch.distributed.isend(send_prev, prev_rank, group=group, tag=bwd))
    if recv_prev is not None:
        reqs.append(torch.distributed.irecv(recv_prev, prev_rank, group=group, tag=fwd))
    if send_next is not None:
        reqs.append(torch.distributed.isend(send_next, next_rank, group=group, tag=fwd))
    if recv_next is not None:
        reqs.append(torch.distributed.irecv(recv_next, next_rank, group=group, tag=bwd))
    return reqs


def _patch_p2p_directions() -> None:
    """With two pipeline ranks the previous and the next stage are the same process, and the
    interleaved schedule (virtual pipeline stages) sends activations forward and gradients
    backward in one exchange. Megatron's batched p2p (and its shape exchange) post them untagged,
    and gloo matches a receive with the first send from that peer and tag: rank 0's gradient
    (sent to its "previous" stage) can land in rank 1's activation buffer (received from its
    "previous" stage) when both have the same shape. Seen on CPU: TP2 x PP2 x VPP2 training then
    diverges from the single-process run. NCCL groups these ops, and Megatron's non-batched path
    uses two communicators for pp=2; on gloo every pipeline message is tagged by its direction
    instead. Same messages, same order."""
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    if getattr(p2p._batched_p2p_ops, "_megarl_cpu", False):
        return

    def _batched_p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                         prev_pipeline_rank, next_pipeline_rank):
        return _directed_p2p(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                             prev_pipeline_rank, next_pipeline_rank, group, (_TAG_FORWARD, _TAG_BACKWARD))

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        def shape(t):
            return None if t is None else torch.tensor(t.size(), dtype=torch.int64)
        recv_prev_shape = torch.empty(3, dtype=torch.int64) if recv_prev else None
        recv_next_shape = torch.empty(3, dtype=torch.int64) if recv_next else None
        for req in _directed_p2p(shape(tensor_send_prev), recv_prev_shape, shape(tensor_send_next), recv_next_shape,
                                 self.prev_rank, self.next_rank, self.pp_group,
                                 (_TAG_SHAPE_FORWARD, _TAG_SHAPE_BACKWARD)):
            req.wait()
        return (recv_prev_shape.tolist() if recv_prev else [0, 0, 0],
                recv_next_shape.tolist() if recv_next else [0, 0, 0])

    _batched_p2p_ops._megarl_cpu = True
    p2p._batched_p2p_ops = _batched_p2p_ops
    p2p.P2PCommunicator._communicate_shapes = _communicate_shapes


_PATCHES: list[Callable[[], None]] = [
    _patch_shim_modules,
    _patch_rng_tracker,
    _patch_clip_grads,
    patch_optimizer_param_sort,
    _patch_tied_embedding_copy,
    _patch_moe_router_fp64, _patch_moe_host_splits,
    _patch_p2p_directions,
]


# Patches for a missing Transformer Engine, on CPU and GPU alike (megarl uses Megatron's local
# layer spec everywhere, so TE is optional on GPU too).
_TE_ABSENT_PATCHES: list[Callable[[], None]] = [
    _patch_moe_te_names,
]


def transformer_engine_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def install_te_absent() -> bool:
    """Apply the patches for a missing Transformer Engine (any device) when TE does not import.
    Returns True when they were needed. Safe to call any number of times."""
    if transformer_engine_importable():
        return False
    for patch in _TE_ABSENT_PATCHES:
        patch()
    return True


def install() -> bool:
    """Apply the patches for a missing Transformer Engine if it is missing (any device), then
    every CPU patch once. Returns True when the CPU patches are in place (no CUDA), False when
    CUDA is available and Megatron is left otherwise untouched. Safe to call any number of times."""
    global _installed
    install_te_absent()
    if torch.cuda.is_available():
        return False
    if not _installed:
        for patch in _PATCHES:
            patch()
        _installed = True
        logger.info("megarl.cpu_compat: Megatron-core patched for CPU (%d patches)", len(_PATCHES))
    return True

