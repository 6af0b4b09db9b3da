"""Splitting a trainer batch into micro-batches: rows of similar length together, each micro-batch
cut to its longest row. Per-row entries (tensors whose first dim is the batch size) are split;
everything else (the step's token count, python values) goes to every micro-batch unchanged.

What the model runs on (:class:`ModelInput`, :func:`model_input`): the micro-batch's rows packed
into one sequence without padding (THD: each row attends to itself only, from position 0), or, where
every micro-batch must have one shape (virtual pipeline stages), the rows right padded to the
batch's longest. Either way only the positions whose next-token logprob is needed (the loss mask's)
go through the output layer and the log-softmax over the vocabulary; the logprobs come back in the
micro-batch's dense [rows, width - 1] layout, so ``loss_fn`` sees the same tensor whatever the
layout (docs/design.md §1.4: the loss does not depend on the split).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
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


def row_groups(lengths: torch.Tensor, order: torch.Tensor, size: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """``order`` cut into consecutive groups: of ``size`` rows, or (``max_tokens`` > 0) of as many
    rows as fit in ``max_tokens`` tokens by ``lengths`` (a longer row alone)."""
    if max_tokens <= 0:
        return [order[start:start + size] for start in range(0, len(order), size)]
    groups, start, total = [], 0, 0
    for i, n in enumerate(lengths[order].tolist()):
        if i > start and total + n > max_tokens:
            groups.append(order[start:i])
            start, total = i, 0
        total += n
    if start < len(order):
        groups.append(order[start:])
    return groups


def micro_batches(batch: dict[str, Any], size: int, order: torch.Tensor | None = None, trim: bool = True,
                  max_tokens: int = 0):
    """Split per-row entries (tensors whose first dim is the batch size) into slices of ``size``
    rows (``max_tokens`` > 0: of up to that many tokens, see :func:`row_groups`), taken in
    ``order`` (rows of similar length together), and trim each slice's time axis to its longest
    row (``trim=False``: to the batch's longest row, one width for all). Everything else (0-d
    tensors such as the step's token count, python values) is passed to every micro-batch
    unchanged."""
    n, t = batch["input_ids"].shape
    lengths = row_lengths(batch)
    order = torch.arange(n) if order is None else order
    for rows in row_groups(lengths, order, size, max_tokens):
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


@dataclass
class ModelInput:
    """What the model runs on for one micro-batch of ``n`` rows of width ``w``, and which of its
    outputs are scored.

    ``input_ids``, ``position_ids``: [n, w] (the rows, right padded) or, packed, [1, total] (the
    rows one after another without padding, positions restarting at 0 in each) with
    ``cu_seqlens`` [n + 1] (int32: where each row starts) and ``max_seqlen``. ``select`` [k]: the
    positions, in the model's flattened [s, b] layout of hidden states, whose next-token logprob is
    needed, ``targets`` [k] the next tokens there, and ``rows``, ``cols`` [k] where each logprob
    goes in the micro-batch's [n, w - 1] layout."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    select: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def to(self, device) -> "ModelInput":
        return replace(self, **{k: getattr(self, k).to(device)
                                for k in ("input_ids", "position_ids", "select", "targets", "rows", "cols")},
                       cu_seqlens=None if self.cu_seqlens is None else self.cu_seqlens.to(device))

    def packed_seq_params(self):
        """Megatron's ``PackedSeqParams`` (THD) of a packed input, else None."""
        if self.cu_seqlens is None:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def scatter(self, values: torch.Tensor, width: int) -> torch.Tensor:
        """``values`` [k] (one per selected position) in the micro-batch's [n, width - 1] layout,
        0 elsewhere (differentiable)."""
        return values.new_zeros(self.n_rows, width - 1).index_put((self.rows, self.cols), values)

    @property
    def n_rows(self) -> int:
        return len(self.cu_seqlens) - 1 if self.cu_seqlens is not None else self.input_ids.shape[0]


def model_input(mb: dict[str, Any], pack: bool, multiple: int = 1) -> ModelInput:
    """The :class:`ModelInput` of micro-batch ``mb`` (``input_ids`` [n, w], optional ``loss_mask``
    [n, w - 1]): the positions scored are the loss mask's (all positions without a mask). Packed
    (``pack``), each row keeps its tokens through its last scored target (:func:`row_lengths`).

    ``multiple``: the sequence the model runs on is padded to a multiple of it (sequence
    parallelism splits it over the TP ranks: megarl/trainer/sequence_parallel.py). Packed,
    the last row gets the padding tokens after its own, which causal attention hides from its
    real tokens; right padded, every row gets padding columns. Neither is scored."""
    ids = mb["input_ids"]
    n, w = ids.shape
    mask = mb.get("loss_mask")
    if mask is None:
        rows, cols = (x.reshape(-1) for x in torch.meshgrid(torch.arange(n), torch.arange(w - 1), indexing="ij"))
    else:
        rows, cols = (mask != 0).nonzero(as_tuple=True)
    targets = ids[rows, cols + 1]
    if not pack:
        ids = torch.nn.functional.pad(ids, (0, -w % multiple))  # the select below does not depend on the width
        pos = torch.arange(ids.shape[1]).expand(n, ids.shape[1])
        return ModelInput(ids, pos, cols * n + rows, targets, rows, cols)  # hidden states are [s, b]
    lengths = row_lengths(mb)
    starts = torch.cumsum(lengths, 0) - lengths
    keep = torch.arange(w)[None, :] < lengths[:, None]
    packed_ids = ids[keep][None]  # row-major: row 0's tokens, then row 1's, ...
    pos = torch.arange(w).expand(n, w)[keep][None]
    pad = -packed_ids.shape[1] % multiple
    if pad:  # the last row runs on: tokens 0 at its next positions
        packed_ids = torch.nn.functional.pad(packed_ids, (0, pad))
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1)], dim=1)
        lengths = torch.cat([lengths[:-1], lengths[-1:] + pad])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths, 0).to(torch.int32)])
    return ModelInput(packed_ids, pos, starts[rows] + cols, targets, rows, cols, cu, int(lengths.max()))
