"""Megatron-core's mixed-precision optimizer on CPU (part of the CPU compatibility layer,
:mod:`megarl.parallel.cpu_compat`, which applies these patches with its others).

``Float16OptimizerWithFloat16Params`` (Megatron's bf16 optimizer: fp32 master copies of the bf16
weights) sorts the parameters by ``Tensor.type()`` names, ``torch.cuda.BFloat16Tensor`` and
``torch.cuda.FloatTensor``, and refuses any other: a CPU bf16 parameter (``torch.BFloat16Tensor``)
is refused. The sort is the only CUDA-specific part; its device buffers come from the torch proxy.
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


def patch_float16_optimizer() -> None:
    """Run ``Float16OptimizerWithFloat16Params.__init__`` with CPU tensors' types named as their
    CUDA twins, so that it sorts bf16 parameters into its fp32-master groups as on GPU."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params as Opt

    init = Opt.__init__
    if getattr(init, "_megarl_cpu", False):
        return

    def __init__(self, *args, **kwargs):
        real_type = torch.Tensor.type
        torch.Tensor.type = _cuda_type_names(real_type)
        try:
            init(self, *args, **kwargs)
        finally:
            torch.Tensor.type = real_type

    __init__._megarl_cpu = True
    __init__.__doc__ = init.__doc__
    Opt.__init__ = __init__
