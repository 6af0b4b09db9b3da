"""The inputs of speculative verification, checked once for both backends (megarl/engine/verify.py,
the torch reference and dispatcher, and megarl/engine/verify_triton.py, the kernel): a leaf
module, so neither imports the other to share them. The sampling set-up of the rows is a
``SamplingRows`` (megarl/engine/sampling_rows.py), which checks its own fields' dtypes."""
from __future__ import annotations

import torch

from megarl.engine.sampling_rows import SamplingRows

TRITON_DTYPES = (torch.float32, torch.float64)


def _check(name: str, t, shape: tuple, kind: str, device) -> None:
    """Shape / dtype-kind / device check with an error that names the argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"verify: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"verify: {name} has shape {tuple(t.shape)}, expected {shape}")
    ok = t.dtype == torch.int64 if kind == "int64" else t.dtype.is_floating_point
    if not ok:
        raise TypeError(f"verify: {name} has dtype {t.dtype}, expected {kind}")
    if t.device != device:
        raise ValueError(f"verify: {name} is on {t.device}, expected the logits' device {device}")


def check_inputs(logits, draft_next, row_start, rows: SamplingRows) -> None:
    """Validate shapes, dtypes, devices, the row grouping and the sampling parameters' ranges
    (one small device->host read). ``rows`` checked its own fields' dtypes and sizes when built."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError("verify: logits must be a floating tensor [N, V]")
    n, v = logits.shape
    if n < 1 or v < 1:
        raise ValueError(f"verify: logits shape {tuple(logits.shape)} is empty")
    dev = logits.device
    if not isinstance(row_start, torch.Tensor) or row_start.dim() != 1 or row_start.numel() < 2:
        raise ValueError("verify: row_start must be an int64 tensor [B+1] with B >= 1")
    b = row_start.numel() - 1
    _check("row_start", row_start, (b + 1,), "int64", dev)
    _check("draft_next", draft_next, (n,), "int64", dev)
    if not isinstance(rows, SamplingRows):
        raise TypeError(f"verify: rows must be a SamplingRows (megarl/engine/sampling_rows.py), got "
                        f"{type(rows).__name__}")
    if len(rows) != b or rows.temperature.device != dev:
        raise ValueError(f"verify: rows holds {len(rows)} requests on {rows.temperature.device}; row_start "
                         f"groups {b} requests on the logits' device {dev}")
    # one device->host read for every value check
    flags = torch.stack([~(rows.temperature >= 0).all(), (rows.top_k < 0).any(),
                         ~((rows.top_p > 0) & (rows.top_p <= 1)).all()])
    *rs, bad_t, bad_k, bad_p = torch.cat([row_start, flags.to(torch.int64)]).tolist()
    if rs[0] != 0 or rs[-1] != n or any(hi <= lo for lo, hi in zip(rs, rs[1:])):
        raise ValueError(f"verify: row_start must rise strictly from 0 to N={n} (every request >= 1 row), "
                         f"got {rs if b <= 16 else rs[:8] + ['...'] + rs[-8:]}")
    for bad, msg in [(bad_t, "temperature must be >= 0 (0 = greedy)"), (bad_k, "top_k must be >= 0 (0 = off)"),
                     (bad_p, "top_p must lie in (0, 1] (1 = off)")]:
        if bad:
            raise ValueError(f"verify: {msg}")


def row_request(row_start: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request index, row index within the request) of every row [N] (no host sync)."""
    rows = torch.arange(n, device=row_start.device)
    req = torch.searchsorted(row_start, rows, right=True) - 1
    return req, rows - row_start[req]
