"""KV cache with fixed slots, and the attention backend that reads and writes it.

Each running request owns one *slot*: a row of the preallocated k/v tensors
``[n_layers, max_slots, max_seq_len, n_kv_heads, head_dim]``. The slot table (which slots are
free, how many positions each one holds) is plain Python, so the scheduler and its tests never
touch the device (DESIGN.md §3). A forward over a batch of slots gets a ``CacheAttention``
object built once per forward: it writes the new k/v of every row at that row's positions and
attends over the row's cached prefix plus its new tokens.
"""
from __future__ import annotations

import heapq

import torch

from megarl.models.llama import attention


class SlotTable:
    """Host-side bookkeeping: free slots and the number of cached positions of each slot."""

    def __init__(self, max_slots: int, max_seq_len: int):
        if max_slots < 1 or max_seq_len < 1:
            raise ValueError(f"max_slots={max_slots} and max_seq_len={max_seq_len} must be >= 1")
        self.max_slots, self.max_seq_len = max_slots, max_seq_len
        self._free = list(range(max_slots))  # min-heap: lowest free slot first (deterministic)
        self.lengths = [0] * max_slots
        self._used = [False] * max_slots

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.max_slots - len(self._free)

    def allocate(self) -> int:
        """Take the lowest free slot; its cached length starts at 0."""
        if not self._free:
            raise RuntimeError(f"no free KV-cache slot (all {self.max_slots} in use)")
        slot = heapq.heappop(self._free)
        self._used[slot], self.lengths[slot] = True, 0
        return slot

    def free(self, slot: int) -> None:
        """Return a slot; its stale k/v stay in memory and are overwritten by the next owner."""
        if not 0 <= slot < self.max_slots or not self._used[slot]:
            raise ValueError(f"slot {slot} is not allocated")
        self._used[slot], self.lengths[slot] = False, 0
        heapq.heappush(self._free, slot)

    def reserve(self, slots: list[int], n_new: list[int]) -> list[int]:
        """Claim ``n_new[i]`` more positions in ``slots[i]``; returns the start positions (the
        cached lengths before the claim). Called on the host right before the forward that
        writes those positions."""
        starts = []
        for slot, n in zip(slots, n_new):
            if not self._used[slot]:
                raise ValueError(f"slot {slot} is not allocated")
            start = self.lengths[slot]
            if n < 1 or start + n > self.max_seq_len:
                raise ValueError(f"slot {slot}: cannot add {n} positions to {start} "
                                 f"(max_seq_len={self.max_seq_len})")
            starts.append(start)
            self.lengths[slot] = start + n
        return starts


    def truncate(self, slot: int, length: int) -> None:
        """Forget cached positions >= ``length`` of ``slot`` (rejected draft tokens): they are
        never read again (attention masks by position) and the next forward overwrites them."""
        if not self._used[slot]:
            raise ValueError(f"slot {slot} is not allocated")
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"slot {slot}: cannot truncate {self.lengths[slot]} cached positions to {length}")
        self.lengths[slot] = length


class KVCache:
    """Preallocated k/v tensors plus their ``SlotTable``."""

    def __init__(self, n_layers: int, max_slots: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.table = SlotTable(max_slots, max_seq_len)
        shape = (n_layers, max_slots, max_seq_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def batch(self, slots: list[int], n_new: list[int]) -> tuple["CacheAttention", torch.Tensor]:
        """Reserve ``n_new[i]`` positions in each slot and build the attention backend for one
        forward whose input is padded to ``max(n_new)`` tokens per row. Also returns the
        positions [B, T] to give the model (padding positions continue the row's count; their
        outputs are garbage and must be ignored by the caller)."""
        starts = self.table.reserve(slots, n_new)
        return CacheAttention(self, slots, starts, n_new), _positions(starts, max(n_new), self.device)


def _positions(starts: list[int], t: int, device) -> torch.Tensor:
    return torch.tensor(starts, dtype=torch.int64, device=device)[:, None] + torch.arange(t, device=device)


class CacheAttention:
    """Attention backend (``attn(layer_idx, q, k, v)``) for one forward over a batch of slots.

    Row b holds ``n_new[b]`` real tokens (the rest of the T columns is padding) that go to
    positions ``starts[b] ..``  of slot ``slots[b]``. Only real tokens are written to the cache,
    and every row reads its own slot only, so padding and other rows cannot leak into a row."""

    def __init__(self, cache: KVCache, slots: list[int], starts: list[int], n_new: list[int]):
        dev = cache.device
        b, t = len(slots), max(n_new)
        self.cache = cache
        self.n_keys = max(s + n for s, n in zip(starts, n_new))  # keys to read (<= max_seq_len)
        self.slot_idx = torch.tensor(slots, dtype=torch.int64, device=dev)
        pos = _positions(starts, t, dev)
        valid = torch.arange(t, device=dev)[None, :] < torch.tensor(n_new, device=dev)[:, None]
        # Flat (row, column) and (slot, position) indices of the real tokens, built once and
        # reused by every layer.
        self.src_rows, self.src_cols = valid.nonzero(as_tuple=True)
        self.dst_slots = self.slot_idx[self.src_rows]
        self.dst_pos = pos[self.src_rows, self.src_cols]
        # Causal over absolute positions: query at position p sees keys 0..p of its own slot.
        key_pos = torch.arange(self.n_keys, device=dev)
        self.mask = key_pos[None, None, :] <= pos[:, :, None]  # [B, T, n_keys]
        self.shape = (b, t)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ck, cv = self.cache.k[layer_idx], self.cache.v[layer_idx]
        ck[self.dst_slots, self.dst_pos] = k[self.src_rows, self.src_cols]
        cv[self.dst_slots, self.dst_pos] = v[self.src_rows, self.src_cols]
        keys = ck[self.slot_idx, : self.n_keys]  # [B, n_keys, Hkv, D]
        values = cv[self.slot_idx, : self.n_keys]
        return attention(q, keys, values, self.mask)
