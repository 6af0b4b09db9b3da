"""The speculation policy the engine consults every step: which draft, how long, and whether to
draft at all.

- Sources are combined per request: a coupled (position-aligned bubble) draft wins; otherwise the
  longest suffix match, ties going to the source listed first in ``spec.sources``.
- Draft length adapts per request within [k_min, k_max]: it doubles after a fully accepted
  draft and halves after an early rejection (fewer than half of the drafted tokens accepted).
- Speculation is off in a step with more running requests than ``spec.max_batch``: a large
  batch already keeps the device busy, and verifying K+1 tokens per request costs more than the
  forwards it saves. Below it, ``spec.max_draft_tokens`` caps the draft tokens of one forward,
  so drafts are short while the batch is large and long in the tail of the step.
All of it runs on the host; nothing here can change a sampled token.
"""
from __future__ import annotations

from collections import defaultdict

from megarl.spec.config import SpecConfig
from megarl.spec.sources import SOURCE_CLASSES, BubbleSource, DraftSource, Proposal

STAT_KEYS = ("forwards", "drafted", "accepted", "tokens")


class Speculator:
    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.sources: list[DraftSource] = [SOURCE_CLASSES[name](cfg) for name in cfg.sources]
        self._k: dict[tuple[int, int], int] = {}
        self._pending: dict[tuple[int, int], str] = {}  # request -> source of its draft in flight
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

    # ------------------------------------------------------------------ engine hooks
    def begin(self, requests, step: int) -> None:
        self._k, self._pending = {}, {}
        for s in self.sources:
            s.begin(requests, step)

    def propose(self, reqs, tokens: list[list[int]], room: list[int], n_rows: int) -> list[list[int]]:
        """Draft tokens for each request of a forward with ``n_rows`` requests (``room[b]``: most
        tokens request b can still take after the one its verify forward always produces)."""
        if n_rows > self.cfg.max_batch:
            return [[] for _ in reqs]
        cap = self.cfg.max_draft_tokens // n_rows if self.cfg.max_draft_tokens else self.cfg.k_max
        drafts = []
        for req, toks, r in zip(reqs, tokens, room):
            key = (req.uid, req.sample_idx)
            k = min(self._k.setdefault(key, self.cfg.k_init), r, cap)
            best = self._best(req, toks, k) if k > 0 else None
            if best is None:
                drafts.append([])
                continue
            self._pending[key] = best.source
            drafts.append(best.tokens[:k])
        return drafts

    def feedback(self, req, new_tokens: list[int], n_drafted: int, n_accepted: int) -> None:
        """After a verify forward: ``new_tokens`` were appended to ``req``'s response; the target
        agreed with the first ``n_accepted`` of the ``n_drafted`` draft tokens."""
        key = (req.uid, req.sample_idx)
        if n_drafted:
            st = self.stats[self._pending.pop(key)]
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
        out["drafted_tokens"], out["accepted_tokens"] = tot["drafted"], tot["accepted"]
        return out


def _figures(st: dict[str, int], prefix: str) -> dict[str, float]:
    """Counters plus the mean acceptance length: tokens produced per forward that carried a draft."""
    f = st["forwards"]
    return {**{f"{prefix}{k}": st[k] for k in STAT_KEYS},
            f"{prefix}accept_len_mean": st["tokens"] / f if f else 0.0}
