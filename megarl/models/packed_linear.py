"""Linears over weights reordered once for oneDNN: the CPU rollout engine's matmuls.

Why: torch's ``F.linear`` on an x86 CPU runs fp32 through MKL's sgemm, which on the AMD EPYC
machines of this project takes a generic path, single-threaded at one row, and whose rows come
out in other bits depending on the row count (rows past the last multiple of 4 of a GEMM of
fewer than 12 rows take another kernel). oneDNN's linear over a weight reordered once into its
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what torch.compile's CPU freezing
path uses) measured, over SmolLM2-135M's linears with the weights out of cache (2 threads,
docs/benchmarks.md "Prepacked linears"): fp32 2.1-3.0x at 1 row, 2.3-2.8x at 64 rows; bf16
1.3-2.1x / 1.3-1.5x (two runs).
And every row of it gets the same bits for any row count from 2 up (fp32 and bf16, every shape
tested, tests/engine/test_packed_linear.py); a lone row may not (fp32 with 1536 input features
splits the reduction), which the engine's twin row covers (``ModelRunner.forward``).

How: the engine opens ``PackedLinears.active()`` around its forwards; inside it, ``linear`` (which
every linear of ``megarl.models.llama`` calls) finds or makes the reordered copy of its weight.
The engine calls ``refresh()`` once per ``generate`` (a check over every parameter: ~0.3 ms for
SmolLM2, too much to repeat at every forward).
Outside it, or for other dtypes (fp64: the exactness tests) and devices, ``linear`` is
``F.linear``. The copies cost one more copy of the weights in memory; they are dropped and
remade lazily when any parameter of the model changed, detected by ``(data_ptr, _version)``,
which in-place writes through the parameters (``copy_``, ``load_state_dict``, the weight sync)
bump; a write through ``param.data`` does not and is not seen.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = (torch.float32, torch.bfloat16)
_state = threading.local()  # .packs: the PackedLinears of the engine forward running in this thread


def available() -> bool:
    """Whether this torch build has oneDNN's reorder/linear ops on this CPU."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an engine of this dtype and device can use packed linears."""
    return device.type == "cpu" and dtype in DTYPES and available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the reordered copy of ``weight`` while an engine's
    ``PackedLinears`` is active in this thread."""
    packs = getattr(_state, "packs", None)
    if packs is None or x.dtype not in DTYPES or x.dtype != weight.dtype or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, packs.packed(weight), bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is ``linear`` (same parameters, names and math)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class PackedLinears:
    """The reordered weights of one model, made on first use and kept while its parameters are
    unchanged."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight, packed)
        self._stamp: tuple | None = None

    def packed(self, weight: torch.Tensor) -> torch.Tensor:
        hit = self._packed.get(id(weight))
        if hit is None or hit[0] is not weight:
            # No batch-size hint: with one, a 1-row input took another kernel than 2+ rows (measured).
            hit = (weight, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
            self._packed[id(weight)] = hit
        return hit[1]

    def refresh(self) -> None:
        """Drop every copy if any parameter was written or replaced since they were made."""
        params = list(self.model.parameters())
        if any(p.is_inference() for p in params):  # no version counter: assume written
            stamp = None
        else:
            stamp = tuple((p.data_ptr(), p._version) for p in params)
        if stamp is None or stamp != self._stamp:
            self._packed.clear()
            self._stamp = stamp

    @contextlib.contextmanager
    def active(self):
        """Run this model's linears on the reordered weights inside the block (this thread); see
        ``refresh`` for weights written since they were made."""
        outer = getattr(_state, "packs", None)
        _state.packs = self
        try:
            yield
        finally:
            _state.packs = outer
