"""Bit-reproducible float32 ``log`` and ``exp`` (docs/design.md §1: every backend samples the same token).

``torch.log`` / ``torch.exp`` (SLEEF on CPU, CUDA's libm, Triton's approximate ``lg2``, numpy)
differ in the last bits, so the sampler's noise and top-p weights would differ across backends.
These functions use only IEEE-754 basic operations, each correctly rounded on every backend
(``+ - * /``, ``floor``, comparisons, integer ops on the float's bits), in one fixed order, all
in float32. Each torch op below is one separately rounded kernel; the Triton twins in
``megarl/engine/verify_triton.py`` must be compiled with ``enable_fp_fusion=False`` (no FMA
contraction) and use ``tl.math.div_rn`` (Triton's float32 ``/`` is an approximate division).
Every constant is exactly representable in float32 (hex float in the comment), so torch's
scalar-to-float32 conversion and Triton's float literals give the same value.
Flush-to-zero does not change a bit (the engine turns it on for CPU speed; GPUs keep subnormals):
det_log never puts a subnormal through a float op (subnormal inputs are rescaled through the
integer mantissa), and det_exp's only subnormals come from tiny arguments, where they are far
below the rounding of the result; results below 2**-126 are returned as 0 explicitly.
Accuracy: within 2 ulp of the true value (tested over every noise input and a dense exp grid).

``det_log(x)`` (musl/FreeBSD ``logf``), for float32 ``x``::

    special: x == +-0 -> -inf;  x < 0 or NaN -> NaN;  x == +inf -> +inf
    subnormal x (bits < 0x00800000): m0 = float32(bits) (exact), k0 = -149; else m0 = x, k0 = 0
    ix = bits(m0) + (0x3f800000 - 0x3f3504f3)           # int32
    k  = k0 + (ix >> 23) - 127
    m  = float_from_bits((ix & 0x007fffff) + 0x3f3504f3)  # m in [sqrt(2)/2, sqrt(2))
    f = m - 1;  s = f / (2 + f);  z = s * s;  w = z * z
    t1 = w * (LG2 + w * LG4);  t2 = z * (LG1 + w * LG3);  R = t2 + t1
    hfsq = (0.5 * f) * f;  dk = float32(k)
    log = ((((s * (hfsq + R)) + dk * LN2_LO) - hfsq) + f) + dk * LN2_HI

``det_exp(x)`` (musl ``expf`` reduction and polynomial), for float32 ``x``::

    special: x < -87 -> 0 (results below the smallest normal float are flushed);
             x > 88 -> +inf;  NaN -> NaN
    k  = floor(x * INV_LN2 + 0.5)                      # |k| <= 127, k * LN2_HI is exact
    hi = x - k * LN2_HI_E;  lo = k * LN2_LO_E;  r = hi - lo
    rr = r * r;  c = r - rr * (P1 + rr * P2)
    y  = 1 + ((((r * c) / (2 - c)) - lo) + hi)
    exp = y * float_from_bits((int(k) + 127) << 23)    # exact scaling by 2**k

``det_exp(0) == 1`` exactly (k = 0, r = 0, y = 1 + 0).
"""
from __future__ import annotations

import torch

# log constants (musl logf); |(log(1+s)-log(1-s))/s - Lg(s)| < 2**-34.24
LG1 = 0.666666626930236816406250  # 0xaaaaaa.0p-24
LG2 = 0.400009721517562866210938  # 0xccce13.0p-25
LG3 = 0.284987866878509521484375  # 0x91e9ee.0p-25
LG4 = 0.242790788412094116210938  # 0xf89e26.0p-26
LN2_HI = 0.693138122558593750  # 0x3f317180
LN2_LO = 9.05800061445916071534e-06  # 0x3717f7d1
# exp constants (musl expf)
INV_LN2 = 1.44269502162933349609375  # 0x3fb8aa3b
LN2_HI_E = 0.693145751953125  # 0x3f317200 (9 trailing zero bits: k * LN2_HI_E is exact)
LN2_LO_E = 1.428606765330187045037746e-06  # 0x35bfbe8e
P1 = 0.1666662544012069702148438  # 0xaaaa8f.0p-26
P2 = -2.766733290627598762512207e-03  # -0xb55215.0p-32
EXP_LO, EXP_HI = -87.0, 88.0

_SQRT_HALF_BITS = 0x3F3504F3
_ONE_BITS = 0x3F800000


def _f32(x: torch.Tensor, name: str) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"{name} needs a float32 tensor, got {x.dtype}")


def det_log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of a float32 tensor, bit-identical on every backend (op sequence above)."""
    _f32(x, "det_log")
    bits = x.view(torch.int32)
    sub = (bits > 0) & (bits < 0x00800000)
    # subnormal: bits is the integer mantissa, x = bits * 2**-149; int -> float is exact and no
    # float op ever sees the subnormal (flush-to-zero hardware would turn it into 0)
    m0 = torch.where(sub, bits.to(torch.float32), x)
    k0 = torch.where(sub, -149, 0).to(torch.int32)
    ix = m0.view(torch.int32) + (_ONE_BITS - _SQRT_HALF_BITS)
    k = k0 + (ix >> 23) - 127
    m = ((ix & 0x007FFFFF) + _SQRT_HALF_BITS).view(torch.float32)
    f = m - 1.0
    s = f / (f + 2.0)
    z = s * s
    w = z * z
    t1 = w * ((w * LG4) + LG2)
    t2 = z * ((w * LG3) + LG1)
    r = t2 + t1
    hfsq = (f * 0.5) * f
    dk = k.to(torch.float32)
    out = ((((s * (hfsq + r)) + (dk * LN2_LO)) - hfsq) + f) + (dk * LN2_HI)
    out = torch.where(bits == 0x7F800000, float("inf"), out)
    out = torch.where((bits < 0) | (bits > 0x7F800000), float("nan"), out)  # x < 0 or NaN
    return torch.where((bits & 0x7FFFFFFF) == 0, float("-inf"), out)  # +-0


def det_exp(x: torch.Tensor) -> torch.Tensor:
    """exp of a float32 tensor, bit-identical on every backend (op sequence above)."""
    _f32(x, "det_exp")
    inside = (x >= EXP_LO) & (x <= EXP_HI)
    xc = torch.where(inside, x, 0.0)  # keeps k in [-126, 127] so 2**k is a normal float
    k = torch.floor((xc * INV_LN2) + 0.5)
    hi = xc - (k * LN2_HI_E)
    lo = k * LN2_LO_E
    r = hi - lo
    rr = r * r
    c = r - (rr * ((rr * P2) + P1))
    y = (((r * c) / (2.0 - c)) - lo) + hi
    y = y + 1.0
    scale = ((k.to(torch.int32) + 127) << 23).view(torch.float32)
    out = y * scale
    out = torch.where(x < EXP_LO, 0.0, out)
    out = torch.where(x > EXP_HI, float("inf"), out)
    return torch.where(torch.isnan(x), float("nan"), out)
