"""The training half of a GRPO step: advantages, old/ref logprobs, one optimizer step."""
from __future__ import annotations

import torch

from megarl.config import RunConfig
from megarl.rl.batching import dp_rows, make_batch
from megarl.rl.grpo import group_advantages, grpo_loss


def ref_token_logprobs(ref, input_ids: torch.Tensor) -> torch.Tensor:
    """Logprob of token t+1 at t under the (plain-torch) reference model: [B, T-1]."""
    with torch.no_grad():
        logits = ref(input_ids).float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def grpo_update(trainer, groups, cfg: RunConfig, inputs, ref=None) -> dict[str, float]:
    g = cfg.rollout.group_size
    results = [r for grp in groups for r in grp.results]
    rewards = torch.tensor([x for grp in groups for x in grp.rewards], dtype=torch.float32)
    adv = group_advantages(rewards, g, normalize_std=cfg.grpo.normalize_std)
    batch = make_batch([r.prompt_ids for r in results], [r.tokens for r in results], inputs.tokenizer.pad_id)
    batch["advantages"] = adv
    num_tokens = float(batch["loss_mask"].sum())  # the whole step's count, on every DP rank
    batch = dp_rows(batch, trainer.dims.dp_rank, trainer.dims.dp)  # this DP rank's rows
    # One optimizer step per RL step, so old == current policy and the ratio starts at 1; computed
    # explicitly all the same so that the objective stays PPO's if more updates per step are added.
    batch["old_logprobs"] = trainer.masked_logprobs(batch["input_ids"], batch["loss_mask"])
    if ref is not None:
        batch["ref_logprobs"] = ref_token_logprobs(ref, batch["input_ids"])
    c = cfg.grpo

    def loss_fn(logprobs, mb):
        return grpo_loss(logprobs, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], num_tokens,
                         clip_eps_low=c.clip_eps_low, clip_eps_high=c.clip_eps_high, kl_coef=c.kl_coef,
                         ref_logprobs=mb.get("ref_logprobs"))

    out = trainer.train_step(batch, loss_fn)
    out["adv_abs_mean"] = float(adv.abs().mean())
    return out
