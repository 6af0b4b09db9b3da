"""The engine's decode/verify step over fixed shapes: what a CUDA graph captures.

``ModelRunner.run`` builds each step's tensors from Python lists whose lengths change every step (rows,
draft lengths, keys read), which a CUDA graph cannot replay. Here a step of ``n`` rows with at
most ``k`` drafts runs in a bucket: ``B`` rows (the smallest of ``BATCH_BUCKETS`` >= n, capped at
``max_batch_size``) x ``T`` tokens (the smallest of ``TOKEN_BUCKETS`` >= k + 1), through buffers
made once per bucket and written in place:

- ``ids`` / positions [B, T]: row b's pending token and drafts at positions ``q_start[b] + t``,
  padded with token 0 past ``n_q[b]`` tokens; padded rows have ``n_q = 0``;
- ``block_tables`` [B, max_blocks]: the paged cache's table rows; entries past a row's blocks, and
  every entry of a padded row, point at the cache's scratch block, so that the k/v of padded tokens
  are written there and never into a block another request owns;
- per row sampling set-up and keys (a ``SamplingRows``) and ``draft_next`` [B * T] (-1 past a
  row's drafts: verification stops there, so padded tokens are never accepted).

The attention reads each row's blocks with a causal mask by position (CPU: the gather +
``grouped_attention`` math of the paged cache over all ``max_blocks``; CUDA: its Triton kernel), the LM head and
verification run on all B * T rows, and one copy brings tokens, acceptance counts, logprobs and
entropies back. Host work (reserving blocks, copy-on-write) happens before the device work.

What is tested (tests/engine/test_static_step.py, CPU, graphs off): the same tokens and logprobs
as the engine's own step, with and without drafts, in rows padded to buckets. Capturing the step
into CUDA graphs needs the device-side parts to avoid host syncs (the torch sampler and
verification's input checks sync); that is left for a GPU session.
"""
from __future__ import annotations

import bisect
import dataclasses

import torch

from megarl.engine.kv_cache import window_masks
from megarl.engine.paged_attention import page_index
from megarl.engine.paged_kv_cache import KERNEL_MAX_QUERIES, PagedCacheAttention, PagedKVCache
from megarl.engine.sampler import token_stats
from megarl.engine.sampling_rows import SamplingRows
from megarl.engine.verify import verify

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 2, 3, 5, 9, 17)


def bucket(n: int, buckets: tuple[int, ...], cap: int) -> int:
    """The smallest bucket >= n (n itself past the largest), at most ``cap`` (and >= n)."""
    i = bisect.bisect_left(buckets, n)
    return max(n, min(buckets[i] if i < len(buckets) else n, cap))


class _Buffers:
    """The device tensors of one (B, T) bucket, allocated once. ``rows``: the rows' sampling
    set-up (padded rows: every filter off), its seed and step given per call."""

    def __init__(self, b: int, t: int, max_blocks: int, scratch: int, sample_dtype, dev):
        i64 = dict(dtype=torch.int64, device=dev)
        self.b, self.t = b, t
        self.ids = torch.zeros(b, t, **i64)
        self.q_start = torch.zeros(b, **i64)
        self.n_q = torch.zeros(b, **i64)
        self.block_tables = torch.full((b, max_blocks), scratch, **i64)
        self.rows = SamplingRows.of([], [], 0, 0, sample_dtype, dev, pad_to=b)
        self.draft_next = torch.full((b * t,), -1, **i64)
        self.row_start = torch.arange(0, b * t + 1, t, **i64)


class StaticStep:
    """Runs ``ModelRunner.run``'s work for a batch through fixed-shape buffers (see the module)."""

    def __init__(self, runner):
        if not isinstance(runner.cache, PagedKVCache):
            raise ValueError("EngineConfig.static_shapes needs kv_cache='paged' (block tables are what a "
                             "fixed-shape step indexes); set kv_cache: paged")
        self.runner = runner
        self.cache: PagedKVCache = runner.cache
        self.max_blocks = self.cache.table.max_blocks_per_seq
        self._buffers: dict[tuple[int, int], _Buffers] = {}

    def run(self, batch, step: int):
        """``ModelRunner.run`` for ``batch``: per row the tokens the target sampled (accepted drafts,
        then its own), their logprobs and entropies, and the accepted draft counts."""
        if self.runner.hidden_hook:
            raise ValueError("EngineConfig.static_shapes does not hand hidden states to a learned drafter yet; "
                             "turn spec.drafter off or static_shapes off")
        buf = self.fill(batch)
        out = [x.cpu() for x in self.device_step(buf, step)]  # the one copy back
        tokens, n_accept, logprobs, entropies = (x.tolist() for x in out)
        res = ([], [], [], n_accept[:len(batch.seqs)])
        for i, n in enumerate(res[3]):
            lo = i * buf.t
            for dst, src in zip(res[:3], (tokens, logprobs, entropies)):
                dst.append(src[lo:lo + n + 1])
        return res

    def buffers(self, n_rows: int, n_tokens: int) -> _Buffers:
        e = self.runner
        key = (bucket(n_rows, BATCH_BUCKETS, e.cfg.max_batch_size), bucket(n_tokens, TOKEN_BUCKETS, TOKEN_BUCKETS[-1]))
        if key not in self._buffers:
            self._buffers[key] = _Buffers(*key, self.max_blocks, self.cache.scratch_block, e.sample_dtype, e.device)
        return self._buffers[key]

    def fill(self, batch) -> _Buffers:
        """Host work, then the buffers written for ``batch`` (a scheduler ``Batch``)."""
        inputs = [p + d for p, d in zip(batch.pending, batch.drafts)]
        buf = self.buffers(len(inputs), max(len(x) for x in inputs))
        n, b, t = len(inputs), buf.b, buf.t
        rows = [s.slot for s in batch.seqs]
        starts = self.cache.table.reserve(rows, [len(x) for x in inputs])
        self.cache.copy_pending()
        ids = torch.zeros(b, t, dtype=torch.int64)
        draft_next = torch.full((b, t), -1, dtype=torch.int64)
        for i, (x, d) in enumerate(zip(inputs, batch.drafts)):
            ids[i, :len(x)] = torch.tensor(x)
            # row j of request i verifies the draft token after it (its pending token is row 0's input)
            draft_next[i, len(x) - 1 - len(d):len(x) - 1] = torch.tensor(d, dtype=torch.int64)
        tables = torch.full((b, self.max_blocks), self.cache.scratch_block, dtype=torch.int64)
        for i, r in enumerate(rows):
            blocks = self.cache.table.blocks[r]
            tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        positions = [len(s.tokens) for s in batch.seqs]
        buf.rows.copy_(SamplingRows.of([s.req for s in batch.seqs], positions, 0, 0, buf.rows.temperature.dtype,
                                       "cpu", pad_to=b))

        def per_row(vals):
            return torch.tensor(list(vals) + [0] * (b - n), dtype=torch.int64)

        for dst, src in ((buf.ids, ids), (buf.draft_next, draft_next.reshape(-1)), (buf.block_tables, tables),
                         (buf.q_start, per_row(starts)), (buf.n_q, per_row([len(x) for x in inputs]))):
            dst.copy_(src, non_blocking=True)
        return buf

    def device_step(self, buf: _Buffers, step: int):
        """The fixed-shape device work: forward, LM head, verification, statistics."""
        e, (b, t) = self.runner, (buf.b, buf.t)
        pos = buf.q_start[:, None] + torch.arange(t, device=e.device)  # [B, T]
        attn = _StaticAttention(self.cache, buf, pos)
        with e.linears():
            hidden = e.model.hidden_states(buf.ids.view(1, b * t), pos.view(1, b * t), attn)[0]
        logits = e.head_logits(hidden).to(e.sample_dtype)
        # Verification's row j of request b samples at response position rows.position[b] + j; rows of
        # the drafts (j >= 1) are j tokens after the pending one.
        rows = dataclasses.replace(buf.rows, seed=e.seed, step=step)
        tokens, n_accept = verify(logits, buf.draft_next, buf.row_start, rows)
        logprobs, entropies = token_stats(logits, rows.temperature.repeat_interleave(t), tokens)
        return tokens, n_accept, logprobs, entropies


class _StaticAttention(PagedCacheAttention):
    """The paged cache's attention (its ``__call__``: write the new k/v, then the Triton kernel on
    CUDA or gather + ``grouped_attention``) over the bucket's dense [B, T] tokens, set up from the
    device buffers instead of host lists: padded tokens write into the scratch block, and the CPU
    path reads every row's ``max_blocks``."""

    def __init__(self, cache: PagedKVCache, buf: _Buffers, pos: torch.Tensor):  # not super(): it takes host lists
        bs, dev = cache.block_size, pos.device
        self.cache, self.shape, self.dense = cache, (buf.b, buf.t), True
        self.block_tables, self.q_start, self.n_q = buf.block_tables, buf.q_start, buf.n_q
        valid = torch.arange(buf.t, device=dev)[None, :] < buf.n_q[:, None]
        blk = buf.block_tables.gather(1, (pos // bs).clamp(max=buf.block_tables.shape[1] - 1))
        self.dst_blocks = torch.where(valid, blk, cache.scratch_block).reshape(-1)
        self.dst_off = (pos % bs).reshape(-1)
        self.n_keys = buf.block_tables.shape[1] * bs
        self.use_kernel = dev.type == "cuda" and buf.t <= KERNEL_MAX_QUERIES and bs >= 16 and not cache.windows
        if not self.use_kernel:
            self.masked = torch.arange(self.n_keys, device=dev)[None, None, :] > pos[:, :, None]
            self.masks = window_masks(self.masked, pos, cache.windows)
            self.page_index = page_index(buf.block_tables, cache.k.shape[2])
