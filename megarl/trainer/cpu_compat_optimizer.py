"""Megatron-core's mixed-precision and distributed optimizers on CPU (part of the CPU
compatibility layer, :mod:`megarl.trainer.cpu_compat`, which applies this patch with its others).

``Float16OptimizerWithFloat16Params`` (Megatron's bf16 optimizer: fp32 master copies of the bf16
weights) sorts the parameters by ``Tensor.type()`` names, ``torch.cuda.BFloat16Tensor`` and
``torch.cuda.FloatTensor``, and refuses any other: a CPU bf16 parameter (``torch.BFloat16Tensor``)
is refused; ``DistributedOptimizer`` (ZeRO-1) sorts its parameters the same way. The sort is the
only CUDA-specific part; their device buffers come from the torch proxy (cpu_compat's shimmed
modules).
"""
from __future__ import annotations

import torch


def _cuda_type_names(real_type):
    """``Tensor.type`` that names a CPU tensor's type as its CUDA twin (``torch.BFloat16Tensor``
    -> ``torch.cuda.BFloat16Tensor``); with a target type, the real conversion."""
    def type_(tensor, dtype=None, non_blocking=False, **kwargs):
        name = real_type(tensor, dtype, non_blocking, **kwargs)
        if dtype is None and not tensor.is_cuda and name.startswith("torch.") and name.endswith("Tensor"):
            return "torch.cuda." + name[len("torch."):]
        return name
    return type_


def _with_cuda_type_names(init):
    def __init__(self, *args, **kwargs):
        real_type = torch.Tensor.type
        torch.Tensor.type = _cuda_type_names(real_type)
        try:
            init(self, *args, **kwargs)
        finally:
            torch.Tensor.type = real_type

    __init__._megarl_cpu = True
    __init__.__doc__ = init.__doc__
    return __init__


def patch_optimizer_param_sort() -> None:
    """Run the ``__init__`` of ``Float16OptimizerWithFloat16Params`` and of ``DistributedOptimizer``
    (which sorts its parameters the same way) with CPU tensors' types named as their CUDA twins,
    so that they sort parameters into their groups as on GPU."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for cls in (Float16OptimizerWithFloat16Params, DistributedOptimizer):
        if not getattr(cls.__init__, "_megarl_cpu", False):
            cls.__init__ = _with_cuda_type_names(cls.__init__)
