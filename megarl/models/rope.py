"""RoPE inverse frequencies of the HF ``rope_type`` variants megarl's plain-torch model covers.

``default`` (plain RoPE), ``llama3`` (Llama 3.1's frequency-band smoothing) and ``yarn`` (NTK-by-parts
interpolation plus an attention factor that scales cos/sin). The formulas follow transformers'
``modeling_rope_utils`` so that logits equal HF's; they are computed in ``calc`` (fp32, or fp64 for
the fp64 exactness tests) from the same integer exponents.
"""
from __future__ import annotations

import math
from typing import Any

import torch

# Keys of an HF ``rope_parameters`` dict (besides rope_type / rope_theta) that each type reads.
ROPE_KEYS = {
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"},
}
REQUIRED_KEYS = {
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings"},
}


def check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    """One clear ValueError for a ``rope_scaling`` dict that is not a llama3/yarn one megarl computes."""
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_KEYS:
        raise ValueError(f"rope_type={rope_type!r} is not supported; valid choices: 'default', "
                         f"{', '.join(repr(t) for t in ROPE_KEYS)}")
    extra = set(scaling) - ROPE_KEYS[rope_type] - {"rope_type"}
    missing = REQUIRED_KEYS[rope_type] - {k for k, v in scaling.items() if v is not None}
    if extra or missing:
        raise ValueError(f"rope_type={rope_type!r} parameters {scaling!r}: unknown keys {sorted(extra)}, "
                         f"missing keys {sorted(missing)}; it takes {sorted(ROPE_KEYS[rope_type])} "
                         f"({sorted(REQUIRED_KEYS[rope_type])} required)")
    if not scaling["factor"] > 0:
        raise ValueError(f"rope_type={rope_type!r}: factor={scaling['factor']} must be > 0")
    if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"] > 0:
        raise ValueError(f"rope_type='llama3': need high_freq_factor > low_freq_factor > 0, got "
                         f"{scaling['high_freq_factor']} and {scaling['low_freq_factor']}")


def inv_freq_and_scale(head_dim: int, theta: float, scaling: dict[str, Any] | None, calc: torch.dtype,
                       device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the factor that multiplies cos/sin (1 but for yarn)."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(calc) / head_dim
    inv_freq = 1.0 / (theta ** exps)
    if scaling is None:
        return inv_freq, 1.0
    if scaling["rope_type"] == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(head_dim, theta, theta ** exps, scaling, calc)


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: wavelengths above the low-frequency band are divided by ``factor``, those below the
    high-frequency band kept, those between smoothly interpolated."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_attention_factor(s: dict[str, Any]) -> float:
    factor, mscale, mscale_all_dim = s["factor"], s.get("mscale"), s.get("mscale_all_dim")
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def _yarn(dim: int, base: float, pos_freqs: torch.Tensor, s: dict[str, Any],
          calc: torch.dtype) -> tuple[torch.Tensor, float]:
    """YaRN (NTK-by-parts): dimensions rotating fewer than ``beta_slow`` times over the original
    context are interpolated (divided by ``factor``), more than ``beta_fast`` times kept, a linear
    ramp between."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp.to(device=pos_freqs.device, dtype=calc)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, _yarn_attention_factor(s)
