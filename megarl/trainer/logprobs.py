"""Token logprobs from vocab-parallel logits, without gathering the vocabulary.

With tensor parallelism each rank holds logits for a contiguous slice of the (padded) vocabulary.
Megatron's ``vocab_parallel_cross_entropy`` computes the same quantity but always in fp32; this
version keeps the logits' dtype when it is wider (fp64 exactness tests, docs/design.md §1) and masks
the vocabulary padding, which Megatron leaves to the padded rows being zero.

Temperature (docs/design.md §1): the logprobs are those of the distribution the engine samples from,
``log softmax(logits / T)`` with T = 0 (greedy) read as 1 and top-k/top-p not applied: exactly
what the engine's ``token_stats`` reports for a sampled token (megarl/engine/sampler.py), so the
on-policy check compares like with like at every temperature.

Cost per rank: three small all-reduces over the TP group (max, sum of exponentials, target
logit) of one value per token, instead of all-gathering [tokens, vocab] logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.rl.temperature import scoring_temperature


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, targets: torch.Tensor, group, vocab_start: int, vocab_size: int,
                temperature: float):
        width = local.shape[-1]
        x = local.to(torch.promote_types(local.dtype, torch.float32))
        if temperature != 1.0:
            # As the sampler divides (token_stats): in the promoted dtype, by T as a device tensor.
            # (A python-scalar divisor would run on CUDA as a multiplication by 1/T, which rounds
            # differently.) In place when x is already a copy: no second [tokens, vocab] buffer.
            t = torch.full((), temperature, dtype=x.dtype, device=x.device)
            x = x / t if x is local else x.div_(t)
        real = vocab_size - vocab_start  # columns of this slice that are real tokens
        if real < width:  # padding columns would add exp(0 - max) to the normaliser
            x = x.clone() if x is local else x
            x[..., max(real, 0):] = float("-inf")
        m = x.amax(-1)
        _all_reduce(m, dist.ReduceOp.MAX, group)
        e = (x - m[..., None]).exp()
        s = e.sum(-1)
        _all_reduce(s, dist.ReduceOp.SUM, group)
        local_t = targets - vocab_start
        inside = (local_t >= 0) & (local_t < width)
        local_t = local_t.clamp(0, width - 1)
        t_logit = torch.where(inside, x.gather(-1, local_t[..., None])[..., 0], torch.zeros_like(m))
        _all_reduce(t_logit, dist.ReduceOp.SUM, group)
        ctx.save_for_backward(e, s, local_t, inside)
        ctx.in_dtype, ctx.temperature = local.dtype, temperature
        return t_logit - m - s.log()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        e, s, local_t, inside = ctx.saved_tensors
        # d logprob / d logit_v = ([v == target] - softmax_v) / T; each rank owns its slice's columns.
        g = grad.to(e.dtype)
        if ctx.temperature != 1.0:
            g = g / ctx.temperature  # [tokens]: cheaper than scaling [tokens, vocab]
        out = e / s[..., None] * -g[..., None]
        out.scatter_add_(-1, local_t[..., None], (g * inside)[..., None])
        return out.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_logprobs(local_logits: torch.Tensor, targets: torch.Tensor, tp_group,
                            vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[target]`` per position, in at least fp32 (fp64 stays
    fp64): the sampling distribution's logprobs (module docstring); ``temperature`` 0 reads as 1.

    ``local_logits`` [..., Vp/tp] is this rank's slice of the padded vocabulary (rank r holds
    columns ``r*Vp/tp ..``); ``targets`` [...] are global token ids < ``vocab_size``; columns at or
    past ``vocab_size`` are padding and never count. Differentiable; every rank of ``tp_group``
    returns the same values. ``tp_group=None`` means the logits are the whole vocabulary."""
    if not temperature >= 0.0:
        raise ValueError(f"temperature={temperature!r} is invalid; valid range: >= 0 (0 = greedy, read as 1)")
    tp_rank = dist.get_rank(tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
    if targets.shape != local_logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits "
                         f"{tuple(local_logits.shape)} without the vocab dim")
    return _VocabParallelLogprob.apply(local_logits, targets, tp_group, tp_rank * local_logits.shape[-1],
                                       vocab_size, scoring_temperature(temperature))


def ref_token_logprobs(ref, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Logprob of token t+1 at t under the reference at ``temperature``, as the trainer's are, so
    the KL term compares the same distributions: [B, T-1], fp32. ``ref``: a sharded reference
    (megarl/trainer/reference.py, the trainer's forward on the reference weights: runs use
    it) or a plain-torch, whole-vocabulary model."""
    if hasattr(ref, "token_logprobs"):
        return ref.token_logprobs(input_ids, temperature)
    with torch.no_grad():
        logits = ref(input_ids).float()
        return vocab_parallel_logprobs(logits[:, :-1], input_ids[:, 1:], None, logits.shape[-1], temperature)
