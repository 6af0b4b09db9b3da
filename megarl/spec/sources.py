"""Draft sources: where the tokens that the target model verifies come from.

Every source answers the same question for a running request: "given the prompt and the tokens
generated so far, what are the next (up to) k tokens likely to be?". Drafts never change the
output (verification accepts only what the target samples itself, docs/design.md §1); a better source
only saves more target forwards.

- ``history`` (RhymeRL): responses to the same prompt from earlier epochs, in a suffix index per
  prompt. Their noise was another step's, so a drafted token is accepted with probability about
  p(token): the index drafts the most frequent continuation, the best uncoupled guess.
- ``group`` (Seer): the partial responses of the other samples of the same GRPO group, indexed as
  they grow (same prompt, same weights, other noise).
- ``bubble`` (BubbleSpec): responses pre-generated for THIS step by the previous weights with
  THIS step's noise. For request (uid, i) the draft is the pre-generated response of the same
  (uid, i) at the same positions: same noise at every position, so it is accepted wherever the
  one-step-older policy picks the same token, which is nearly everywhere (coupled drafts). Once a
  request has diverged from it, the source falls back to a suffix match over the group's
  pre-generated responses (uncoupled).
- ``prompt``: n-grams of the prompt itself (prompt-lookup decoding).

Suffix indexes hold ``prompt[-prompt_tail:] + response`` so the first response tokens can be
drafted from the end of the prompt; a query is the tail of ``prompt + tokens``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from megarl.spec.config import SpecConfig
from megarl.spec.suffix_index import make_suffix_index


@dataclass
class Proposal:
    """A chain of draft tokens and how it was found."""

    tokens: list[int]
    source: str
    match_len: int
    """Length of the suffix match behind the draft (large for a position-aligned bubble draft)."""
    coupled: bool = False
    """Drafted with the request's own noise (bubble, position-aligned)."""


class DraftSource(ABC):
    """Interface of a draft source. A source sees requests through ``req`` (uid, sample_idx,
    prompt_ids) and the list of tokens generated so far."""

    name = ""

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg

    def begin(self, requests, step: int) -> None:
        """A generate call for ``requests`` at RL step ``step`` starts."""

    @abstractmethod
    def propose(self, req, tokens: list[int], k: int) -> Proposal | None:
        """Up to ``k`` draft tokens to follow ``tokens`` in ``req``'s response, or None."""

    def observe(self, req, new_tokens: list[int]) -> None:
        """``new_tokens`` were appended to ``req``'s response."""

    def end(self, results, step: int, purpose: str) -> None:
        """The generate call ended with ``results`` (``purpose``: rollout or bubble)."""

    # helpers shared by the suffix-index sources
    def _index(self):
        return make_suffix_index(self.cfg.suffix_max_depth, self.cfg.suffix_backend)

    def _tail(self, prompt: list[int]) -> list[int]:
        return list(prompt[len(prompt) - self.cfg.prompt_tail:]) if self.cfg.prompt_tail else []

    def _lookup(self, index, req, tokens: list[int], k: int) -> Proposal | None:
        c = self.cfg
        context = (list(req.prompt_ids[-c.max_match:]) + tokens)[-c.max_match:]
        draft, m = index.draft(context, k, max_match=c.max_match, min_match=c.min_match, min_prob=c.min_prob)
        return Proposal(list(draft), self.name, m) if draft else None


class HistorySource(DraftSource):
    name = "history"

    def __init__(self, cfg: SpecConfig):
        super().__init__(cfg)
        self._epochs: dict[int, list[list[list[int]]]] = {}  # uid -> recent rollouts' responses
        self._indexes: dict[int, object] = {}

    def propose(self, req, tokens, k):
        index = self._indexes.get(req.uid)
        return self._lookup(index, req, tokens, k) if index is not None else None

    def end(self, results, step, purpose):
        if purpose != "rollout":
            return
        by_uid: dict[int, list] = {}
        for r in results:
            by_uid.setdefault(r.uid, []).append(r)
        for uid, rs in by_uid.items():
            kept = self._epochs.setdefault(uid, [])
            kept.append([self._tail(r.prompt_ids) + list(r.tokens) for r in rs])
            del kept[:-self.cfg.history_epochs]
            index = self._index()
            for i, seq in enumerate(s for ep in kept for s in ep):
                index.add(i, seq)
            self._indexes[uid] = index


class GroupSource(DraftSource):
    name = "group"

    def begin(self, requests, step):
        self._groups: dict[int, object] = {}
        for r in requests:
            if r.uid not in self._groups:
                self._groups[r.uid] = self._index()
            self._groups[r.uid].add(r.sample_idx, self._tail(r.prompt_ids))

    def propose(self, req, tokens, k):
        return self._lookup(self._groups[req.uid], req, tokens, k)

    def observe(self, req, new_tokens):
        self._groups[req.uid].add(req.sample_idx, new_tokens)

    def end(self, results, step, purpose):
        self._groups = {}


class PromptSource(DraftSource):
    name = "prompt"

    def begin(self, requests, step):
        self._prompts: dict[int, object] = {}
        for r in requests:
            if r.uid not in self._prompts:
                self._prompts[r.uid] = index = self._index()
                index.add(0, list(r.prompt_ids))

    def propose(self, req, tokens, k):
        return self._lookup(self._prompts[req.uid], req, tokens, k)

    def end(self, results, step, purpose):
        self._prompts = {}


class BubbleSource(DraftSource):
    name = "bubble"

    def __init__(self, cfg: SpecConfig):
        super().__init__(cfg)
        self._store: dict[int, dict[tuple[int, int], list[int]]] = {}  # step -> (uid, i) -> tokens
        self._aligned: dict[tuple[int, int], list[int]] = {}
        self._groups: dict[int, object] = {}

    def store(self, step: int, results) -> None:
        """Keep pre-generated ``results`` as drafts for RL step ``step``."""
        self._store[step] = {(r.uid, r.sample_idx): list(r.tokens) for r in results}

    def drafts(self, step: int) -> dict[tuple[int, int], list[int]]:
        """Step ``step``'s drafts, ``(uid, sample_idx) -> tokens`` (to share with other replicas)."""
        return dict(self._store.get(step, {}))

    def merge(self, step: int, drafts: dict[tuple[int, int], list[int]]) -> None:
        """Add drafts another replica pre-generated for step ``step``: the replica that generates
        a prompt at that step need not be the one that pre-generated it. Of two drafts for one
        request the longer is kept: both are prefixes of the same coupled sample."""
        mine = self._store.setdefault(step, {})
        for key, toks in drafts.items():
            if len(toks) > len(mine.get(key, ())):
                mine[key] = list(toks)

    def has_drafts(self, step: int) -> bool:
        return bool(self._store.get(step))

    def begin(self, requests, step):
        self._aligned = self._store.get(step, {})
        tails = {r.uid: self._tail(r.prompt_ids) for r in requests}
        self._groups = {}
        for (uid, i), toks in sorted(self._aligned.items()):
            if uid in tails:
                if uid not in self._groups:
                    self._groups[uid] = self._index()
                self._groups[uid].add(i, tails[uid] + toks)

    def propose(self, req, tokens, k):
        pre = self._aligned.get((req.uid, req.sample_idx))
        if pre is None:
            return None
        n = len(tokens)
        # Position-aligned while the request agrees with the draft on its last token: the draft's
        # token at position j was chosen with noise (step, uid, i, j), the request's own.
        if n < len(pre) and (n == 0 or tokens[n - 1] == pre[n - 1]):
            return Proposal(pre[n:n + k], self.name, self.cfg.max_match + 1, coupled=True)
        index = self._groups.get(req.uid)
        return self._lookup(index, req, tokens, k) if index is not None else None

    def end(self, results, step, purpose):
        if purpose == "rollout":
            for s in [s for s in self._store if s <= step]:
                del self._store[s]
        self._aligned, self._groups = {}, {}


SOURCE_CLASSES = {c.name: c for c in (BubbleSource, HistorySource, GroupSource, PromptSource)}
