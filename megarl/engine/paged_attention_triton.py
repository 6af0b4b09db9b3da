"""Triton decode / verify attention over a paged KV cache; twin (within float tolerance) of
``megarl.engine.paged_attention.paged_attention_torch``, same contract.

One program per (request, KV head). Its query tile holds every query row that reads this KV
head: the ``REP = Hq / Hkv`` query heads (GQA) times the request's ``T`` query tokens (1 for a
decode step, K+1 for a verify), row ``m = t * REP + r`` (query head ``kv_head * REP + r`` of
token t, adjacent in memory). So each block of keys and values is loaded once for all of them.
The program walks the request's blocks through the block table, one ``BLOCK_SIZE`` tile per
step, with the online softmax (flash-attention style) accumulated in fp32 (fp64 for fp64
inputs): scores, running max and sum, and the output. Causal masking is per row: token t sees
positions ``<= q_start + t``.

bf16/fp16 caches use tensor-core dots with fp32 accumulation; fp32 inputs ask for IEEE fp32 dots
(not tf32), so results stay within float rounding of the reference. Under ``TRITON_INTERPRET=1``
the kernel runs on CPU through numpy (the CPU tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megarl.engine.paged_contract import check_paged_inputs

# Masked score: finite, so fully masked padding rows never produce inf - inf. (Globals used in jit
# code must be constexpr.)
_NEG = tl.constexpr(-1.0e30)


@triton.jit
def _paged_attn_kernel(q_ptr, k_ptr, v_ptr, tbl_ptr, qstart_ptr, nq_ptr, out_ptr,
                       sq_b, sq_t, sq_h, sk_blk, sk_h, sk_pos, so_b, so_t, so_h, st_b, scale,
                       REP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, ACC_F64: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    acc_t = tl.float64 if ACC_F64 else tl.float32
    start = tl.load(qstart_ptr + b)
    nq = tl.load(nq_ptr + b)
    m = tl.arange(0, BLOCK_M)
    t = m // REP
    h = kvh * REP + m % REP
    row_ok = t < nq
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + t[:, None] * sq_t + h[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qpos = start + t
    m_i = tl.full([BLOCK_M], _NEG, acc_t)
    l_i = tl.zeros([BLOCK_M], acc_t)
    acc = tl.zeros([BLOCK_M, BLOCK_D], acc_t)
    offs = tl.arange(0, BLOCK_SIZE)
    n_pages = tl.cdiv(start + nq, BLOCK_SIZE)
    p = 0
    while p < n_pages:  # (a while loop: the interpreter cannot range() over a loaded scalar)
        blk = tl.load(tbl_ptr + b.to(tl.int64) * st_b + p).to(tl.int64)
        kv_off = blk * sk_blk + kvh * sk_h + offs[:, None] * sk_pos + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=d_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=acc_t)
        else:
            s = tl.dot(q, tl.trans(k), out_dtype=acc_t)
        s = s * scale
        visible = (p * BLOCK_SIZE + offs)[None, :] <= qpos[:, None]
        s = tl.where(visible, s, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        if IEEE:
            pv = tl.dot(pr.to(v.dtype), v, input_precision="ieee", out_dtype=acc_t)
        else:
            pv = tl.dot(pr.to(v.dtype), v, out_dtype=acc_t)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        p += 1
    out = acc / l_i[:, None]  # l_i >= 1 for every row: position 0 is visible to all of them
    tl.store(out_ptr + b.to(tl.int64) * so_b + t[:, None] * so_t + h[:, None] * so_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, triton.next_power_of_2(n))


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, q_start: torch.Tensor, n_q: torch.Tensor,
                           num_warps: int = 4) -> torch.Tensor:
    """See ``megarl.engine.paged_attention``. q: [B, T, Hq, D]; caches [num_blocks, Hkv,
    block_size, D] (any dtype of q's); block_tables int [B, >= max blocks]; q_start, n_q [B]."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, q_start, n_q)
    b, t, hq, d = q.shape
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    if bs & (bs - 1) or (q.is_cuda and bs < 16):
        raise ValueError(f"paged_attention_triton: block_size={bs} is invalid; valid: a power of two (>= 16 on "
                         f"CUDA, where tl.dot needs 16-wide tiles)")
    if k_cache.stride(3) != 1 or q.stride(3) != 1:
        raise ValueError("paged_attention_triton: q and the caches must be contiguous in head_dim")
    rep = hq // hkv
    tables = block_tables.contiguous()
    out = torch.zeros_like(q)
    lo = 16 if q.is_cuda else 1  # tl.dot tiles are >= 16 on GPUs; the interpreter takes any size
    _paged_attn_kernel[(b, hkv)](
        q, k_cache, v_cache, tables, q_start.to(torch.int64).contiguous(),
        n_q.to(torch.int64).contiguous(), out,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2), tables.stride(0), d ** -0.5,
        REP=rep, D=d, BLOCK_M=_pow2_at_least(rep * t, lo), BLOCK_D=_pow2_at_least(d, lo), BLOCK_SIZE=bs,
        ACC_F64=q.dtype == torch.float64, IEEE=q.dtype in (torch.float32, torch.float64), num_warps=num_warps)
    return out
