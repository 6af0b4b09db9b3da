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
"""
from __future__ import annotations

import math
from collections import defaultdict

from megarl.spec.config import SpecConfig
from megarl.spec.sources import SOURCE_CLASSES, BubbleSource, DraftSource, Proposal

STAT_KEYS = ("forwards", "drafted", "accepted", "tokens")
# Prior of the per-token acceptance rate, as (accepted, rejected) pseudo-counts: coupled drafts
# are the request's own tokens until the policy moved; suffix-match drafts are guesses.
_PRIOR = {True: (9.0, 1.0), False: (1.0, 1.0)}


class Speculator:
    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.sources: list[DraftSource] = [SOURCE_CLASSES[name](cfg) for name in cfg.sources]
        self._k: dict[tuple[int, int], int] = {}
        self._pending: dict[tuple[int, int], tuple[str, bool]] = {}  # request -> (source, coupled) of its draft in flight
        # Per-token acceptance counts per draft kind (source, coupled): [accepted, rejected].
        self._accept: dict[tuple[str, bool], list[float]] = {}
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
        for counts in self._accept.values():  # older steps' policies count half as much
            counts[0] *= 0.5
            counts[1] *= 0.5
        for s in self.sources:
            s.begin(requests, step)

    def propose(self, reqs, tokens: list[list[int]], room: list[int], n_rows: int) -> list[list[int]]:
        """Draft tokens for each request of a forward with ``n_rows`` requests (``room[b]``: most
        tokens request b can still take after the one its verify forward always produces)."""
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
        pa, pr = _PRIOR[coupled]
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
        return out


def _figures(st: dict[str, int], prefix: str) -> dict[str, float]:
    """Counters plus the mean acceptance length: tokens produced per forward that carried a draft."""
    f = st["forwards"]
    return {**{f"{prefix}{k}": st[k] for k in STAT_KEYS},
            f"{prefix}accept_len_mean": st["tokens"] / f if f else 0.0}
