"""GRPO losses as pure tensor functions (no model, no process groups, no hidden state).

Normalisation convention (the one stream training relies on): every loss is a *sum* over the
micro-batch's response tokens divided by ``num_tokens``, the total response-token count of the
whole optimizer step, known before the step's optimizer update. Summing the micro-batch losses
(or accumulating their gradients) therefore gives exactly the token-level mean over the step,
whatever the micro-batch split or the order in which groups finish. Metrics follow the same
convention, so they too are summed over micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch
from torch import Tensor

from megarl.rl.batching import make_batch
from megarl.rl.rollout_correction import correction_weights


@dataclass
class GRPOConfig:
    """The GRPO objective (the ``grpo`` section)."""

    clip_eps_low: float = 0.2
    """PPO clip below: ratio >= 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """PPO clip above: ratio <= 1 + clip_eps_high (DAPO's clip-higher when larger)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference (the post-SFT policy); 0 turns it off (no ref forward)."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group's std."""
    drop_zero_variance: bool = False
    """DAPO's dynamic sampling, filter half: groups whose G rewards are all equal carry no
    advantage signal and are not trained (counted as ``zero_var_dropped``); the loss is
    normalised by the tokens of the groups trained. A step left with none takes no update."""
    rollout_correction: Literal["none", "tis", "mis"] = "none"
    """Correction for an engine whose logprobs differ from the trainer's (megarl/rl/rollout_correction.py):
    ``tis`` weights each token's policy-gradient term by min(rho, C), ``mis`` by rho where
    1/C <= rho <= C and 0 elsewhere, rho = pi_old / pi_engine of the sampled token. ``none``: megarl's
    engine is exact (docs/design.md §1.3), so rho is 1 up to rounding."""
    rollout_correction_threshold: float = 2.0
    """C of ``rollout_correction`` (verl's ``rollout_is_threshold``, slime's ``tis_clip``: 2.0)."""

    def __post_init__(self) -> None:
        from megarl.utils.dataclass_config import check_number

        check_number("grpo.clip_eps_low", self.clip_eps_low, ge=0, le=1, note="the ratio is kept >= 1 - clip_eps_low")
        check_number("grpo.clip_eps_high", self.clip_eps_high, ge=0, note="the ratio is kept <= 1 + clip_eps_high")
        check_number("grpo.kl_coef", self.kl_coef, ge=0, note="0 = no KL term")
        check_number("grpo.rollout_correction_threshold", self.rollout_correction_threshold, gt=1,
                     note="tis truncates the ratio at C, mis keeps ratios in [1/C, C]")


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6, normalize_std: bool = True) -> Tensor:
    """Group-relative advantages.

    ``rewards`` is laid out group by group: ``N = num_groups * group_size``, entries
    ``g*G .. g*G+G-1`` are the G samples of prompt g. For sample i of group g::

        A_i = (r_i - mean_g) / (std_g + eps)     if normalize_std  (std_g: unbiased, 1/(G-1))
        A_i =  r_i - mean_g                      otherwise         (Dr. GRPO)

    The unbiased std matches the GRPO reference implementations (TRL, verl: ``torch.std``).
    A group whose rewards are all equal gets advantages 0. ``group_size == 1`` gives all zeros
    (there is no baseline to compare with), not NaN.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (groups laid out one after another), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"group_size must be >= 1 and divide the number of rewards {rewards.numel()}, "
                         f"got {group_size}")
    r = rewards if rewards.is_floating_point() else rewards.double()
    grouped = r.view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centered = centered / (grouped.std(dim=1, unbiased=True, keepdim=True) + eps)
    return centered.reshape(-1)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) (Schulman, "Approximating KL divergence")::

        d = ref_logprobs - logprobs;   k3 = exp(d) - d - 1   (>= 0, unbiased for samples of pi)
    """
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def _check_num_tokens(num_tokens: float | Tensor) -> None:
    if not isinstance(num_tokens, Tensor) and not num_tokens > 0:
        raise ValueError(f"num_tokens must be > 0 (the step's total response-token count), got {num_tokens}")


def _check_grpo_inputs(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
                       num_tokens: float | Tensor, kl_coef: float, ref_logprobs: Tensor | None,
                       token_weights: Tensor | None) -> None:
    """:func:`grpo_loss`'s arguments agree in shape, and the KL term has its reference."""
    _check_num_tokens(num_tokens)
    if logprobs.shape != old_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
                         f"loss_mask {tuple(loss_mask.shape)} must have the same [B, T] shape")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must have shape [B] = {tuple(logprobs.shape[:1])}, got {tuple(advantages.shape)}")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs")
    if token_weights is not None and token_weights.shape != logprobs.shape:
        raise ValueError(f"token_weights {tuple(token_weights.shape)} must have the [B, T] shape "
                         f"{tuple(logprobs.shape)}")


def grpo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
              num_tokens: float | Tensor, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2,
              kl_coef: float = 0.0, ref_logprobs: Tensor | None = None,
              token_weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO/PPO surrogate with token-level normalisation over the step.

    Shapes: ``logprobs``, ``old_logprobs``, ``loss_mask``, ``ref_logprobs``: [B, T];
    ``advantages``: [B] (one per sequence, broadcast over its tokens). Per token::

        ratio = exp(logprobs - old_logprobs)
        pg    = -min(ratio * A, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A)
        tok   = w * pg + kl_coef * k3(logprobs, ref_logprobs)
        loss  = sum(tok * mask) / num_tokens

    ``w``: ``token_weights`` [B, T], constants (a rollout correction's, megarl/rl/rollout_correction.py),
    1 when not given. ``clip_eps_high > clip_eps_low`` is DAPO's clip-higher. Masked positions are excluded with
    ``where`` (not multiplied), so padding holding -inf or NaN log-probs cannot poison the loss
    or its gradient.

    Metrics (python floats, each a masked sum / num_tokens, so micro-batch values add up to the
    step's): ``pg_loss``; ``clip_frac`` (tokens where the clipped term is the active, strictly
    larger loss); ``ratio`` (mean ratio); ``kl`` (mean k3) when ``ref_logprobs`` is given.
    """
    _check_grpo_inputs(logprobs, old_logprobs, advantages, loss_mask, num_tokens, kl_coef, ref_logprobs,
                       token_weights)
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # Zero the masked inputs *before* any arithmetic: a where() on the output alone still lets
    # NaN gradients through (0 * NaN) from e.g. -inf - -inf at padding.
    logprobs = torch.where(mask, logprobs, zero)
    old_logprobs = torch.where(mask, old_logprobs, zero)
    if ref_logprobs is not None:
        ref_logprobs = torch.where(mask, ref_logprobs, zero)
    adv = advantages.to(logprobs.dtype).unsqueeze(1)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    pg = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        pg = pg * torch.where(mask, token_weights.detach().to(pg.dtype), zero)
    per_token = pg
    metrics: dict[str, float] = {}
    if ref_logprobs is not None:
        kl = kl_k3(logprobs, ref_logprobs)
        if kl_coef != 0.0:
            per_token = per_token + kl_coef * kl
        metrics["kl"] = float(torch.where(mask, kl, zero).sum().detach() / num_tokens)
    loss = torch.where(mask, per_token, zero).sum() / num_tokens
    with torch.no_grad():
        metrics["pg_loss"] = float(torch.where(mask, pg, zero).sum() / num_tokens)
        metrics["clip_frac"] = float((mask & (clipped > unclipped)).sum() / num_tokens)
        metrics["ratio"] = float(torch.where(mask, ratio, zero).sum() / num_tokens)
    return loss, metrics


def sft_loss(logprobs: Tensor, loss_mask: Tensor, num_tokens: float | Tensor) -> Tensor:
    """Negative log-likelihood with the same step-level normalisation::

        loss = -sum(logprobs * mask) / num_tokens
    """
    _check_num_tokens(num_tokens)
    if logprobs.shape != loss_mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and loss_mask {tuple(loss_mask.shape)} must match")
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    return -torch.where(loss_mask.bool(), logprobs, zero).sum() / num_tokens


# ------------------------------------------------------------------------- a step's batch and loss
# One builder for both ways a step is trained (megarl/stages/update.py after the rollout,
# megarl/stream_train/stream.py group by group while it runs): the same rows, advantages and loss.

def has_signal(group) -> bool:
    """A group whose rewards are not all equal (its advantages are not all zero)."""
    return len(set(group.rewards)) > 1


def trained_groups(groups: Sequence, drop_zero_variance: bool) -> list:
    """The groups a step trains: all, or (``grpo.drop_zero_variance``) those with a signal."""
    return [g for g in groups if has_signal(g)] if drop_zero_variance else list(groups)


@dataclass(frozen=True)
class UpdateSpec:
    """What a step's update needs beyond the trainer: the objective, the group size, the
    temperature the trainer scores at (``rollout.temperature``: every logprob, old, new and the
    reference's, is at it; :func:`grpo_batch` checks that each response was sampled at it) and
    the padding id."""

    grpo: GRPOConfig
    group_size: int
    temperature: float
    pad_id: int

    @classmethod
    def of(cls, cfg, pad_id: int) -> "UpdateSpec":
        """From a run config (``grpo``, ``rollout.group_size``, ``rollout.temperature``)."""
        return cls(cfg.grpo, cfg.rollout.group_size, cfg.rollout.temperature, pad_id)


def grpo_batch(groups: Sequence, group_size: int, pad_id: int, normalize_std: bool,
               temperature: float) -> dict[str, Tensor]:
    """``input_ids``, ``loss_mask`` (megarl/rl/batching.py), per-row ``advantages`` and
    ``rollout_logprobs`` [B, T-1] (fp64: the engine's logprob of each response token where
    ``loss_mask`` is set, 0 elsewhere) of ``groups`` (objects with ``results``, each with
    ``prompt_ids``, ``tokens``, ``logprobs`` and ``temperature``, and ``rewards``): the
    prompt/response boundary is the engine's, in token space. ``temperature``: the one the
    trainer scores at; every result must have been sampled at it (:func:`check_sampled_at`)."""
    results = [r for g in groups for r in g.results]
    check_sampled_at(results, temperature)
    rewards = torch.tensor([x for g in groups for x in g.rewards], dtype=torch.float32)
    batch = make_batch([r.prompt_ids for r in results], [r.tokens for r in results], pad_id)
    batch["advantages"] = group_advantages(rewards, group_size, normalize_std=normalize_std)
    eng = torch.zeros(batch["loss_mask"].shape, dtype=torch.float64)
    for b, r in enumerate(results):
        start = len(r.prompt_ids) - 1  # the prediction of the first response token
        eng[b, start:start + len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float64)
    batch["rollout_logprobs"] = eng
    return batch


def check_sampled_at(results: Sequence, temperature: float) -> None:
    """The trainer scores every token at ``temperature`` (docs/design.md §1.3); a response sampled
    at another one would be trained as if drawn from a distribution it was not drawn from (its
    ratio to the engine's logprobs, and ``logprob_diff_max``, would be off by the temperature, not
    by rounding). One error naming the first such response."""
    bad = [r for r in results if r.temperature != temperature]
    if bad:
        r = bad[0]
        raise ValueError(f"{len(bad)} of {len(results)} responses were sampled at another temperature than the "
                         f"trainer scores at: uid={r.uid} sample_idx={r.sample_idx} at temperature {r.temperature}, "
                         f"the trainer at {temperature} (rollout.temperature); sample at the temperature the "
                         f"update scores at")


def logprob_diff_max(logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor) -> float:
    """Largest |trainer logprob - engine logprob| over the response tokens (``loss_mask``), in
    fp64: the on-policy check. Every sample must come from the weights being trained, so the two
    agree up to the engine's and trainer's rounding; a sample carried over from older weights
    shows up at once. Holds at every temperature: both sides are logprobs of softmax(logits / T),
    top-k/top-p not applied (the trainer's must be taken at the rollout's temperature)."""
    diff = (logprobs.detach().double() - rollout_logprobs.double()).abs()
    return float(torch.where(loss_mask.bool(), diff, torch.zeros((), dtype=diff.dtype)).max()) if diff.numel() else 0.0


def grpo_loss_fn(c: GRPOConfig, num_tokens: float, old: str | None = None) -> Callable:
    """The trainer's ``loss_fn(logprobs, micro_batch)``: :func:`grpo_loss` normalised by
    ``num_tokens``. The old policy's logprobs: by default (one optimizer step per RL step, old
    policy = current) this forward's, detached: the ratio is 1 in value and its gradient that of
    the ratio to a separate identical forward's; or the micro-batch's ``old`` entry (logprobs of a
    separate forward, e.g. ``old_logprobs``).

    With ``rollout_logprobs`` in the micro-batch (:func:`grpo_batch`) the metrics hold
    ``logprob_diff_max`` (:func:`logprob_diff_max` of this forward), which the trainer reduces by
    max over micro-batches and data-parallel ranks (its ``*_max`` convention). With
    ``c.rollout_correction`` the policy-gradient terms are weighted by the correction of the old
    logprobs against ``rollout_logprobs``, and its metrics (``is_*``) join the step's."""
    def loss_fn(logprobs: Tensor, mb: dict):
        old_lp = mb[old] if old is not None else logprobs.detach()
        weights, is_metrics = None, {}
        if c.rollout_correction != "none":
            if "rollout_logprobs" not in mb:
                raise ValueError(f"grpo.rollout_correction={c.rollout_correction} needs the engine's logprobs "
                                 f"(the batch's rollout_logprobs, megarl/rl/grpo.py grpo_batch)")
            weights, is_metrics = correction_weights(old_lp, mb["rollout_logprobs"], mb["loss_mask"],
                                                     c.rollout_correction, c.rollout_correction_threshold, num_tokens)
        loss, metrics = grpo_loss(logprobs, old_lp, mb["advantages"], mb["loss_mask"], num_tokens,
                                  clip_eps_low=c.clip_eps_low, clip_eps_high=c.clip_eps_high, kl_coef=c.kl_coef,
                                  ref_logprobs=mb.get("ref_logprobs"), token_weights=weights)
        metrics.update(is_metrics)
        if "rollout_logprobs" in mb:
            metrics["logprob_diff_max"] = logprob_diff_max(logprobs, mb["rollout_logprobs"], mb["loss_mask"])
        return loss, metrics

    return loss_fn
