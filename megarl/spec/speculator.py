"""The speculation policy the engine consults every step: which draft, how long, and whether to
draft at all.

- Sources are combined per request: a coupled (position-aligned bubble) draft wins; otherwise the
  longest suffix match, ties going to the source listed first in ``spec.sources``.
- Draft length adapts per request within [k_min, k_max]: it doubles after a fully accepted
  draft and halves after an early rejection (fewer than half of the drafted tokens accepted).
- A cost rule cuts each draft to the tokens that pay for their verify rows
  (``spec.forward_cost_tokens``): with B requests running, an accepted token saves its own row
  and a 1/B share of a forward, so a draft token is worth its row only while the chance that
  the draft is accepted up to it stays above B / (B + forward_cost_tokens). The chance is the
  running per-token acceptance rate of the draft's kind (coupled bubble drafts, or the suffix
  matches of each source). Large batches thus draft only near-certain tokens; the tail of a
  step, where a few long requests run alone and each forward is mostly fixed cost, drafts long.
- Hard limits on top: speculation is off above ``spec.max_batch`` running requests, and
  ``spec.max_draft_tokens`` caps the draft tokens of one forward.
All of it runs on the host; nothing here can change a sampled token.

With a learned drafter (``spec.drafter.enabled``, megarl/spec/drafter.py) proposals go through
``_propose_drafter`` instead: the strategy (fixed, or per batch-size bucket by the bandit of
megarl/spec/bandit.py) says whether sources and/or the drafter propose, and per request the
proposal with the longer expected accepted run wins. The drafter's tokens are coupled samples
(the request's own noise) and are verified like any draft. Its chain length goes through the
cost rule too, with the chain's own cost added (``_chain_len``: K drafter forwards, priced by
the drafter's weights per row relative to the target's), so at large batches it drafts nothing.
Under the bandit strategy an arm's chain length is used as it is (the bandit prices it by
measurement; a model-trimmed arm would be indistinguishable from ``off``).
"""
from __future__ import annotations

import math
import time
from collections import defaultdict

from megarl.spec.config import SpecConfig
from megarl.spec.sources import SOURCE_CLASSES, BubbleSource, DraftSource, Proposal

STAT_KEYS = ("forwards", "drafted", "accepted", "tokens")
# Prior of the per-token acceptance rate, as (accepted, rejected) pseudo-counts: coupled drafts
# are the request's own tokens until the policy moved; suffix-match drafts are guesses.
_PRIOR = {True: (9.0, 1.0), False: (1.0, 1.0)}
# The drafter's prior: coupled, but an untrained drafter agrees with the target only by chance.
_DRAFTER_PRIOR = (1.0, 1.0)
_FIXED_ARM = {"combined": "combined", "sources": "sources"}  # strategy "drafter" -> "drafter<k>"


class Speculator:
    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.sources: list[DraftSource] = [SOURCE_CLASSES[name](cfg) for name in cfg.sources]
        self._k: dict[tuple[int, int], int] = {}
        self._pending: dict[tuple[int, int], tuple[str, bool]] = {}  # request -> (source, coupled) of its draft in flight
        # Per-token acceptance counts per draft kind (source, coupled): [accepted, rejected].
        self._accept: dict[tuple[str, bool], list[float]] = {}
        self.drafter = self.bandit = None
        d = cfg.drafter
        if d.enabled:
            from megarl.spec.bandit import StrategyBandit
            from megarl.spec.drafter_source import DrafterSource

            self.drafter = DrafterSource(cfg)
            if d.strategy == "bandit":
                self.bandit = StrategyBandit(c=d.bandit_c, discount=d.bandit_discount, seed=d.seed)
        self._arm: tuple[str, int] | None = None  # (arm, rows) of the step in flight (bandit reward)
        self._step_tokens, self._t_propose = 0, 0.0
        self.reset_stats()

    def source(self, name: str) -> DraftSource | None:
        return next((s for s in self.sources if s.name == name), None)

    @property
    def bubble(self) -> BubbleSource | None:
        return self.source("bubble")

    def reset_stats(self) -> None:
        """Counters per source: forwards that carried its draft, tokens drafted, drafts accepted,
        tokens those forwards produced (accepted drafts plus the target's own token, unless a stop
        token or a length limit came first)."""
        self.stats: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(STAT_KEYS, 0))
        if self.bandit is not None:
            self.bandit.reset_metrics()

    # ------------------------------------------------------------------ engine hooks
    def begin(self, requests, step: int) -> None:
        self._k, self._pending = {}, {}
        for counts in self._accept.values():  # older steps' policies count half as much
            counts[0] *= 0.5
            counts[1] *= 0.5
        for s in self.sources:
            s.begin(requests, step)
        if self.drafter is not None:
            self.drafter.begin(requests, step)

    def propose(self, reqs, tokens: list[list[int]], room: list[int], n_rows: int) -> list[list[int]]:
        """Draft tokens for each request of a forward with ``n_rows`` requests (``room[b]``: most
        tokens request b can still take after the one its verify forward always produces)."""
        if self.drafter is not None:
            return self._propose_drafter(reqs, tokens, room, n_rows)
        if n_rows > self.cfg.max_batch:
            return [[] for _ in reqs]
        cap = self.cfg.max_draft_tokens // n_rows if self.cfg.max_draft_tokens else self.cfg.k_max
        a = self.cfg.forward_cost_tokens
        log_thr = math.log(n_rows / (n_rows + a)) if a > 0 else None
        drafts = []
        for req, toks, r in zip(reqs, tokens, room):
            key = (req.uid, req.sample_idx)
            k = min(self._k.setdefault(key, self.cfg.k_init), r, cap)
            best = self._best(req, toks, k) if k > 0 else None
            if best is not None and log_thr is not None:
                k = min(k, self._worth(best, log_thr))
            if best is None or k == 0:
                drafts.append([])
                continue
            self._pending[key] = (best.source, best.coupled)
            drafts.append(best.tokens[:k])
        return drafts

    def accept_rate(self, source: str, coupled: bool) -> float:
        """Running per-token acceptance rate of drafts of one kind (prior until measured)."""
        acc, rej = self._accept.get((source, coupled), (0.0, 0.0))
        pa, pr = _DRAFTER_PRIOR if source == "drafter" else _PRIOR[coupled]
        return (acc + pa) / (acc + rej + pa + pr)

    def _worth(self, p: Proposal, log_thr: float) -> int:
        """Draft tokens of ``p`` whose chance of being reached (all before them accepted) is at
        least the threshold: the largest j with rate**j >= thr."""
        rate = self.accept_rate(p.source, p.coupled)
        if rate >= 1.0:
            return len(p.tokens)
        return min(len(p.tokens), int(log_thr / math.log(rate)) if rate > 0 else 0)

    def feedback(self, req, new_tokens: list[int], n_drafted: int, n_accepted: int) -> None:
        """After a verify forward: ``new_tokens`` were appended to ``req``'s response; the target
        agreed with the first ``n_accepted`` of the ``n_drafted`` draft tokens."""
        key = (req.uid, req.sample_idx)
        self._step_tokens += len(new_tokens)
        if n_drafted:
            kind = self._pending.pop(key)
            counts = self._accept.setdefault(kind, [0.0, 0.0])
            counts[0] += n_accepted
            counts[1] += n_accepted < n_drafted
            st = self.stats[kind[0]]
            st["forwards"] += 1
            st["drafted"] += n_drafted
            st["accepted"] += min(n_accepted, len(new_tokens))
            st["tokens"] += len(new_tokens)
            k = self._k[key]
            if n_accepted == n_drafted:
                self._k[key] = min(2 * k, self.cfg.k_max)
            elif 2 * n_accepted < n_drafted:
                self._k[key] = max(k // 2, self.cfg.k_min)
        for s in self.sources:
            s.observe(req, new_tokens)

    def end(self, results, step: int, purpose: str) -> None:
        for s in self.sources:
            s.end(results, step, purpose)
        if self.drafter is not None:
            self.drafter.end(results, step, purpose)

    def share_drafts(self, others: list[list], step: int, group) -> None:
        """After step ``step``'s rollout (rollout data parallelism), what the other replicas made
        becomes drafts here too: ``others``, their samples of the step, as history drafts, and the
        bubble drafts they pre-generated for step + 1, merged into this replica's (a prompt need
        not be generated next step by the replica that pre-generated it). The bubble drafts go
        over the rollout data-parallel ``group`` (a collective, as ``average_drafter``'s: every
        replica has the same sources, so all of them call it or none)."""
        import torch.distributed as dist

        history = self.source("history")
        if history is not None:
            for results in others:
                history.end(results, step, "rollout")
        bubble = self.bubble
        if bubble is None:
            return
        shares = [None] * dist.get_world_size(group)
        dist.all_gather_object(shares, bubble.drafts(step + 1), group=group)
        for r, drafts in enumerate(shares):
            if r != dist.get_rank(group) and drafts:
                bubble.merge(step + 1, drafts)

    # ------------------------------------------------------------------ learned drafter
    @property
    def needs_hidden(self) -> bool:
        """Whether the engine must hand over the target's hidden states (a drafter is configured)."""
        return self.drafter is not None

    def attach(self, target) -> None:
        """The drafter learns what it drafts for (a ``DraftTarget``: megarl/engine/speculation.py)."""
        self.drafter.attach(target)

    def on_prefill(self, groups, hidden) -> None:
        self.drafter.on_prefill(groups, hidden)

    def on_verify(self, reqs, hidden, tokens, n_rows, n_accept, n_before) -> None:
        self.drafter.on_verify(reqs, hidden, tokens, n_rows, n_accept, n_before)

    # The run loop's view of the drafter (megarl/rollout/bubble.py, megarl/sched/policy.py): training
    # it in bubbles or after the rollout, and keeping its weights the same on every rollout replica.
    @property
    def drafter_ready(self) -> bool:
        """A drafter exists and is built (it is, from the engine's first generate call on)."""
        return self.drafter is not None and self.drafter.trainer is not None

    def train_drafter(self, should_stop=None, max_steps: int = 0) -> None:
        """Drafter training steps until ``should_stop()`` or ``max_steps`` (DrafterTrainer.train)."""
        self.drafter.trainer.train(should_stop, max_steps=max_steps)

    def average_drafter(self, group) -> None:
        """The drafter's weights made identical over the rollout data-parallel ``group``."""
        from megarl.spec.drafter_train import average_drafter

        average_drafter(self.drafter.model, group)

    def drafter_figures(self) -> dict[str, float]:
        """Training steps taken so far, the last loss, the hidden states in the training buffer."""
        t = self.drafter.trainer
        return {"drafter_train_steps": t.steps, "drafter_loss": t.last_loss or 0.0,
                "drafter_buffer_tokens": self.drafter.buffer.tokens}

    def step_end(self) -> None:
        """After the engine's postprocess: the step's reward for the bandit (tokens per second
        from proposing to now)."""
        if self.bandit is not None and self._arm is not None:
            arm, n_rows = self._arm
            dt = max(time.perf_counter() - self._t_propose, 1e-9)
            self.bandit.update(n_rows, arm, self._step_tokens / dt)
        self._arm = None

    def _arm_for(self, n_rows: int) -> str:
        d = self.cfg.drafter
        if self.bandit is not None:
            return self.bandit.choose(n_rows)
        return _FIXED_ARM.get(d.strategy, f"drafter{d.k}")

    def _propose_drafter(self, reqs, tokens, room, n_rows) -> list[list[int]]:
        from megarl.spec.bandit import arm_plan

        self._t_propose, self._step_tokens = time.perf_counter(), 0
        arm = self._arm_for(n_rows)
        self._arm = (arm, n_rows)
        use_sources, dk = arm_plan(arm, self.cfg.drafter.k)
        if n_rows > self.cfg.max_batch or (not use_sources and dk == 0):
            return [[] for _ in reqs]
        cap = self.cfg.max_draft_tokens // n_rows if self.cfg.max_draft_tokens else self.cfg.k_max
        a = self.cfg.forward_cost_tokens
        log_thr = math.log(n_rows / (n_rows + a)) if a > 0 else None
        best: list[Proposal | None] = [None] * len(reqs)
        if use_sources:
            for b, (req, toks, r) in enumerate(zip(reqs, tokens, room)):
                k = min(self._k.setdefault((req.uid, req.sample_idx), self.cfg.k_init), r, cap)
                p = self._best(req, toks, k) if k > 0 else None
                if p is not None and log_thr is not None:
                    p.tokens = p.tokens[:self._worth(p, log_thr)]
                best[b] = p if p is not None and p.tokens else None
        dk = min(dk, cap)
        d_rate = self.accept_rate("drafter", True)
        need = [b for b in range(len(reqs)) if room[b] > 0 and not (best[b] is not None and best[b].coupled)]
        # The cost rule, before drafting (same for every row); under the bandit the arm's chain length
        # stands: the bandit measures what a chain costs, and trimmed arms would all look alike.
        if a > 0 and dk > 0 and need and self.bandit is None:
            dk = self._chain_len(dk, len(need), n_rows, d_rate)
        if dk > 0 and need:
            chains = self.drafter.draft([reqs[b] for b in need], [tokens[b] for b in need], dk)
            for b, chain in zip(need, chains):
                mine = Proposal(chain[:min(dk, room[b])], "drafter", 0, coupled=True)
                if best[b] is None or _expected(mine.tokens, d_rate) > _expected(
                        best[b].tokens, self.accept_rate(best[b].source, best[b].coupled)):
                    best[b] = mine
        drafts = []
        for req, p in zip(reqs, best):
            if p is None or not p.tokens:
                drafts.append([])
                continue
            self._pending[(req.uid, req.sample_idx)] = (p.source, p.coupled)
            self._k.setdefault((req.uid, req.sample_idx), self.cfg.k_init)
            drafts.append(p.tokens)
        return drafts

    def _chain_len(self, k_max: int, m: int, n: int, rate: float) -> int:
        """Drafter chain length in [0, k_max] for ``m`` of ``n`` running requests that maximises
        the expected saving net of its cost, in units of one target token row: an accepted token
        saves (a + n) / n (its row and a share of a forward); drafting k tokens costs k verify rows
        per request plus the chain itself, k drafter forwards over the m requests whose first
        step also reads each request's window: f * (k * a + m * (window + k - 1)), with f the
        drafter's cost per row relative to the target's (parameter counts, ``row_cost``). Unlike a
        draft source's lookup, the chain is not free: without its cost here the drafter arms
        draft at every batch size and lose to "off" wherever a forward is not mostly fixed cost."""
        a = self.cfg.forward_cost_tokens
        f, w = self.drafter.row_cost, self.drafter.model.window
        gain = m * (a + n) / n
        best_k, best, expected = 0, 0.0, 0.0
        for k in range(1, k_max + 1):
            expected += rate ** k
            net = gain * expected - (k * m + f * (k * a + m * (w + k - 1)))
            if net > best:
                best_k, best = k, net
        return best_k

    # ------------------------------------------------------------------ helpers
    def _best(self, req, tokens: list[int], k: int) -> Proposal | None:
        best = None
        for s in self.sources:  # listed order = preference among equal matches
            p = s.propose(req, tokens, k)
            if p is None or not p.tokens:
                continue
            if p.coupled:
                return p
            if best is None or p.match_len > best.match_len:
                best = p
        return best

    def metrics(self) -> dict[str, float]:
        """Per-step figures for metrics.jsonl: totals and the split by source."""
        out: dict[str, float] = {}
        tot = dict.fromkeys(STAT_KEYS, 0)
        for name, st in sorted(self.stats.items()):
            for key in STAT_KEYS:
                tot[key] += st[key]
            out.update(_figures(st, f"spec/{name}/"))
        out.update(_figures(tot, "spec/"))
        for (name, coupled), _ in sorted(self._accept.items()):
            out[f"spec/{name}/{'coupled_' if coupled else ''}accept_rate"] = self.accept_rate(name, coupled)
        out["drafted_tokens"], out["accepted_tokens"] = tot["drafted"], tot["accepted"]
        if self.bandit is not None:
            out.update(self.bandit.metrics())
        return out


def _expected(tokens: list[int], rate: float) -> float:
    """Expected accepted tokens of a draft whose tokens are each accepted with ``rate``, in order."""
    return sum(rate ** j for j in range(1, len(tokens) + 1))


def _figures(st: dict[str, int], prefix: str) -> dict[str, float]:
    """Counters plus the mean acceptance length: tokens produced per forward that carried a draft."""
    f = st["forwards"]
    return {**{f"{prefix}{k}": st[k] for k in STAT_KEYS},
            f"{prefix}accept_len_mean": st["tokens"] / f if f else 0.0}
