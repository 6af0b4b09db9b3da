"""The training half of a GRPO step: advantages, old/ref logprobs, one optimizer step.

Two ways to feed it, same update (DESIGN.md §2): :func:`grpo_update` takes the step's groups once
rollout is over; :class:`StreamUpdate` takes each group as soon as it finishes (stream training)
and runs its forward/backward then, while this process's other requests are still generating,
and takes the optimizer step once the step's last group is in.

Every logprob here (old, new, reference) is at ``rollout.temperature``: that of the distribution
the engine sampled from, ``log softmax(logits / T)`` without top-k/top-p (DESIGN.md §2).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megarl.config import RunConfig
from megarl.rl.batching import dp_rows, make_batch
from megarl.rl.grpo import group_advantages, grpo_loss
from megarl.stream_train.logprobs import vocab_parallel_logprobs


def ref_token_logprobs(ref, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Logprob of token t+1 at t under the (plain-torch) reference model at ``temperature`` (as the
    trainer's, so the KL term compares the same distributions): [B, T-1], fp32."""
    with torch.no_grad():
        logits = ref(input_ids).float()
        return vocab_parallel_logprobs(logits[:, :-1], input_ids[:, 1:], None, logits.shape[-1], temperature)


def has_signal(group) -> bool:
    """A group whose rewards are not all equal (its advantages are not all zero)."""
    return len(set(group.rewards)) > 1


def trained_groups(groups, cfg: RunConfig) -> list:
    """The groups a step trains: all, or with ``grpo.drop_zero_variance`` those with a signal."""
    return [g for g in groups if has_signal(g)] if cfg.grpo.drop_zero_variance else list(groups)


def grpo_update(trainer, groups, cfg: RunConfig, inputs, ref=None) -> dict[str, float]:
    groups = trained_groups(groups, cfg)
    if not groups:  # every group dropped: no update (every process sees the same groups)
        return {"update_skipped": 1.0}
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
    temp = cfg.rollout.temperature
    batch["old_logprobs"] = trainer.masked_logprobs(batch["input_ids"], batch["loss_mask"], temperature=temp)
    diff = _logprob_diff_max(trainer, batch, results)
    if ref is not None:
        batch["ref_logprobs"] = ref_token_logprobs(ref, batch["input_ids"], temp)
    c = cfg.grpo

    def loss_fn(logprobs, mb):
        return grpo_loss(logprobs, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], num_tokens,
                         clip_eps_low=c.clip_eps_low, clip_eps_high=c.clip_eps_high, kl_coef=c.kl_coef,
                         ref_logprobs=mb.get("ref_logprobs"))

    out = trainer.train_step(batch, loss_fn, temperature=temp)
    out["adv_abs_mean"] = float(adv.abs().mean())
    out["logprob_diff_max"] = diff
    return out


def _logprob_diff_max(trainer, batch, results) -> float:
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


class StreamUpdate:
    """Stream training of one RL step (``stream_train: true``): each finished group of this
    process's rollout replica is trained at once (``Trainer.accumulate``), rows of a group
    together; the optimizer step comes in :meth:`finish`, when every group is in.

    Normalisation by the step's final count: a group's loss is its masked token sum (normaliser
    1), and :meth:`finish` multiplies the summed gradients by 1 / (response tokens of the whole
    step, over every data-parallel rank), which is known only then. One update per step means
    the old policy is the current one: the old logprobs are this very forward's, detached (the
    non-streamed path computes them in a separate forward: equal up to rounding).

    Each trainer replica trains the groups its own rollout group generated, so the trainer's TP
    group must be a rollout group: trainer PP = EP = 1 and rollout TP = trainer TP (checked at
    start). The TP ranks of a rollout group make identical decisions, so they finish each group at
    the same engine iteration and run its forward/backward together.
    """

    def __init__(self, trainer, cfg: RunConfig, inputs, ref=None, defer: bool = False):
        self.trainer, self.cfg, self.inputs, self.ref = trainer, cfg, inputs, ref
        self.defer = defer
        self.tokens = 0.0
        self.groups = 0
        self.seconds = 0.0  # spent training inside rollout
        self.queue: list = []

    def begin(self) -> None:
        self.trainer.begin_step()
        self.tokens, self.groups, self.seconds = 0.0, 0, 0.0
        self.queue = []

    def add_group(self, group) -> None:
        """A group finished: trained now, or with ``defer`` queued for :meth:`drain` (the
        replica's bubble time: its own generation is not slowed by it). Either way the groups are
        trained in the order they finished, so the summed gradients are the same bits."""
        if self.defer:
            self.queue.append(group)
        else:
            self._train(group)

    def drain(self, should_stop=None) -> int:
        """Train queued groups, in order, until the queue is empty or ``should_stop()`` (asked
        before each group); returns how many were trained."""
        n = 0
        while self.queue and not (should_stop is not None and should_stop()):
            self._train(self.queue.pop(0))
            n += 1
        return n

    def _train(self, group) -> None:
        if self.cfg.grpo.drop_zero_variance and not has_signal(group):
            return
        t0 = time.perf_counter()
        g = self.cfg.rollout.group_size
        adv = group_advantages(torch.tensor(group.rewards, dtype=torch.float32), g,
                               normalize_std=self.cfg.grpo.normalize_std)
        batch = make_batch([r.prompt_ids for r in group.results], [r.tokens for r in group.results],
                           self.inputs.tokenizer.pad_id)
        batch["advantages"] = adv
        if self.ref is not None:
            batch["ref_logprobs"] = ref_token_logprobs(self.ref, batch["input_ids"], self.cfg.rollout.temperature)
        c = self.cfg.grpo

        def loss_fn(logprobs, mb):
            return grpo_loss(logprobs, logprobs.detach(), mb["advantages"], mb["loss_mask"], 1.0,
                             clip_eps_low=c.clip_eps_low, clip_eps_high=c.clip_eps_high, kl_coef=c.kl_coef,
                             ref_logprobs=mb.get("ref_logprobs"))

        self.trainer.accumulate(batch, loss_fn, temperature=self.cfg.rollout.temperature)
        self.tokens += float(batch["loss_mask"].sum())
        self.groups += 1
        self.seconds += time.perf_counter() - t0

    def finish(self, groups) -> dict[str, float]:
        """The optimizer step, once ``groups`` (every replica's groups of the step) are all in."""
        self.drain()  # what the bubble did not get to
        dims = self.trainer.dims
        count = torch.tensor([self.tokens, float(self.groups)], dtype=torch.float64, device=dims.device)
        if dims.dp > 1:
            dist.all_reduce(count, group=dims.dp_group)
        tokens, n_groups = count.tolist()
        want = len(trained_groups(groups, self.cfg))
        if n_groups != want:
            raise RuntimeError(f"stream training trained {int(n_groups)} groups over the data-parallel ranks but "
                               f"the step has {want} to train: every group must be trained exactly once")
        if want == 0:  # every group dropped: no update
            return {"update_skipped": 1.0, "stream_train_time_s": self.seconds}
        out = self.trainer.finish_step(scale=1.0 / max(tokens, 1.0))
        trained = trained_groups(groups, self.cfg)
        rewards = torch.tensor([x for grp in trained for x in grp.rewards], dtype=torch.float32)
        adv = group_advantages(rewards, self.cfg.rollout.group_size, normalize_std=self.cfg.grpo.normalize_std)
        out["adv_abs_mean"] = float(adv.abs().mean())
        out["stream_train_time_s"] = self.seconds
        return out
