"""Training the drafter on rollout hidden states, in small preemptible steps (bubble work), and
making the replicas' drafters identical afterwards.

Loss per position, over the response positions of random segments of recent rollouts:
- ``feature_weight`` x smooth L1 between the predicted and the target's next hidden state
  (EAGLE's regression: it keeps the drafter's own features usable as the next chain input);
- ``ce_weight`` x cross-entropy to the target's next-token distribution, as *soft labels*
  ``softmax(head(f_{i+1}))``. Soft rather than the sampled token: a coupled draft is accepted
  when drafter and target pick the same argmax under the same Gumbel noise, which happens most
  often when the two distributions are equal (not when the drafter is sharp on the token that
  happened to be sampled); the full distribution is also a lower-variance target, and costs
  nothing here: it is the frozen head applied to the stored hidden state.
``train_depth`` > 1 unrolls the chain in training (depth d reads depth d-1's predicted features,
teacher-forced tokens: a later draft token only matters if the earlier ones were accepted).

Batches are drawn from a generator seeded by (seed, step count), and steps check
``should_stop`` before each: a preempted training stops within one step.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl.spec.config import DrafterConfig


class HiddenBuffer:
    """Recent responses' (hidden state, next token) pairs, at most ``max_tokens`` pairs in all;
    the oldest responses leave first."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.records: deque[tuple[torch.Tensor, torch.Tensor, int]] = deque()
        self.tokens = 0

    def add(self, feats: torch.Tensor, toks: torch.Tensor, resp_start: int) -> None:
        """One response: ``feats`` [n, H], ``toks`` [n] (``toks[j]`` follows ``feats[j]``); the
        first ``resp_start`` pairs are prompt context (their tokens are never drafted)."""
        if feats.shape[0] < 2 or feats.shape[0] - resp_start < 1:  # no (input, response target) pair
            return
        self.records.append((feats, toks, resp_start))
        self.tokens += feats.shape[0]
        while self.tokens > self.max_tokens and len(self.records) > 1:
            self.tokens -= self.records.popleft()[0].shape[0]

    def __len__(self) -> int:
        return len(self.records)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The records, oldest first, packed into a few tensors (on CPU, in the dtype they were
        kept in: the rollout's): ``feats`` [N, H], ``toks`` [N], and per record its length and
        ``resp_start``. About ``tokens x hidden_size x dtype size`` bytes."""
        recs = list(self.records)
        if not recs:
            return {"feats": torch.zeros(0, 0), "toks": torch.zeros(0, dtype=torch.int64),
                    "lens": torch.zeros(0, dtype=torch.int64), "resp": torch.zeros(0, dtype=torch.int64)}
        return {"feats": torch.cat([r[0] for r in recs]).cpu(), "toks": torch.cat([r[1] for r in recs]).cpu(),
                "lens": torch.tensor([r[0].shape[0] for r in recs], dtype=torch.int64),
                "resp": torch.tensor([r[2] for r in recs], dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor], device=None, dtype=None) -> None:
        """Replace the records with saved ones (on ``device`` in ``dtype``); this buffer's own
        ``max_tokens`` applies (a smaller one drops the oldest, as :meth:`add` does)."""
        self.records.clear()
        self.tokens = 0
        lens = state["lens"].tolist()
        if not lens:
            return
        feats = state["feats"].to(device=device, dtype=dtype)
        toks = state["toks"].to(device=device)
        # one tensor per record, as add() keeps them (a view would pin the whole packed tensor)
        for f, t, r in zip(feats.split(lens), toks.split(lens), state["resp"].tolist()):
            self.add(f.clone(), t.clone(), int(r))


class DrafterTrainer:
    """Adam on the drafter's own weights; the target's embedding and head (``embed_w()``,
    ``head_w()``) stay frozen."""

    def __init__(self, model, embed_w: Callable[[], torch.Tensor], head_w: Callable[[], torch.Tensor],
                 cfg: DrafterConfig, buffer: HiddenBuffer):
        self.model, self.embed_w, self.head_w, self.cfg, self.buffer = model, embed_w, head_w, cfg, buffer
        self.opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        self.steps = 0
        self.last_loss: float | None = None

    def state_dict(self) -> dict:
        """Weights, Adam state and the step count (it seeds the batches: :meth:`batch`); the
        buffer is saved on its own (:meth:`HiddenBuffer.state_dict`)."""
        return {"model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                "opt": self.opt.state_dict(), "steps": self.steps, "last_loss": self.last_loss}

    def load_state_dict(self, state: dict) -> None:
        own = self.model.state_dict()
        saved = state["model"]
        if set(saved) != set(own) or any(saved[k].shape != own[k].shape for k in own):
            raise ValueError("the saved drafter does not fit this run's drafter (another model size?): saved "
                             f"{ {k: tuple(v.shape) for k, v in saved.items()} }, "
                             f"this run's { {k: tuple(v.shape) for k, v in own.items()} }")
        with torch.no_grad():
            for k, v in saved.items():
                own[k].copy_(v)
        self.opt.load_state_dict(state["opt"])  # moves the moments to the parameters' device and dtype
        self.steps, self.last_loss = int(state["steps"]), state["last_loss"]

    def batch(self) -> dict[str, torch.Tensor]:
        """Segments of ``seq_len`` pairs from random records (chosen in proportion to their
        length), right-padded; ``target`` marks the positions whose next pair is a response pair."""
        c, recs = self.cfg, self.buffer.records
        rng = np.random.default_rng([c.seed, self.steps])
        lens = np.array([r[0].shape[0] for r in recs], dtype=np.float64)
        picks = rng.choice(len(recs), size=c.batch_size, p=lens / lens.sum())
        s = c.seq_len
        f0 = recs[0][0]
        feats = torch.zeros(c.batch_size, s, f0.shape[1], dtype=f0.dtype, device=f0.device)
        toks = torch.zeros(c.batch_size, s, dtype=torch.int64, device=f0.device)
        valid = torch.zeros(c.batch_size, s, dtype=torch.bool, device=f0.device)
        target = torch.zeros(c.batch_size, s - 1, dtype=torch.bool, device=f0.device)
        for b, i in enumerate(picks.tolist()):
            f, t, resp = recs[i]
            n = f.shape[0]
            # start anywhere from the window before the response on, so early response positions
            # are trained with the prompt context drafting sees
            lo = max(0, resp - self.model.window)
            hi = max(lo, n - s)
            a = int(rng.integers(lo, hi + 1))
            m = min(s, n - a)
            feats[b, :m], toks[b, :m], valid[b, :m] = f[a:a + m], t[a:a + m], True
            j = torch.arange(1, s, device=f0.device)
            target[b] = (j < m) & (a + j >= resp)  # pair a+j's token is a response token: one a draft guesses
        return {"feats": feats, "toks": toks, "valid": valid, "target": target}

    def loss(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        c, m = self.cfg, b["target"]
        embed_w, head_w = self.embed_w(), self.head_w()
        nxt = b["feats"][:, 1:]
        with torch.no_grad():
            p_target = torch.softmax(F.linear(nxt, head_w).float(), -1)
        feats_in, toks_in, valid_in = b["feats"][:, :-1], b["toks"][:, :-1], b["valid"][:, :-1]
        total, reg_sum, ce_sum = 0.0, 0.0, 0.0
        denom = m.sum().clamp(min=1)
        for d in range(c.train_depth):
            pred = self.model.predict(feats_in, toks_in, embed_w, valid_in)
            reg = (F.smooth_l1_loss(pred, nxt, reduction="none").mean(-1) * m).sum() / denom
            logq = torch.log_softmax(F.linear(pred, head_w).float(), -1)
            ce = (-(p_target * logq).sum(-1) * m).sum() / denom
            total = total + (c.feature_weight * reg + c.ce_weight * ce) / c.train_depth
            reg_sum, ce_sum = reg_sum + float(reg.detach()) / c.train_depth, ce_sum + float(ce.detach()) / c.train_depth
            # next depth: position j reads the feature predicted for it at position j - 1
            feats_in = torch.cat([feats_in[:, :1], pred[:, :-1]], 1)
        return total, {"reg": reg_sum, "ce": ce_sum}

    def step(self) -> float:
        """One optimizer step on one batch; returns its loss."""
        with torch.inference_mode(False), torch.enable_grad():
            self.model.train()
            loss, _ = self.loss(self.batch())
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.model.eval()
        self.steps += 1
        self.last_loss = float(loss.detach())
        return self.last_loss

    def train(self, should_stop: Callable[[], bool] | None = None, max_steps: int = 0) -> dict[str, float]:
        """Steps until ``should_stop()`` (asked before each) or ``max_steps`` (0 = no cap; then
        ``should_stop`` is required). Returns the steps taken and the last loss."""
        if max_steps == 0 and should_stop is None:
            raise ValueError("DrafterTrainer.train: give should_stop or max_steps > 0")
        n, losses = 0, []
        while len(self.buffer) and (max_steps == 0 or n < max_steps) and not (should_stop and should_stop()):
            losses.append(self.step())
            n += 1
        return {"drafter_train_steps": n, "drafter_loss": float(np.mean(losses)) if losses else float("nan")}


@torch.no_grad()
def average_drafter(model: torch.nn.Module, group) -> None:
    """Make the drafter's weights identical on every rank of ``group`` (the rollout data-parallel
    group): each rank gathers every rank's weights and takes their mean, summed in rank order,
    so every rank computes the same bits. Adam moments stay local (they only shape later steps)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    params = [p for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, flat, group=group)
    mean = every[0].clone()
    for t in every[1:]:
        mean += t
    mean /= len(every)
    off = 0
    for p in params:
        p.copy_(mean[off:off + p.numel()].view_as(p))
        off += p.numel()
