"""The training half of a GRPO step once the rollout is over: one optimizer step on the step's groups.

Its twin, :class:`megarl.stream_train.stream.StreamUpdate`, trains each group as soon as it
finishes while the rollout runs (stream training); both build their rows, advantages and loss
with megarl/rl/grpo.py, so they take the same update (docs/design.md: exactness).

Every logprob here (old, new, reference) is at the rollout's temperature (``UpdateSpec.temperature``):
that of the distribution the engine sampled from, ``log softmax(logits / T)`` without top-k/top-p;
``grpo_batch`` checks that every response was sampled at it (``Result.temperature``).
"""
from __future__ import annotations

from megarl.rl.batching import dp_rows
from megarl.rl.grpo import UpdateSpec, grpo_batch, grpo_loss_fn, trained_groups
from megarl.trainer.logprobs import ref_token_logprobs


def grpo_update(trainer, groups, spec: UpdateSpec, ref=None, old_forward: bool = False) -> dict[str, float]:
    """One optimizer step on ``groups``. One step per RL step means the old policy is the one being
    trained: the PPO ratio takes the training forward's own logprobs, detached (ratio 1, the same
    gradient as with old logprobs from a separate identical forward), and the on-policy check
    ``logprob_diff_max`` comes from that forward too (max over micro-batches and DP ranks).
    ``old_forward``: compute the old logprobs in a separate forward first, as an update with
    several optimizer steps per RL step would need (benchmarks/bench_trainer.py compares; the
    update is the same up to rounding, tests/stages/test_update.py)."""
    grpo, temperature = spec.grpo, spec.temperature
    groups = trained_groups(groups, grpo.drop_zero_variance)
    if not groups:  # every group dropped: no update (every process sees the same groups)
        return {"update_skipped": 1.0}
    batch = grpo_batch(groups, spec.group_size, spec.pad_id, grpo.normalize_std, temperature)
    adv = batch["advantages"]
    num_tokens = float(batch["loss_mask"].sum())  # the whole step's count, on every DP rank
    batch = dp_rows(batch, trainer.dims.dp_rank, trainer.dims.dp)  # this DP rank's rows
    old = None
    if old_forward:
        batch["old_logprobs"] = trainer.masked_logprobs(batch["input_ids"], batch["loss_mask"],
                                                        temperature=temperature)
        old = "old_logprobs"
    if ref is not None:
        batch["ref_logprobs"] = ref_token_logprobs(ref, batch["input_ids"], temperature)
    out = trainer.train_step(batch, grpo_loss_fn(grpo, num_tokens, old=old), temperature=temperature)
    out["adv_abs_mean"] = float(adv.abs().mean())
    return out
