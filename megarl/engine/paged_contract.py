"""The inputs of paged attention, checked once for both backends (megarl/engine/paged_attention.py,
the torch reference and dispatcher, and megarl/engine/paged_attention_triton.py, the kernel): a
leaf module, so the kernel imports nothing back from its dispatcher."""
from __future__ import annotations


def check_paged_inputs(q, k_cache, v_cache, block_tables, q_start, n_q) -> None:
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged_attention: q must be [B, T, Hq, D] and k_cache/v_cache [num_blocks, Hkv, "
                         f"block_size, D] of one shape; got {tuple(q.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    b, t, hq, d = q.shape
    hkv = k_cache.shape[1]
    if k_cache.shape[3] != d or hq % hkv:
        raise ValueError(f"paged_attention: head_dim {d} vs cache {k_cache.shape[3]}, or Hq={hq} not a multiple "
                         f"of Hkv={hkv}")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or q_start.shape != (b,) or n_q.shape != (b,):
        raise ValueError(f"paged_attention: block_tables must be [B={b}, n_blocks], q_start and n_q [B]; got "
                         f"{tuple(block_tables.shape)}, {tuple(q_start.shape)}, {tuple(n_q.shape)}")
