"""KV cache with fixed slots, and the attention backend that reads and writes it.

Each running request owns one *slot*: a row of the preallocated k/v tensors
``[n_layers, max_slots, n_kv_heads, max_seq_len, head_dim]`` (heads before positions, so that a
slot's keys of one head are contiguous and attention reads them without copies). The slot table (which slots are
free, how many positions each one holds) is plain Python, so the scheduler and its tests never
touch the device (docs/design.md §2). A forward over a batch of slots gets a ``CacheAttention``
object built once per forward: it writes the new k/v of every row at that row's positions and
attends over the row's cached prefix plus its new tokens.
"""
from __future__ import annotations

import heapq

import torch

from megarl.models.llama import grouped_attention


def _positions(starts: list[int], t: int, device) -> torch.Tensor:
    return torch.tensor(starts, dtype=torch.int64, device=device)[:, None] + torch.arange(t, device=device)


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

    def can_allocate(self, max_positions: int | None = None, shared: int = 0) -> bool:
        """Whether ``allocate`` would succeed (a slot holds max_seq_len positions: the arguments,
        which the paged cache's ``BlockTable`` needs, never matter here)."""
        return bool(self._free)

    def allocate(self, max_positions: int | None = None, shared: int = 0) -> int:
        """Take the lowest free slot; its cached length starts at 0. (The arguments are the
        paged ``BlockTable``'s; a slot always has room for max_seq_len positions.)"""
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

    def highest_used(self) -> int:
        """The highest allocated slot, or -1 when none is."""
        return max((i for i, u in enumerate(self._used) if u), default=-1)

    def lowest_free(self) -> int:
        """The slot ``allocate`` would hand out next, or -1 when none is free."""
        return self._free[0] if self._free else -1

    def move(self, src: int, dst: int) -> None:
        """Bookkeeping of moving allocated slot ``src``'s positions to free slot ``dst``: ``dst``
        becomes allocated with ``src``'s length and ``src`` is freed."""
        if not 0 <= src < self.max_slots or not self._used[src]:
            raise ValueError(f"slot {src} is not allocated")
        if not 0 <= dst < self.max_slots or self._used[dst]:
            raise ValueError(f"slot {dst} is not free")
        self._free.remove(dst)
        heapq.heapify(self._free)
        self._used[dst], self.lengths[dst] = True, self.lengths[src]
        self.free(src)

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

    needs_compaction = True  # rows in consecutive slots are read in place (megarl/engine/scheduler.py)

    def __init__(self, n_layers: int, max_slots: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, windows: list[int | None] | None = None):
        self.table = SlotTable(max_slots, max_seq_len)
        self.windows = windows  # per layer: its sliding window, None = full causal (ModelArgs.window)
        shape = (n_layers, max_slots, n_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def batch(self, slots: list[int], n_new: list[int]) -> tuple["CacheAttention", torch.Tensor]:
        """Reserve ``n_new[i]`` positions in each slot and build the attention backend for one
        forward over the *packed* new tokens: row 0's ``n_new[0]`` tokens, then row 1's, ...
        (N = sum(n_new) tokens, no padding). Also returns their positions [1, N], to give the
        model together with input ids of shape [1, N]."""
        starts = self.table.reserve(slots, n_new)
        attn = CacheAttention(self, slots, starts, n_new)
        return attn, attn.positions

    def share_prefix(self, src: int, dst: list[int], length: int) -> None:
        """Copy the first ``length`` cached positions of slot ``src`` into the (empty) slots
        ``dst``: the samples of a GRPO group share their prompt, whose k/v are computed once."""
        if not dst:
            return
        for slot in dst:
            if self.table.lengths[slot] != 0:
                raise ValueError(f"slot {slot} is not empty ({self.table.lengths[slot]} cached positions)")
        if length > self.table.lengths[src]:
            raise ValueError(f"slot {src} holds {self.table.lengths[src]} positions, not {length}")
        idx = torch.tensor(dst, dtype=torch.int64, device=self.device)
        for t in (self.k, self.v):
            t[:, idx, :, :length] = t[:, src:src + 1, :, :length]
        self.table.reserve(dst, [length] * len(dst))


    def move(self, src: int, dst: int) -> None:
        """Move the cached positions of allocated slot ``src`` into free slot ``dst`` and free
        ``src``. The engine moves its highest slot into each freed lower one, so that running
        requests keep consecutive slots and attention reads the cache as a view."""
        n = self.table.lengths[src]
        self.table.move(src, dst)  # validates both slots first
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]


class CacheAttention:
    """Attention backend (``attn(layer_idx, q, k, v)``) for one forward over a batch of slots.

    The model sees the packed tokens of every row as one sequence [1, N]; row b's ``n_new[b]``
    tokens go to positions ``starts[b] ..`` of slot ``slots[b]``. Linears thus run on real
    tokens only (a speculative batch mixes rows of 1 and of K+1 tokens). Attention unpacks q into
    [B, T = max(n_new)], each row reading its own slot only, so neither padding nor other rows
    can leak into a row; only real tokens are written to the cache."""

    def __init__(self, cache: KVCache, slots: list[int], starts: list[int], n_new: list[int]):
        dev = cache.device
        b, t = len(slots), max(n_new)
        self.cache = cache
        self.n_keys = max(s + n for s, n in zip(starts, n_new))  # keys to read (<= max_seq_len)
        self.slot_idx = torch.tensor(slots, dtype=torch.int64, device=dev)
        pos = _positions(starts, t, dev)
        valid = torch.arange(t, device=dev)[None, :] < torch.tensor(n_new, device=dev)[:, None]
        # (row, column) of each packed token, in packed (row-major) order, and the (slot,
        # position) it is cached at; built once and reused by every layer.
        self.src_rows, self.src_cols = valid.nonzero(as_tuple=True)
        self.dst_slots = self.slot_idx[self.src_rows]
        self.dst_pos = pos[self.src_rows, self.src_cols]
        self.positions = self.dst_pos[None]
        # Flat row of each (token, kv head) in a layer's cache viewed as [slots * H * S, D]: the
        # new k/v are written by one index_copy_ (a plain row copy) instead of an index_put with
        # two index tensors around a slice (its generic kernel was ~7% of a SmolLM2 decode step).
        _, n_heads, seq, _ = cache.k.shape[1:]
        heads = torch.arange(n_heads, device=dev)
        self.dst_rows = ((self.dst_slots[:, None] * n_heads + heads) * seq + self.dst_pos[:, None]).reshape(-1)
        self.dense = self.src_rows.numel() == b * t  # every row has t tokens: unpacking is a view
        # Causal over absolute positions: query at position p sees keys 0..p of its own slot.
        key_pos = torch.arange(self.n_keys, device=dev)
        self.masked = key_pos[None, None, :] > pos[:, :, None]  # [B, T, n_keys], True = hidden
        self.masks = window_masks(self.masked, pos, cache.windows)
        self.shape = (b, t)
        # Rows of consecutive slots (the common case: slots are handed out lowest first) read
        # the cache through a view; otherwise their slots are gathered once per layer.
        self.slot_range = (slots[0], slots[0] + b) if slots == list(range(slots[0], slots[0] + b)) else None

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [1, N, Hq, D]; k, v: [1, N, Hkv, D] (packed). Returns [1, N, Hq, D]."""
        ck, cv = self.cache.k[layer_idx], self.cache.v[layer_idx]
        d = k.shape[-1]
        ck.view(-1, d).index_copy_(0, self.dst_rows, k[0].reshape(-1, d))
        cv.view(-1, d).index_copy_(0, self.dst_rows, v[0].reshape(-1, d))
        if self.slot_range is not None:
            lo, hi = self.slot_range
            keys, values = ck[lo:hi, :, : self.n_keys], cv[lo:hi, :, : self.n_keys]
        else:
            keys, values = ck[self.slot_idx, :, : self.n_keys], cv[self.slot_idx, :, : self.n_keys]
        b, t = self.shape
        if self.dense:
            out = grouped_attention(q.view(b, t, *q.shape[2:]), keys, values, self.mask(layer_idx))
            return out.reshape(q.shape)
        qp = q.new_zeros(b, t, *q.shape[2:])
        qp[self.src_rows, self.src_cols] = q[0]
        return grouped_attention(qp, keys, values, self.mask(layer_idx))[self.src_rows, self.src_cols][None]

    @property
    def handles_window(self) -> bool:
        """Whether the cache knows the model's per-layer windows (CausalLM refuses a sliding-window
        model's forward otherwise)."""
        return self.cache.windows is not None

    def mask(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s [B, T, n_keys] mask (True = hidden): causal, or causal within its window."""
        return self.masks[self.cache.windows[layer_idx]] if self.cache.windows else self.masked


def window_masks(masked: torch.Tensor, pos: torch.Tensor, windows: list[int | None] | None) -> dict:
    """The causal mask ``masked`` [B, T, n_keys] (True = hidden; keys at positions 0..n_keys-1,
    queries at ``pos`` [B, T]) under None, and under each sliding window w of ``windows`` the same
    with the keys at positions <= p - w hidden too (HF's sliding window: p - w < j <= p)."""
    key_pos = torch.arange(masked.shape[-1], device=masked.device)
    out = {None: masked}
    for w in set(windows or ()) - {None}:
        out[w] = masked | (key_pos[None, None, :] <= pos[:, :, None] - w)
    return out
