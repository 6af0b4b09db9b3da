"""Where a collective's tensors must live, and the collectives torch renamed.

A process group's backend decides which tensors it accepts: NCCL only CUDA tensors, gloo CPU
ones (and a few CUDA ops). megarl's groups are NCCL on GPU and gloo on CPU, and the CPU test
suite runs only gloo: a small tensor made on the CPU for a reduction (a metric, a flag, a count)
works there and is refused by NCCL on the cluster. So every tensor megarl hands to a collective
is made on (or moved to) :func:`group_device` of the group it goes over.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a collective over ``group`` (None: the default group) takes its tensors on: the
    current CUDA device when the group's backend is NCCL (also a ``cpu:gloo,cuda:nccl`` pair:
    CUDA tensors go to NCCL there), the CPU otherwise (gloo)."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Every rank's equal-sized ``input`` concatenated into ``output`` in rank order.

    ``dist.all_gather_single`` is torch 2.13's name; before it the same collective was
    ``dist.all_gather_into_tensor`` (which 2.13 deprecates), the name older torch releases (such as
    the 2.11 of current NVIDIA containers) have."""
    gather = getattr(dist, "all_gather_single", None)
    if gather is None:
        gather = dist.all_gather_into_tensor
    gather(output, input, group=group)
