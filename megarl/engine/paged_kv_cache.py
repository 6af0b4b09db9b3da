"""Paged KV cache: fixed-size blocks of positions, a block table per request, prefix sharing.

The k/v tensors are ``[n_layers, num_blocks, n_kv_heads, block_size, head_dim]``: a block holds
``block_size`` consecutive positions of one request, and one KV head's keys of a block are
contiguous (the Triton kernel loads them as one tile; megarl/engine/paged_attention_triton.py).
Request ``r`` caches position ``p`` in block ``blocks[r][p // block_size]`` at offset
``p % block_size``.

``BlockTable`` is the host-side bookkeeping, plain Python and deterministic (docs/design.md §2): request
rows and blocks are both handed out lowest free first, and a block returns to the pool when its
last holder lets go (refcounts). The G samples of a GRPO group share their prompt: its k/v are
computed once, the full blocks are shared by reference, and a partially filled last block is
copied (each sample writes its own tokens there next: copy-on-write, done at once).

Memory is promised at admission, so a running request can never hit an empty pool mid-rollout:
``allocate(max_positions, shared)`` succeeds only if the pool can still give the request every
block it may need (its longest possible length, less the blocks it gets by reference), on top
of what the running requests were promised. Blocks freed by truncation (rejected drafts) stay
promised to their request. Preemption (recompute) is not needed: with the default number of
blocks every request fits at full length, and a smaller pool only admits fewer requests at once.
Only growth is promised: a copy-on-write of a shared block, or regrowth after truncating into
shared blocks (the engine does neither: it never truncates into the prompt), takes an unpromised
block or fails with the out-of-blocks error, never a block promised to another request.
"""
from __future__ import annotations

import heapq

import torch

from megarl.engine.kv_cache import CacheAttention, _positions, window_masks
from megarl.engine.paged_attention import gather_pages, page_index
from megarl.models.llama import grouped_attention

# Verify rows of up to this many tokens go to the Triton kernel on CUDA; longer rows (prefill)
# take the torch path. 16 covers k_max drafts + 1 for every SpecConfig default.
KERNEL_MAX_QUERIES = 16


def blocks_for(n_positions: int, block_size: int) -> int:
    return -(-n_positions // block_size)


class BlockTable:
    """Host-side bookkeeping: request rows, each row's block list and cached length, block
    refcounts, and the blocks promised to running requests. Also mirrors the block lists into an
    int32 tensor ``tensor[row, i]`` (on the host) that a forward slices its rows from."""

    def __init__(self, max_seqs: int, max_seq_len: int, block_size: int, num_blocks: int):
        if max_seqs < 1 or max_seq_len < 1:
            raise ValueError(f"max_seqs={max_seqs} and max_seq_len={max_seq_len} must be >= 1")
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"block_size={block_size} and num_blocks={num_blocks} must be >= 1")
        self.max_slots, self.max_seq_len = max_seqs, max_seq_len  # max_slots: the SlotTable name
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_blocks_per_seq = blocks_for(max_seq_len, block_size)
        self._free_rows = list(range(max_seqs))  # min-heaps: lowest first (deterministic)
        self._free_blocks = list(range(num_blocks))
        self._used = [False] * max_seqs
        self.lengths = [0] * max_seqs
        self.blocks: list[list[int]] = [[] for _ in range(max_seqs)]
        self.refcount = [0] * num_blocks
        self._budget = [0] * max_seqs  # blocks a row may take from the pool (promised at allocate)
        self._own: list[list[bool]] = [[] for _ in range(max_seqs)]  # per block: taken for this row?
        self._n_own = [0] * max_seqs  # blocks the row took from the pool and still holds
        self._promised = 0  # sum over rows of max(0, budget - n_own): free blocks spoken for
        self.tensor = torch.zeros(max_seqs, self.max_blocks_per_seq, dtype=torch.int32)
        self.pending_copies: list[tuple[int, int]] = []  # (src block, dst block) for the device

    # ------------------------------------------------------------------ rows
    @property
    def n_free(self) -> int:
        """Free request rows."""
        return len(self._free_rows)

    @property
    def n_used(self) -> int:
        return self.max_slots - len(self._free_rows)

    @property
    def n_free_blocks(self) -> int:
        return len(self._free_blocks)

    def available_blocks(self) -> int:
        """Free blocks not promised to a running request."""
        return len(self._free_blocks) - self._promised

    def blocks_needed(self, max_positions: int | None, shared: int = 0) -> int:
        """Blocks a request that caches at most ``max_positions`` positions takes from the pool,
        the first ``shared`` of them received from a sibling (only full blocks are shared)."""
        if max_positions is None:
            return 0
        return max(0, blocks_for(min(max_positions, self.max_seq_len), self.block_size) - shared // self.block_size)

    def can_allocate(self, max_positions: int | None = None, shared: int = 0) -> bool:
        return bool(self._free_rows) and self.blocks_needed(max_positions, shared) <= self.available_blocks()

    def allocate(self, max_positions: int | None = None, shared: int = 0) -> int:
        """Take the lowest free row and promise it the blocks for ``max_positions`` positions
        (``shared`` of which it will get by ``share``). Without ``max_positions`` nothing is
        promised and blocks come from what is unpromised when they are written."""
        if not self._free_rows:
            raise RuntimeError(f"no free KV-cache request row (all {self.max_slots} in use)")
        need = self.blocks_needed(max_positions, shared)
        if need > self.available_blocks():
            raise RuntimeError(self.out_of_blocks(need))
        row = heapq.heappop(self._free_rows)
        self._used[row], self.lengths[row], self.blocks[row], self._own[row] = True, 0, [], []
        self._budget[row], self._n_own[row] = need, 0
        self._promised += need
        return row

    def free(self, row: int) -> None:
        """Return a row and drop its references to its blocks (stale k/v stay and are
        overwritten by the blocks' next owners)."""
        self._check_used(row)
        for blk in self.blocks[row]:
            self._decref(blk)
        self._promised -= max(0, self._budget[row] - self._n_own[row])
        self._used[row], self.lengths[row], self.blocks[row], self._own[row] = False, 0, [], []
        self._budget[row] = self._n_own[row] = 0
        heapq.heappush(self._free_rows, row)

    # ------------------------------------------------------------------ positions
    def reserve(self, rows: list[int], n_new: list[int]) -> list[int]:
        """Claim ``n_new[i]`` more positions in ``rows[i]``: add blocks as needed and give the row
        its own copy of any shared block it is about to write (copy-on-write: the copies are queued
        in ``pending_copies`` for the cache to run). Returns the start positions."""
        starts = []
        for row, n in zip(rows, n_new):
            self._check_used(row)
            start = self.lengths[row]
            if n < 1 or start + n > self.max_seq_len:
                raise ValueError(f"row {row}: cannot add {n} positions to {start} (max_seq_len={self.max_seq_len})")
            blocks, bs = self.blocks[row], self.block_size
            for i in range(start // bs, blocks_for(start + n, bs)):
                if i == len(blocks):
                    self._append(row, self._take(row), own=True)
                elif self.refcount[blocks[i]] > 1:
                    new = self._take(row)
                    self.pending_copies.append((blocks[i], new))
                    self._drop(row, i)
                    blocks[i] = new
                    self._own[row][i] = True
                    self._count_own(row, 1)
                    self.tensor[row, i] = new
            starts.append(start)
            self.lengths[row] = start + n
        return starts

    def truncate(self, row: int, length: int) -> None:
        """Forget cached positions >= ``length`` (rejected draft tokens); blocks left empty go
        back to the pool (still promised to this row, which may grow into them again)."""
        self._check_used(row)
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"row {row}: cannot truncate {self.lengths[row]} cached positions to {length}")
        keep = blocks_for(length, self.block_size)
        for i in range(keep, len(self.blocks[row])):
            self._drop(row, i)
        del self.blocks[row][keep:], self._own[row][keep:]
        self.lengths[row] = length

    def share(self, src: int, dst: list[int], length: int) -> list[tuple[int, int]]:
        """Give the empty rows ``dst`` the first ``length`` cached positions of ``src``: its full
        blocks by reference, and a copy of a partially filled last block (returned as
        ``(src block, dst block)`` pairs for the cache to copy)."""
        self._check_used(src)
        if length > self.lengths[src]:
            raise ValueError(f"row {src} holds {self.lengths[src]} positions, not {length}")
        for row in dst:
            self._check_used(row)
            if self.lengths[row] != 0:
                raise ValueError(f"row {row} is not empty ({self.lengths[row]} cached positions)")
        n_full, rest = divmod(length, self.block_size)
        copies = []
        for row in dst:
            for blk in self.blocks[src][:n_full]:
                self.refcount[blk] += 1
                self._append(row, blk, own=False)
            if rest:
                new = self._take(row)
                copies.append((self.blocks[src][n_full], new))
                self._append(row, new, own=True)
            self.lengths[row] = length
        return copies

    # ------------------------------------------------------------------ helpers
    def _append(self, row: int, blk: int, own: bool) -> None:
        self.tensor[row, len(self.blocks[row])] = blk
        self.blocks[row].append(blk)
        self._own[row].append(own)
        self._count_own(row, int(own))

    def _drop(self, row: int, i: int) -> None:
        """Release row's reference to its i-th block (the caller updates the lists)."""
        self._count_own(row, -int(self._own[row][i]))
        self._decref(self.blocks[row][i])

    def _count_own(self, row: int, delta: int) -> None:
        """Change the row's count of own blocks, keeping the promised total in step."""
        b, n = self._budget[row], self._n_own[row]
        self._promised += max(0, b - n - delta) - max(0, b - n)
        self._n_own[row] = n + delta

    def _take(self, row: int) -> int:
        """A block from the pool for ``row``: promised to it, or else an unpromised one."""
        if self._n_own[row] >= self._budget[row] and self.available_blocks() < 1:
            raise RuntimeError(self.out_of_blocks(1))
        if not self._free_blocks:  # only reachable if promises were broken: a bookkeeping bug
            raise RuntimeError(self.out_of_blocks(1))
        blk = heapq.heappop(self._free_blocks)
        self.refcount[blk] = 1
        return blk

    def _decref(self, blk: int) -> None:
        self.refcount[blk] -= 1
        if self.refcount[blk] == 0:
            heapq.heappush(self._free_blocks, blk)

    def _check_used(self, row: int) -> None:
        if not 0 <= row < self.max_slots or not self._used[row]:
            raise ValueError(f"row {row} is not allocated")

    def out_of_blocks(self, need: int, what: str = "") -> str:
        """The error text when ``need`` blocks are missing (``what``: who needs them)."""
        return (f"paged KV cache out of blocks: {what or 'the request'} needs {need}, {self.available_blocks()} "
                f"of {self.num_blocks} blocks of {self.block_size} positions are free and unpromised; raise "
                f"EngineConfig.num_kv_blocks (now {self.num_blocks}; 0 = enough for max_batch_size requests of "
                f"max_seq_len) or lower max_batch_size")


class PagedKVCache:
    """Preallocated block pool plus its ``BlockTable``; the same interface as ``KVCache``."""

    needs_compaction = False  # rows are gathered through the block table: holes cost nothing

    def __init__(self, n_layers: int, max_seqs: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, block_size: int = 16, num_blocks: int = 0,
                 windows: list[int | None] | None = None):
        num_blocks = num_blocks or max_seqs * blocks_for(max_seq_len, block_size)
        # per layer: its sliding window, None = full causal (ModelArgs.window); the Triton kernel
        # has no window, so a cache with windows attends by gather + grouped_attention on CUDA too.
        self.windows = windows
        self.table = BlockTable(max_seqs, max_seq_len, block_size, num_blocks)
        self.block_size = block_size
        # One block more than the table hands out: the scratch block, where a fixed-shape step
        # (static_step.py) writes the k/v of its padding tokens.
        self.scratch_block = num_blocks
        shape = (n_layers, num_blocks + 1, n_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def batch(self, rows: list[int], n_new: list[int]) -> tuple["PagedCacheAttention", torch.Tensor]:
        """As ``KVCache.batch``: reserve positions (blocks) and build the attention backend for
        one forward over the packed new tokens; returns it and their positions [1, N]."""
        starts = self.table.reserve(rows, n_new)
        self.copy_pending()
        attn = PagedCacheAttention(self, rows, starts, n_new)
        return attn, attn.positions

    def copy_pending(self) -> None:
        """Run the copy-on-write block copies that ``table.reserve`` queued."""
        self._copy(self.table.pending_copies)
        self.table.pending_copies = []

    def share_prefix(self, src: int, dst: list[int], length: int) -> None:
        """The samples ``dst`` of a GRPO group get the prompt prefix cached in ``src``: full
        blocks by reference, the partial last block copied."""
        if dst:
            self._copy(self.table.share(src, dst, length))

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        for t in (self.k, self.v):
            t[:, dst] = t[:, src]


class PagedCacheAttention:
    """Attention backend for one forward over a batch of rows of a ``PagedKVCache`` (the packed
    layout of ``kv_cache.CacheAttention``: row b's ``n_new[b]`` tokens at positions
    ``starts[b] ..``). Writes the new k/v into their blocks, then attends over each row's blocks:
    on CUDA with a few query tokens per row (decode, verify) with the Triton kernel, otherwise
    by gathering the rows' blocks and the math of ``grouped_attention``."""

    def __init__(self, cache: PagedKVCache, rows: list[int], starts: list[int], n_new: list[int]):
        dev, bs = cache.device, cache.block_size
        b, t = len(rows), max(n_new)
        self.cache = cache
        self.n_keys = max(s + n for s, n in zip(starts, n_new))
        row_idx = torch.tensor(rows, dtype=torch.int64)
        self.block_tables = cache.table.tensor[row_idx, :blocks_for(self.n_keys, bs)].to(dev, torch.int64)
        pos = _positions(starts, t, dev)
        self.n_q = torch.tensor(n_new, dtype=torch.int64, device=dev)
        valid = torch.arange(t, device=dev)[None, :] < self.n_q[:, None]
        self.src_rows, self.src_cols = valid.nonzero(as_tuple=True)
        dst_pos = pos[self.src_rows, self.src_cols]
        self.dst_blocks = self.block_tables[self.src_rows, dst_pos // bs]
        self.dst_off = dst_pos % bs
        self.positions = dst_pos[None]
        self.q_start = pos[:, 0].contiguous()
        self.dense = self.src_rows.numel() == b * t
        self.shape = (b, t)
        self.use_kernel = dev.type == "cuda" and t <= KERNEL_MAX_QUERIES and bs >= 16 and not cache.windows
        if not self.use_kernel:  # causal over absolute positions, as in CacheAttention
            self.masked = torch.arange(self.n_keys, device=dev)[None, None, :] > pos[:, :, None]
            self.masks = window_masks(self.masked, pos, cache.windows)
            self.page_index = page_index(self.block_tables, cache.k.shape[2])

    handles_window = CacheAttention.handles_window
    mask = CacheAttention.mask

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [1, N, Hq, D]; k, v: [1, N, Hkv, D] (packed). Returns [1, N, Hq, D]."""
        ck, cv = self.cache.k[layer_idx], self.cache.v[layer_idx]
        ck[self.dst_blocks, :, self.dst_off] = k[0]
        cv[self.dst_blocks, :, self.dst_off] = v[0]
        b, t = self.shape
        if self.dense:
            qp = q.view(b, t, *q.shape[2:])
        else:
            qp = q.new_zeros(b, t, *q.shape[2:])
            qp[self.src_rows, self.src_cols] = q[0]
        if self.use_kernel:
            from megarl.engine.paged_attention_triton import paged_attention_triton
            out = paged_attention_triton(qp, ck, cv, self.block_tables, self.q_start, self.n_q)
        else:
            keys, values = (gather_pages(c, self.block_tables, self.n_keys, self.page_index) for c in (ck, cv))
            out = grouped_attention(qp, keys, values, self.mask(layer_idx))
        return out.reshape(q.shape) if self.dense else out[self.src_rows, self.src_cols][None]
