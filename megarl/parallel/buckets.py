"""The weight sync's plan (megarl/parallel/weight_sync.py): which tensors travel together.

Every process computes the same list of buckets from the model's shapes and the trainer's
TP/PP/EP layout alone, so the senders' packing and the receivers' unpacking agree without any
message about it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.models import mcore_sharding
from megarl.models.config import ModelArgs

ALIGN = 16  # piece offsets: any dtype can view its bytes in place
HEADER = 4  # trailer header: bucket index, sender's global rank, its tp_rank, its ep_rank
EXPERT_MARK = "mlp.experts.local_experts."


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN




@dataclass(frozen=True)
class BucketItem:
    """One tensor of a bucket: where its piece sits in every chunk, and the full tensor(s) it is
    cut from."""

    local: str
    """Name in the owner stage's GPTModel state dict."""
    kind: str
    """TP cut (``mcore_sharding`` table)."""
    shape: tuple[int, ...]
    """Piece shape (equal on every TP rank)."""
    full_shape: tuple[int, ...]
    """Full tensor shape, vocab padding stripped."""
    names: tuple[str, ...]
    """Full Megatron name per EP rank (expert buckets) or the one name (dense buckets)."""
    offset: int
    """Byte offset of the piece in a chunk."""
    nbytes: int
    """Bytes of the piece."""


@dataclass(frozen=True)
class Bucket:
    """Tensors moved together: one flat buffer (chunk) per rank, one collective per hop."""

    index: int
    """Position in the sync order (error messages name it)."""
    stage: int
    """Pipeline stage that owns the tensors."""
    expert: bool
    """MoE expert tensors (gathered over the EP group) rather than dense ones."""
    items: tuple[BucketItem, ...]
    """The tensors, in chunk order."""
    payload: int
    """Bytes of the pieces in a chunk (aligned); the trailer follows."""
    chunk: int
    """Bytes of one rank's chunk: payload and trailer (int64 header + 3 per piece), aligned."""
    gathered: int
    """Bytes of the buffer after every hop: ``chunk`` times tp (times ep for experts)."""


def plan_buckets(args: ModelArgs, tp: int, pp: int, ep: int, dtype: torch.dtype,
                 bucket_bytes: int) -> list[Bucket]:
    """The sync's buckets (see the module docstring): stage by stage, dense tensors then experts,
    greedily filled while the gathered buffer stays within ``bucket_bytes``. Pure arithmetic,
    the same on every rank."""
    esize = torch.empty((), dtype=dtype).element_size()
    buckets: list[Bucket] = []

    def emit(stage: int, expert: bool, items: list[tuple]) -> None:
        chunks = tp * (ep if expert else 1)
        current: list[BucketItem] = []
        offset = 0

        def sizes(n_items: int, payload: int) -> tuple[int, int]:
            chunk = payload + align(8 * (HEADER + 3 * n_items))
            return chunk, chunk * chunks

        def close() -> None:
            nonlocal current, offset
            if current:
                chunk, gathered = sizes(len(current), offset)
                buckets.append(Bucket(len(buckets), stage, expert, tuple(current), offset, chunk, gathered))
            current, offset = [], 0

        for local, lt, names in items:
            nbytes = esize * numel(lt.shape)
            if current and sizes(len(current) + 1, offset + align(nbytes))[1] > bucket_bytes:
                close()
            current.append(BucketItem(local, lt.kind, lt.shape, lt.full_shape, names, offset, nbytes))
            offset += align(nbytes)
        close()

    for stage in range(pp):
        plans = [mcore_sharding.local_plan(args, tp, pp, stage, ep=ep, ep_rank=e) for e in range(ep)]
        dense = [(k, lt, (lt.name,)) for k, lt in plans[0].items() if EXPERT_MARK not in k and not lt.tied_copy]
        experts = [(k, lt, tuple(p[k].name for p in plans)) for k, lt in plans[0].items() if EXPERT_MARK in k]
        emit(stage, False, dense)
        emit(stage, True, experts)
    return buckets


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
