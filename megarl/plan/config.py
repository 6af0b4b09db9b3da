"""The ``memory`` section: the memory check at the start of ``megarl train`` (megarl/plan/check.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemoryConfig:
    """Whether a run is checked against its devices' memory before it starts."""

    check: bool = True
    """Refuse a run whose memory plan (``megarl plan``) does not fit a device, before anything is
    written, naming the biggest term and what would make it fit. The check runs when the device
    memory is known: the GPU's own on CUDA, ``device_memory_gb`` when set (on CPU, the only way)."""
    device_memory_gb: float = 0.0
    """Memory per device (GiB) the check plans for; 0: the CUDA device's own, and no check on CPU."""
    reserve_gb: float = 3.0
    """Memory (GiB) outside the plan's tensors kept free on each device: the CUDA context (~0.5),
    NCCL's buffers, the caching allocator's fragmentation. A rule of thumb, not a measurement."""

    def __post_init__(self) -> None:
        from megarl.utils.dataclass_config import check_number

        check_number("memory.device_memory_gb", self.device_memory_gb, ge=0, note="0 = the CUDA device's own")
        check_number("memory.reserve_gb", self.reserve_gb, ge=0)
