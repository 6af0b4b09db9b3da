"""Stream training (``stream_train: true``): a step's groups trained while its rollout still runs.

Each GRPO group is trained (forward and backward, gradients accumulated) as soon as its last
sample finishes and is scored; the optimizer step comes once every group of the step is in, with
the loss normalised by the step's final token count, so the update equals the one taken after
the rollout (megarl/stages/update.py; docs/design.md: exactness). Rows, advantages and loss come
from the same builder (megarl/rl/grpo.py).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megarl.parallel.collectives import group_device
from megarl.rl.grpo import UpdateSpec, grpo_batch, grpo_loss_fn, has_signal, trained_groups
from megarl.trainer.logprobs import ref_token_logprobs


class StreamUpdate:
    """Stream training of one RL step (``stream_train: true``): each finished group of this
    process's rollout replica is trained at once (``Trainer.accumulate``), rows of a group
    together; the optimizer step comes in :meth:`finish`, when every group is in.

    Normalisation by the step's final count: a group's loss is its masked token sum (normaliser
    1), and :meth:`finish` multiplies the summed gradients by 1 / (response tokens of the whole
    step, over every data-parallel rank), which is known only then. One update per step means
    the old policy is the current one: the old logprobs are this very forward's, detached, as in
    the non-streamed update (megarl/stages/update.py); the on-policy check ``logprob_diff_max``
    comes from the same forward (max over the step's groups and the data-parallel ranks).

    Each trainer replica trains the groups its own rollout group generated, so the trainer's TP
    group must be a rollout group: trainer PP = EP = 1 and rollout TP = trainer TP (checked at
    start). The TP ranks of a rollout group make identical decisions, so they finish each group at
    the same engine iteration and run its forward/backward together.
    """

    def __init__(self, trainer, spec: UpdateSpec, ref=None, defer: bool = False):
        self.trainer, self.spec, self.grpo, self.ref = trainer, spec, spec.grpo, ref
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
        if self.grpo.drop_zero_variance and not has_signal(group):
            return
        t0 = time.perf_counter()
        s = self.spec
        batch = grpo_batch([group], s.group_size, s.pad_id, self.grpo.normalize_std, s.temperature)
        if self.ref is not None:
            batch["ref_logprobs"] = ref_token_logprobs(self.ref, batch["input_ids"], s.temperature)
        # normaliser 1: finish() scales by the step's token count once it is known
        self.trainer.accumulate(batch, grpo_loss_fn(self.grpo, 1.0, old=None), temperature=s.temperature)
        self.tokens += float(batch["loss_mask"].sum())
        self.groups += 1
        self.seconds += time.perf_counter() - t0

    def finish(self, groups) -> dict[str, float]:
        """The optimizer step, once ``groups`` (every replica's groups of the step) are all in."""
        self.drain()  # what the bubble did not get to
        dims = self.trainer.dims
        count = torch.tensor([self.tokens, float(self.groups)], dtype=torch.float64)
        if dims.dp > 1:
            count = count.to(group_device(dims.dp_group))
            dist.all_reduce(count, group=dims.dp_group)
        tokens, n_groups = count.tolist()
        trained = trained_groups(groups, self.grpo.drop_zero_variance)
        want = len(trained)
        if n_groups != want:
            raise RuntimeError(f"stream training trained {int(n_groups)} groups over the data-parallel ranks but "
                               f"the step has {want} to train: every group must be trained exactly once")
        if want == 0:  # every group dropped: no update
            return {"update_skipped": 1.0, "stream_train_time_s": self.seconds}
        out = self.trainer.finish_step(scale=1.0 / max(tokens, 1.0))
        s = self.spec
        adv = grpo_batch(trained, s.group_size, s.pad_id, self.grpo.normalize_std, s.temperature)["advantages"]
        out["adv_abs_mean"] = float(adv.abs().mean())
        out["stream_train_time_s"] = self.seconds
        return out
