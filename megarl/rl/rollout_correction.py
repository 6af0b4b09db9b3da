"""Rollout correction: importance weights for an engine whose logprobs are not the trainer's.

When the rollout engine is exact (docs/design.md §1.3: megarl's own engine in fp64, or where
``logprob_diff_max`` stays at rounding level) the samples come from the trainer's own
distribution and no correction is needed. An inexact engine (another backend, bf16 kernels on a
GPU) samples from ``pi_engine`` while the update assumes samples of ``pi_old`` (the trainer's
logprobs of the weights that generated them); the per-token ratio

    rho = pi_old(token) / pi_engine(token) = exp(old_logprob - engine_logprob)

reweights each token's policy-gradient term (never the KL term). Following the field's
convention (verl's rollout correction, ``rollout_is_mode`` truncate/mask at token level;
slime's TIS/MIS in its train-inference mismatch helper; Liu, Li et al. 2025, "When Speed Kills
Stability"), with threshold C:

- ``tis`` (truncated importance sampling): weight ``min(rho, C)``;
- ``mis`` (masked importance sampling): weight ``rho`` where ``1/C <= rho <= C``, else 0 (the
  token is rejected: it carries no gradient).

The weight is a constant of the loss (computed from detached logprobs), as in both references.
One difference from verl's mask mode: a rejected token stays in the loss's normaliser (the
step's response-token count, docs/design.md §1.4), which stream training needs to know before
the trainer's logprobs of the step's last group exist; it contributes 0 to the sum.
"""
from __future__ import annotations

from torch import Tensor
import torch

MODES = ("none", "tis", "mis")


def correction_weights(old_logprobs: Tensor, engine_logprobs: Tensor, loss_mask: Tensor, mode: str,
                       threshold: float, num_tokens: float | Tensor) -> tuple[Tensor, dict[str, float]]:
    """Per-token weights [B, T] (1 at masked positions) for ``mode`` and threshold C, and their
    metrics in the loss contract's convention (megarl/rl/grpo.py: sums over response tokens divided
    by ``num_tokens``; ``*_max`` a maximum): ``is_ratio`` (mean rho, before truncation or masking),
    ``is_ratio_max``, and ``is_clip_frac`` (tis: tokens with rho > C) or ``is_mask_frac`` (mis:
    tokens with rho outside [1/C, C])."""
    if mode not in ("tis", "mis"):
        raise ValueError(f"rollout correction mode must be one of {MODES[1:]}, got {mode!r}")
    mask = loss_mask.bool()
    with torch.no_grad():
        log_rho = (old_logprobs.detach().double() - engine_logprobs.double())
        log_rho = torch.where(mask, log_rho, torch.zeros((), dtype=log_rho.dtype))
        rho = torch.exp(log_rho)
        if mode == "tis":
            out = rho > threshold
            weights = torch.clamp(rho, max=threshold)
        else:
            out = (rho > threshold) | (rho < 1.0 / threshold)
            weights = torch.where(out, torch.zeros((), dtype=rho.dtype), rho)
        out = out & mask
        zero = torch.zeros((), dtype=rho.dtype)
        metrics = {"is_ratio": float(torch.where(mask, rho, zero).sum() / num_tokens),
                   "is_ratio_max": float(torch.where(mask, rho, zero).max()) if rho.numel() else 0.0,
                   ("is_clip_frac" if mode == "tis" else "is_mask_frac"): float(out.double().sum() / num_tokens)}
        weights = torch.where(mask, weights, torch.ones((), dtype=rho.dtype)).to(old_logprobs.dtype)
    return weights, metrics


def describe(mode: str, threshold: float) -> str:
    """The line a run logs at start: which correction its update applies."""
    if mode == "tis":
        return f"rollout correction: tis (each token's policy-gradient term weighted by min(pi_old/pi_engine, {threshold}))"
    if mode == "mis":
        return (f"rollout correction: mis (tokens with pi_old/pi_engine outside [1/{threshold}, {threshold}] carry "
                f"no gradient, the others are weighted by the ratio)")
    return ("rollout correction: none (the engine samples the trainer's distribution, docs/design.md §1.3; "
            "logprob_diff_max in the step metrics shows any mismatch)")
