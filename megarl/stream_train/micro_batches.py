"""Splitting a trainer batch into micro-batches: rows of similar length together, each micro-batch
cut to its longest row, so right padding never costs compute. Per-row entries (tensors whose first
dim is the batch size) are split; everything else (the step's token count, python values) goes to
every micro-batch unchanged."""
from __future__ import annotations

from typing import Any

import torch


def row_lengths(batch: dict[str, Any]) -> torch.Tensor:
    """Tokens each row needs: through its last trained target (``loss_mask``); without a mask the
    padding is unknown, so the full width."""
    mask = batch.get("loss_mask")
    n, t = batch["input_ids"].shape
    if mask is None:
        return torch.full((n,), t, dtype=torch.long)
    idx = torch.arange(1, mask.shape[1] + 1).expand_as(mask)
    return (idx * (mask != 0)).amax(dim=1) + 1  # last target position + 1, >= 1


def micro_batches(batch: dict[str, Any], size: int, order: torch.Tensor | None = None, trim: bool = True):
    """Split per-row entries (tensors whose first dim is the batch size) into slices of ``size``
    rows, taken in ``order`` (rows of similar length together), and trim each slice's time axis
    to its longest row: right padding never costs compute (``trim=False``: to the batch's longest
    row, one width for all). Everything else (0-d tensors such as the step's token count, python
    values) is passed to every micro-batch unchanged."""
    n, t = batch["input_ids"].shape
    lengths = row_lengths(batch)
    order = torch.arange(n) if order is None else order
    for start in range(0, n, size):
        rows = order[start:start + size]
        width = int(lengths[rows].max() if trim else lengths[order].max())
        mb = {}
        for k, v in batch.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
                v = v[rows]
                if v.dim() > 1 and v.shape[1] == t:
                    v = v[:, :width]
                elif v.dim() > 1 and v.shape[1] == t - 1:
                    v = v[:, :width - 1]
            mb[k] = v
        yield mb


def pad_rows(batch: dict[str, Any], extra: int) -> dict[str, Any]:
    """``batch`` with ``extra`` more rows, copies of row 0 with an all-zero ``loss_mask``: they add
    exactly 0 to every masked sum (loss, metrics, gradients)."""
    n = batch["input_ids"].shape[0]
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
            pad = torch.zeros_like(v[:1]) if k == "loss_mask" else v[:1]
            v = torch.cat([v, pad.expand(extra, *v.shape[1:])])
        out[k] = v
    return out


def length_order(batch: dict[str, Any]) -> torch.Tensor:
    """Rows sorted by length (stable), so micro-batches hold rows of similar length."""
    return torch.sort(row_lengths(batch), stable=True).indices
