"""Checksums of weights, exact and computed where the tensors live (used by the weight sync).

:func:`byte_checksum` is an integer checksum of a tensor's bytes on its own device (only three
integers go to the host); :func:`weight_checksum` combines the checksums of every full Megatron
tensor into one layout-independent hex string; :func:`tensor_checksum` is a host sha256 for tests
and tools comparing whole state dicts.
"""
from __future__ import annotations

import hashlib

import torch

from megarl.models import mcore_mapping
from megarl.models.config import ModelArgs

MODULUS = 2 ** 31 - 1  # prime modulus of the position-weighted sums
_MAX_TERMS = 1 << 16  # int32 partial sums of at most 2^16 int16 values cannot overflow
_BLOCK = 1 << 22  # elements reduced at once on the large-tensor path (bounds CPU temporaries)


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a 2-D integer tensor ``[rows, cols]``: int16 halves (uint8 for 1-byte
    dtypes), rows = the flattened leading dims, cols = the last dim's bytes / 2. No copy for
    tensors whose last dim is contiguous (row-parallel slices included)."""
    if t.dim() == 0:
        t = t.reshape(1)
    if t.stride(-1) != 1:
        t = t.contiguous()
    x = t.view(torch.uint8 if t.element_size() == 1 else torch.int16)
    if x.dim() == 1:
        return x.unsqueeze(0)
    return x if x.dim() == 2 else x.flatten(0, -2)


def byte_checksum(t: torch.Tensor) -> torch.Tensor:
    """Exact checksum of ``t``'s bytes, computed on ``t``'s device: int64 ``[3]``.

    With ``x = [rows, cols]`` the int16 halves of ``t`` (:func:`_int_view`): ``sum(x)``, and
    ``sum_r (r+1) * rowsum_r`` and ``sum_c (c+1) * colsum_c`` modulo the prime ``P = 2^31 - 1``.
    Row and column sums accumulate in int32 over at most 2^16 terms (|x| <= 2^15, so they cannot
    overflow), then in int64; each weighted term is below 2^62 and the sums below 2^63, so every
    value is exact for any tensor under 2^31 rows, 2^31 columns and 2^47 values. Any changed byte changes one int16
    value, hence ``sum(x)``; swapping two unequal values at different positions changes the row
    (or, in the same row, the column) sum by ``(w1 - w2) * (v1 - v2)``, both factors non-zero
    and smaller than ``P``, so never a multiple of it: every transposition is detected. The value
    depends on the bytes and the shape only (not on the strides)."""
    x = _int_view(t)
    rows_n, cols_n = x.shape
    if rows_n >= MODULUS or cols_n >= MODULUS:
        raise ValueError(f"byte_checksum: shape {tuple(t.shape)} has 2^31 or more rows or columns")
    if rows_n <= _MAX_TERMS and cols_n <= _MAX_TERMS and rows_n * cols_n <= _BLOCK:
        sums = torch.cat([x.sum(1, dtype=torch.int32), x.sum(0, dtype=torch.int32)]).long()
    else:  # blocks of <= 2^16 rows and columns: int32 partial sums, accumulated in int64
        sums = torch.zeros(rows_n + cols_n, dtype=torch.int64, device=x.device)
        rows, cols = sums[:rows_n], sums[rows_n:]
        step_r = max(1, min(_MAX_TERMS, _BLOCK // min(cols_n, _MAX_TERMS)))
        for c0 in range(0, cols_n, _MAX_TERMS):
            block = x[:, c0:c0 + _MAX_TERMS]
            for r0 in range(0, rows_n, step_r):
                part = block[r0:r0 + step_r]
                rows[r0:r0 + step_r] += part.sum(1, dtype=torch.int32)
                cols[c0:c0 + _MAX_TERMS] += part.sum(0, dtype=torch.int32)
    weights = torch.arange(1, rows_n + cols_n + 1, dtype=torch.int64, device=x.device)
    weights[rows_n:] -= rows_n  # rows weighted 1..rows, columns 1..cols
    weighted = sums.remainder(MODULUS).mul_(weights).remainder_(MODULUS)
    return torch.stack([sums[:rows_n].sum(), weighted[:rows_n].sum(), weighted[rows_n:].sum()])


def combine_checksums(entries: list[tuple[str, str, tuple[int, ...], list[int]]]) -> str:
    """sha256 (hex) over (name, dtype, shape, checksum) of every full tensor, in name order."""
    h = hashlib.sha256()
    for name, dtype, shape, cs in sorted(entries):
        h.update(f"{name}|{dtype}|{tuple(shape)}|{cs[0]},{cs[1]},{cs[2]};".encode())
    return h.hexdigest()


def weight_checksum(hf_state: dict[str, torch.Tensor], args: ModelArgs) -> str:
    """The ``weight_checksum`` a :class:`WeightSync` reports for trainer weights equal to the full
    HF-named ``hf_state`` (in the trainer's dtype), whatever the layout."""
    full = mcore_mapping.hf_to_mcore(hf_state, args)
    sums = torch.stack([byte_checksum(t) for t in full.values()]).cpu().tolist()
    return combine_checksums([(k, str(t.dtype), tuple(t.shape), cs) for (k, t), cs in zip(full.items(), sums)])[:16]


def tensor_checksum(named: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every tensor, in name order, on the host
    (for tests and tools comparing whole state dicts; the sync itself uses :func:`byte_checksum`)."""
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
