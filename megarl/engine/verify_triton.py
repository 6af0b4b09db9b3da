"""Fused Triton verify kernel, bitwise twin of ``megarl.engine.verify.verify_torch``.

One program per row; every pass streams the row's logits BLOCK_V at a time (V = 151936 is
fine; V is a constexpr: one compile per vocab size and dtype):
1. raw max / argmax (greedy rows; and ``max(s)`` for top-p, since ``x / T`` is monotone);
2. top-k cutoff, without sorting: tokens rank by the pair (order-preserving integer image of
   ``s = x / T``, ``2**ID_BITS - 1 - id``). The cutoff is the largest pair whose weighted count
   of tokens at or above it reaches the target, found 4 bits per pass (16 candidate thresholds),
   first over the value key (stopping early once one distinct key is left in range), then over
   the id only when ties straddle the cutoff;
3. top-p: ``Z`` (one pass), then the same search with the integer weights ``q`` and target
   ``p * Z`` (the exact criterion of ``megarl/engine/sampler.py``). Rows with top_k = 0 and
   top_p = 1 skip 1-3;
4. Gumbel noise recomputed on the fly from the hash (never an [N, V] tensor), argmax of the kept
   ``s + g`` (ties to the lowest id), comparison with the draft, and an atomic min of the first
   mismatching row into the request's accept count (order-independent, so deterministic).

Bitwise parity needs IEEE arithmetic: launches pass ``enable_fp_fusion=False`` (Triton then
emits ``add.rn`` / ``mul.rn``, which ptxas never contracts into FMA), float32 division is
``tl.math.div_rn`` (Triton's float32 ``/`` is the approximate ``div.full.f32``; float64 ``/`` is
``div.rn.f64``), and negation flips the sign bit. ``tests/engine/test_verify.py`` checks the PTX.
Under ``TRITON_INTERPRET=1`` the same kernels run on CPU through numpy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megarl.engine import detmath as dm
from megarl.engine.sampling_rows import SamplingRows
from megarl.engine.verify_contract import TRITON_DTYPES, check_inputs, row_request

# Globals used in jit code must be constexpr; all are exactly representable in float32.
_LG1, _LG2, _LG3, _LG4 = tl.constexpr(dm.LG1), tl.constexpr(dm.LG2), tl.constexpr(dm.LG3), tl.constexpr(dm.LG4)
_LN2_HI, _LN2_LO = tl.constexpr(dm.LN2_HI), tl.constexpr(dm.LN2_LO)
_INV_LN2, _LN2_HI_E, _LN2_LO_E = tl.constexpr(dm.INV_LN2), tl.constexpr(dm.LN2_HI_E), tl.constexpr(dm.LN2_LO_E)
_P1, _P2 = tl.constexpr(dm.P1), tl.constexpr(dm.P2)
_EXP_LO, _EXP_HI = tl.constexpr(dm.EXP_LO), tl.constexpr(dm.EXP_HI)
_M32 = 0xFFFFFFFF


# ------------------------------------------------------------------ detmath twins (same op order)
@triton.jit
def _det_log(x):
    bits = x.to(tl.int32, bitcast=True)
    sub = (bits > 0) & (bits < 0x00800000)
    m0 = tl.where(sub, bits.to(tl.float32), x)
    k0 = tl.where(sub, -149, 0)
    ix = m0.to(tl.int32, bitcast=True) + (0x3F800000 - 0x3F3504F3)
    k = k0 + (ix >> 23) - 127
    m = ((ix & 0x007FFFFF) + 0x3F3504F3).to(tl.float32, bitcast=True)
    f = m - 1.0
    s = tl.math.div_rn(f, f + 2.0)
    z = s * s
    w = z * z
    t1 = w * ((w * _LG4) + _LG2)
    t2 = z * ((w * _LG3) + _LG1)
    r = t2 + t1
    hfsq = (f * 0.5) * f
    dk = k.to(tl.float32)
    out = ((((s * (hfsq + r)) + (dk * _LN2_LO)) - hfsq) + f) + (dk * _LN2_HI)
    out = tl.where(bits == 0x7F800000, float("inf"), out)
    out = tl.where((bits < 0) | (bits > 0x7F800000), float("nan"), out)
    return tl.where((bits & 0x7FFFFFFF) == 0, float("-inf"), out)


@triton.jit
def _det_exp(x):
    inside = (x >= _EXP_LO) & (x <= _EXP_HI)
    xc = tl.where(inside, x, 0.0)
    k = tl.floor((xc * _INV_LN2) + 0.5)
    hi = xc - (k * _LN2_HI_E)
    lo = k * _LN2_LO_E
    r = hi - lo
    rr = r * r
    c = r - (rr * ((rr * _P2) + _P1))
    y = (tl.math.div_rn(r * c, 2.0 - c) - lo) + hi
    y = y + 1.0
    scale = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    out = y * scale
    out = tl.where(x < _EXP_LO, 0.0, out)
    out = tl.where(x > _EXP_HI, float("inf"), out)
    return tl.where(x != x, x, out)


@triton.jit
def _neg(x):
    """IEEE negation (sign flip). Triton's ``-x`` is ``0 - x``, which maps +0 to +0 where torch
    gives -0; g = -det_log(1.0) must be -0.0 on every backend."""
    return (x.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.float32, bitcast=True)


# ------------------------------------------------------------------ counter-based noise
@triton.jit
def _scramble(k):
    k = k * 0xCC9E2D51
    k = (k << 15) | (k >> 17)
    return k * 0x1B873593


@triton.jit
def _absorb(h, k):
    h = h ^ _scramble(k)
    h = (h << 13) | (h >> 19)
    return h * 5 + 0xE6546B64


@triton.jit
def _row_hash(seed_lo, seed_hi, step_lo, uid, sidx, pos):
    """Murmur3 state after the 7 per-row key words (uint32 arithmetic wraps like the spec)."""
    h = tl.full([], 0, tl.uint32)
    h = _absorb(h, seed_lo.to(tl.uint32))
    h = _absorb(h, seed_hi.to(tl.uint32))
    h = _absorb(h, step_lo.to(tl.uint32))
    h = _absorb(h, uid.to(tl.uint32))
    h = _absorb(h, (uid >> 32).to(tl.uint32))
    h = _absorb(h, sidx.to(tl.uint32))
    return _absorb(h, pos.to(tl.uint32))


@triton.jit
def _gumbel(h_row, offs):
    """float32 Gumbel noise of tokens ``offs`` given the row's hash state."""
    h = _absorb(h_row, offs.to(tl.uint32)) ^ 32
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    h = h ^ (h >> 16)
    u = ((h >> 9).to(tl.float32) * 1.1920928955078125e-07) + 5.9604644775390625e-08  # 2**-23, 2**-24
    return _neg(_det_log(_neg(_det_log(u))))


# ------------------------------------------------------------------ ranking keys and the cutoff search
@triton.jit
def _scale(x, t, IS_F64: tl.constexpr):
    if IS_F64:
        return x / t  # div.rn.f64
    else:
        return tl.math.div_rn(x, t)


@triton.jit
def _order_key(s, IS_F64: tl.constexpr):
    """Unsigned integer whose order is the float order (-0 first made +0, as they compare equal)."""
    s = tl.where(s == 0, 0.0, s)
    if IS_F64:
        bits = s.to(tl.uint64, bitcast=True)
        return bits ^ tl.where((bits >> 63) != 0, 0xFFFFFFFFFFFFFFFF, 0x8000000000000000)
    else:
        bits = s.to(tl.uint32, bitcast=True)
        return bits ^ tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000)


@triton.jit
def _key_value(key, IS_F64: tl.constexpr):
    """Inverse of _order_key (a float whose key is ``key``)."""
    if IS_F64:
        bits = key ^ tl.where((key >> 63) != 0, 0x8000000000000000, 0xFFFFFFFFFFFFFFFF)
        return bits.to(tl.float64, bitcast=True)
    else:
        bits = key ^ tl.where((key >> 31) != 0, 0x80000000, 0xFFFFFFFF)
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def _at_or_above(key, idrev, t, c):
    """Token ranks at or above the cutoff pair (t, c)."""
    return (key > t) | ((key == t) & (idrev >= c))


@triton.jit
def _q(s, s_max):
    """Top-p integer weight floor(det_exp(float32(s - s_max)) * 2**24); NaN counts 0."""
    w = _det_exp((s - s_max).to(tl.float32))
    w = tl.where(w == w, w, 0.0)
    return (w * 16777216.0).to(tl.int64)


@triton.jit
def _pass_sums(x_row, V: tl.constexpr, t_div, s_max, tk, ck, t, c, shift, PHASE2: tl.constexpr,
               USE_Q: tl.constexpr, IS_F64: tl.constexpr, ID_BITS: tl.constexpr, BLOCK_V: tl.constexpr):
    """One pass over the row. Phase 1: [16] weighted counts of tokens at or above the cutoffs
    (t + d * 2**shift, 0), and the min / max key of weighted tokens in [t, t + 16 * 2**shift).
    Phase 2: the counts at or above (t, c + d * 2**shift). Weights: 1 (top-k) or q over the
    top-k set (top-p)."""
    ONES: tl.constexpr = 0xFFFFFFFFFFFFFFFF if IS_F64 else 0xFFFFFFFF
    d16 = tl.arange(0, 16)
    sums = tl.zeros([16], tl.int64)
    kmax = tl.zeros([], t.dtype)
    kmin_not = tl.zeros([], t.dtype)  # max of (key ^ ONES) = min of key ^ ONES
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < V
        s = _scale(tl.load(x_row + offs, mask=m, other=float("-inf")), t_div, IS_F64)
        key = _order_key(s, IS_F64)
        if USE_Q or PHASE2:
            idrev = ((1 << ID_BITS) - 1 - offs).to(key.dtype)
        if USE_Q:
            wgt = tl.where(m & _at_or_above(key, idrev, tk, ck), _q(s, s_max), 0)
        else:
            wgt = m.to(tl.int64)
        if PHASE2:
            cands = c + (d16.to(t.dtype) << shift)
            hit = (key[None, :] > t) | ((key[None, :] == t) & (idrev[None, :] >= cands[:, None]))
        else:
            hit = key[None, :] >= (t + (d16.to(t.dtype) << shift))[:, None]
            live = (wgt > 0) & (key >= t) & (((key - t) >> shift) < 16)
            kmax = tl.maximum(kmax, tl.max(tl.where(live, key, 0), axis=0))
            kmin_not = tl.maximum(kmin_not, tl.max(tl.where(live, key ^ ONES, 0), axis=0))
        sums += tl.sum(tl.where(hit, wgt[None, :], 0), axis=1)
    return sums, kmin_not ^ ONES, kmax


@triton.jit
def _cutoff(x_row, V: tl.constexpr, t_div, s_max, tk, ck, target, on, USE_Q: tl.constexpr, IS_F64: tl.constexpr,
            KEY_BITS: tl.constexpr, ID_BITS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Largest pair (t, c) whose weighted count of tokens at or above it is >= target, i.e. the
    last kept token; (0, 0) (keep all) when ``on`` is false. Invariant: the count at (t, 0) is
    >= target (at t = 0 it is the total weight), and the answer lies in [t, t + 16 * 2**shift)."""
    d16 = tl.arange(0, 16)
    t = tl.zeros([], tl.uint64 if IS_F64 else tl.uint32)
    c = tl.zeros([], tl.uint64 if IS_F64 else tl.uint32)
    if on:
        s_ge = tl.zeros([], tl.int64)
        shift = tl.full([], KEY_BITS - 4, tl.int32)
        more = shift >= 0
        while more:
            sums, kmin, kmax = _pass_sums(x_row, V, t_div, s_max, tk, ck, t, c, shift, False, USE_Q, IS_F64,
                                          ID_BITS, BLOCK_V)
            d = tl.max(tl.where(sums.to(tl.float64) >= target, d16, 0), axis=0)
            # Early exit: when the weighted tokens left in the range share one key, that key is
            # the answer (the count is the same at t and at it, and too small above it).
            single = kmin == kmax
            s_ge = tl.where(single, tl.sum(tl.where(d16 == 0, sums, 0), axis=0),
                            tl.sum(tl.where(d16 == d, sums, 0), axis=0))
            t = tl.where(single, kmax, t + (d.to(t.dtype) << shift))
            shift -= 4
            more = (shift >= 0) & (kmin != kmax)
        # All tokens tied at value t are kept iff the last of them is: its mass above is
        # s_ge - (its weight). Only otherwise search the id among the ties.
        if USE_Q:
            w_t = _q(_key_value(t, IS_F64), s_max)
        else:
            w_t = tl.full([], 1, tl.int64)
        if (s_ge - w_t).to(tl.float64) >= target:
            for i in range(0, ID_BITS // 4):
                sums, _, _ = _pass_sums(x_row, V, t_div, s_max, tk, ck, t, c, ID_BITS - 4 - 4 * i, True, USE_Q,
                                        IS_F64, ID_BITS, BLOCK_V)
                d = tl.max(tl.where(sums.to(tl.float64) >= target, d16, 0), axis=0)
                c = c + (d.to(t.dtype) << (ID_BITS - 4 - 4 * i))
    return t, c


@triton.jit
def _scaled_block(x_row, v0, V: tl.constexpr, t_div, IS_F64: tl.constexpr, ID_BITS: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    """One block of a row: its token ids, the mask of real ones, the scaled logits ``x / T``, their
    order keys and the reversed ids that break ties towards the lowest id."""
    offs = v0 + tl.arange(0, BLOCK_V)
    m = offs < V
    s = _scale(tl.load(x_row + offs, mask=m, other=float("-inf")), t_div, IS_F64)
    key = _order_key(s, IS_F64)
    idrev = ((1 << ID_BITS) - 1 - offs).to(key.dtype)
    return offs, m, s, key, idrev


@triton.jit
def _raw_argmax(x_row, V: tl.constexpr, x_max, x_arg, BLOCK_V: tl.constexpr):
    """Max and argmax (ties -> lowest id) of a row's raw logits, from ``x_max`` = -inf, ``x_arg`` = 0."""
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < V
        x = tl.load(x_row + offs, mask=m, other=float("-inf"))
        bmax = tl.max(x, axis=0)
        barg = tl.min(tl.where((x == bmax) & m, offs, 2147483647), axis=0)
        x_arg = tl.where(bmax > x_max, barg, x_arg)
        x_max = tl.maximum(bmax, x_max)
    return x_max, x_arg


# ------------------------------------------------------------------ kernels
@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "step_lo"])
def _verify_kernel(logits_ptr, stride_row, draft_ptr, row_req_ptr, row_start_ptr, temp_ptr, top_k_ptr, top_p_ptr,
                   uid_ptr, sidx_ptr, pos0_ptr, tokens_ptr, n_accept_ptr, seed_lo, seed_hi, step_lo, V: tl.constexpr,
                   IS_F64: tl.constexpr, ID_BITS: tl.constexpr, BLOCK_V: tl.constexpr):
    KEY_BITS: tl.constexpr = 64 if IS_F64 else 32
    row = tl.program_id(0)
    b = tl.load(row_req_ptr + row)
    j = row - tl.load(row_start_ptr + b)
    n_rows = tl.load(row_start_ptr + b + 1) - tl.load(row_start_ptr + b)
    x_row = logits_ptr + row.to(tl.int64) * stride_row
    temp = tl.load(temp_ptr + b)
    top_k = tl.load(top_k_ptr + b)
    top_p = tl.load(top_p_ptr + b)
    sampled = temp != 0
    t_div = tl.where(sampled, temp, 1.0)
    k_on = sampled & (top_k > 0) & (top_k < V)
    p_on = sampled & (top_p < 1.0)

    # 1. raw max and argmax (ties -> lowest id)
    x_max = tl.full([], float("-inf"), temp.dtype)
    x_arg = tl.zeros([], tl.int32)
    if (~sampled) | p_on:
        x_max, x_arg = _raw_argmax(x_row, V, x_max, x_arg, BLOCK_V)
    s_max = _scale(x_max, t_div, IS_F64)  # max(x / T) == max(x) / T: rounding is monotone

    # 2. top-k, 3. top-p cutoffs
    tk, ck = _cutoff(x_row, V, t_div, s_max, 0, 0, top_k.to(tl.float64), k_on, False, IS_F64, KEY_BITS, ID_BITS,
                     BLOCK_V)
    z = tl.zeros([], tl.int64)
    if p_on:
        for v0 in range(0, V, BLOCK_V):
            offs, m, s, key, idrev = _scaled_block(x_row, v0, V, t_div, IS_F64, ID_BITS, BLOCK_V)
            z += tl.sum(tl.where(m & _at_or_above(key, idrev, tk, ck), _q(s, s_max), 0), axis=0)
    tp, cp = _cutoff(x_row, V, t_div, s_max, tk, ck, top_p * z.to(tl.float64), p_on, True, IS_F64, KEY_BITS,
                     ID_BITS, BLOCK_V)

    # 4. noise, argmax of the kept s + g
    h_row = _row_hash(seed_lo, seed_hi, step_lo, tl.load(uid_ptr + b), tl.load(sidx_ptr + b),
                      tl.load(pos0_ptr + b) + j)
    best = tl.full([], float("-inf"), temp.dtype)
    arg = tl.zeros([], tl.int32)
    if sampled:
        for v0 in range(0, V, BLOCK_V):
            offs, m, s, key, idrev = _scaled_block(x_row, v0, V, t_div, IS_F64, ID_BITS, BLOCK_V)
            keep = m & _at_or_above(key, idrev, tk, ck) & _at_or_above(key, idrev, tp, cp)
            val = tl.where(keep, s + _gumbel(h_row, offs).to(temp.dtype), float("-inf"))
            bmax = tl.max(val, axis=0)
            barg = tl.min(tl.where((val == bmax) & m, offs, 2147483647), axis=0)
            arg = tl.where(bmax > best, barg, arg)
            best = tl.maximum(bmax, best)
    token = tl.where(sampled, arg, x_arg).to(tl.int64)
    tl.store(tokens_ptr + row, token)
    # n_accept starts at n_rows - 1; the first mismatching row lowers it (order-independent min)
    mismatch = (token != tl.load(draft_ptr + row)) & (j < n_rows - 1)
    tl.atomic_min(n_accept_ptr + b, j, mask=mismatch)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "step_lo"])
def _noise_kernel(out_ptr, uid_ptr, sidx_ptr, pos_ptr, seed_lo, seed_hi, step_lo, V: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    h_row = _row_hash(seed_lo, seed_hi, step_lo, tl.load(uid_ptr + row), tl.load(sidx_ptr + row),
                      tl.load(pos_ptr + row))
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        tl.store(out_ptr + row.to(tl.int64) * V + offs, _gumbel(h_row, offs), mask=offs < V)


@triton.jit
def _detmath_kernel(x_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):  # parity tests only
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if OP == 0:
        y = _det_log(x)
    elif OP == 1:
        y = _det_exp(x)
    else:
        y = _neg(_det_log(_neg(_det_log(x))))
    tl.store(out_ptr + offs, y, mask=offs < n)


# ------------------------------------------------------------------ host wrappers
def _key_words(seed: int, step: int) -> tuple[int, int, int]:
    seed &= (1 << 64) - 1
    return seed & _M32, seed >> 32, step & _M32


def _id_bits(vocab: int) -> int:
    """Bits of ``2**ID_BITS - 1 - id``, a multiple of 4 (one search pass per 4 bits)."""
    return max(4, -(-max(vocab - 1, 1).bit_length() // 4) * 4)


def gumbel_noise_triton(seed: int, step: int, prompt_uid: torch.Tensor, sample_idx: torch.Tensor,
                        position: torch.Tensor, vocab_size: int, block_v: int = 1024) -> torch.Tensor:
    """float32 noise [N, V], bitwise equal to ``sampler.gumbel_noise(..., torch.float32)``
    (the kernel's noise path, exposed for parity tests)."""
    n = prompt_uid.numel()
    out = torch.empty(n, vocab_size, dtype=torch.float32, device=prompt_uid.device)
    as64 = lambda t: t.to(torch.int64).contiguous()  # noqa: E731
    _noise_kernel[(n,)](out, as64(prompt_uid), as64(sample_idx), as64(position), *_key_words(seed, step), vocab_size,
                        BLOCK_V=block_v, enable_fp_fusion=False)
    return out


def detmath_triton(x: torch.Tensor, op: str, block: int = 1 << 16) -> torch.Tensor:
    """The kernel's float32 ``det_log`` / ``det_exp`` / ``gumbel`` (u -> -det_log(-det_log(u)))
    on a flat float32 tensor, for parity tests against ``megarl.engine.detmath``."""
    ops = ("det_log", "det_exp", "gumbel")
    if op not in ops:
        raise ValueError(f"detmath_triton: op={op!r} is invalid; valid choices: {', '.join(ops)}")
    x = x.to(torch.float32).contiguous().view(-1)
    out = torch.empty_like(x)
    _detmath_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), OP=ops.index(op), BLOCK=block,
                                                      enable_fp_fusion=False)
    return out


def verify_triton(logits, draft_next, row_start, rows: SamplingRows, block_v: int = 512, num_warps: int = 8,
                  check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and results as ``megarl.engine.verify.verify`` (float32/float64 logits).
    ``check=False`` skips the input validation (``verify`` has done it)."""
    if check:
        check_inputs(logits, draft_next, row_start, rows)
    if logits.dtype not in TRITON_DTYPES:
        raise TypeError(f"verify_triton: logits dtype {logits.dtype} is unsupported; valid: float32, float64")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"verify_triton: block_v={block_v} is invalid; valid: a power of two >= 16")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n, vocab = logits.shape
    req, _ = row_request(row_start, n)
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    n_accept = (row_start[1:] - row_start[:-1] - 1).contiguous()
    _verify_kernel[(n,)](
        logits, logits.stride(0), draft_next.contiguous(), req, row_start.contiguous(),
        rows.temperature.to(logits.dtype).contiguous(), rows.top_k.contiguous(), rows.top_p.contiguous(),
        rows.uid.contiguous(), rows.sample_idx.contiguous(), rows.position.contiguous(), tokens, n_accept,
        *_key_words(rows.seed, rows.step), vocab,
        IS_F64=logits.dtype == torch.float64, ID_BITS=_id_bits(vocab), BLOCK_V=block_v,
        num_warps=num_warps, enable_fp_fusion=False)
    return tokens, n_accept
