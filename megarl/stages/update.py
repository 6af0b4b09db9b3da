"""The training half of a GRPO step once the rollout is over: one optimizer step on the step's groups.

Its twin, :class:`megarl.stream_train.stream.StreamUpdate`, trains each group as soon as it
finishes while the rollout runs (stream training); both build their rows, advantages and loss
with megarl/rl/grpo.py, so they take the same update (docs/design.md: exactness).

Every logprob here (old, new, reference) is at the rollout's temperature: that of the
distribution the engine sampled from, ``log softmax(logits / T)`` without top-k/top-p.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.rl.batching import dp_rows
from megarl.rl.grpo import UpdateSpec, grpo_batch, grpo_loss_fn, trained_groups
from megarl.stream_train.logprobs import ref_token_logprobs


def grpo_update(trainer, groups, spec: UpdateSpec, ref=None) -> dict[str, float]:
    grpo, temperature = spec.grpo, spec.temperature
    groups = trained_groups(groups, grpo.drop_zero_variance)
    if not groups:  # every group dropped: no update (every process sees the same groups)
        return {"update_skipped": 1.0}
    results = [r for grp in groups for r in grp.results]
    batch = grpo_batch(groups, spec.group_size, spec.pad_id, grpo.normalize_std)
    adv = batch["advantages"]
    num_tokens = float(batch["loss_mask"].sum())  # the whole step's count, on every DP rank
    batch = dp_rows(batch, trainer.dims.dp_rank, trainer.dims.dp)  # this DP rank's rows
    # One optimizer step per RL step, so old == current policy and the ratio starts at 1; computed
    # explicitly all the same so that the objective stays PPO's if more updates per step are added.
    batch["old_logprobs"] = trainer.masked_logprobs(batch["input_ids"], batch["loss_mask"], temperature=temperature)
    diff = logprob_diff_max(trainer, batch, results)
    if ref is not None:
        batch["ref_logprobs"] = ref_token_logprobs(ref, batch["input_ids"], temperature)
    out = trainer.train_step(batch, grpo_loss_fn(grpo, num_tokens), temperature=temperature)
    out["adv_abs_mean"] = float(adv.abs().mean())
    out["logprob_diff_max"] = diff
    return out


def logprob_diff_max(trainer, batch, results) -> float:
    """Largest |engine logprob - trainer logprob| over the step's response tokens (all DP ranks):
    the on-policy check. Every sample must come from the weights being trained, so the two agree
    up to the engine's and trainer's rounding; a sample carried over from older weights shows up
    at once. Holds at every temperature: both sides are logprobs of softmax(logits / T), top-k/
    top-p not applied (``batch["old_logprobs"]`` must be taken at the rollout's temperature)."""
    d = trainer.dims
    rows = results[d.dp_rank::d.dp] if d.dp > 1 else results
    eng = torch.zeros_like(batch["old_logprobs"], dtype=torch.float64)
    for b, r in enumerate(rows):
        start = len(r.prompt_ids) - 1
        eng[b, start:start + len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float64)
    diff = ((batch["old_logprobs"].double() - eng).abs() * batch["loss_mask"].double()).max().reshape(1)
    if d.dp > 1:
        diff = diff.to(d.device)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=d.dp_group)
    return float(diff)
