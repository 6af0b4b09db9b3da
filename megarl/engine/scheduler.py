"""The engine's scheduler: host-side bookkeeping of continuous batching (docs/design.md §2).

It owns the waiting and running queues and decides, between forwards:
- ``admit``: which waiting requests move into free cache rows (in order, lowest row first, while
  the cache can hold them), and which prompt prefixes the runner must cache for them: one per
  distinct prompt (the G samples of a GRPO group share it);
- ``schedule``: one decode row per running request, its pending token (the last sampled token, or
  the prompt's last for a new request) plus, with a speculator, draft tokens (megarl/spec);
- ``postprocess``: what the verified tokens do to each request: appended up to a stop condition,
  the cache rolled back past rejected drafts, finished requests retired and their rows freed, the
  rows left compacted;
- ``abort``: stop now, every unfinished request marked ``aborted``.

No device work happens here (the runner, megarl/engine/runner.py, does it), so every TP rank,
given the same tokens, takes the same decisions.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from megarl.engine.requests import EngineConfig, Request, Result
from megarl.engine.speculation import Speculation


class Seq:
    """Mutable state of one request while it runs."""

    def __init__(self, index: int, req: Request):
        self.index, self.req = index, req
        self.slot = -1
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.entropies: list[float] = []
        self.n_forwards = 0
        self.finish_reason: str | None = None

    def room(self, max_seq_len: int) -> int:
        """Draft tokens this request can still use: a verify forward yields up to len(draft)+1
        tokens, and the response may not pass max_new_tokens or the cache's max_seq_len."""
        n = len(self.tokens)
        return max(0, min(self.req.params.max_new_tokens - n, max_seq_len - len(self.req.prompt_ids) - n) - 1)

    def result(self) -> Result:
        return Result(self.req.uid, self.req.sample_idx, list(self.req.prompt_ids), self.tokens, self.logprobs,
                      self.entropies, self.finish_reason, self.n_forwards, self.req.params.temperature)


@dataclass
class Batch:
    """What ``schedule`` picked for one forward: the rows, their pending token (the last sampled
    token, or the prompt's last for a new request) and their draft tokens."""

    seqs: list[Seq]
    pending: list[list[int]]
    drafts: list[list[int]]


class Verified(NamedTuple):
    """What the runner returns for a batch: per row, the tokens the target sampled (accepted
    drafts, then its own token) with their logprobs and entropies, and how many drafts were
    accepted."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    entropies: list[list[float]]
    n_accept: list[int]


class Prefill(NamedTuple):
    """A prompt prefix to cache (the prompt but its last token, which the first decode row feeds)
    and the admitted requests that share it: the runner caches it in the first one's row and
    copies it into the others'."""

    prefix: list[int]
    seqs: list[Seq]


class Scheduler:
    """Waiting and running requests of one ``generate`` call, over the engine's KV cache table."""

    def __init__(self, cfg: EngineConfig, cache, spec: Speculation | None):
        self.cfg, self.cache, self.spec = cfg, cache, spec
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []

    def add(self, requests: list[Request]) -> list[Seq]:
        """Queue ``requests`` (the queues must be empty: one ``generate`` call at a time)."""
        seqs = [Seq(i, r) for i, r in enumerate(requests)]
        self.waiting, self.running = deque(seqs), []
        return seqs

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def admit(self) -> list[Prefill]:
        """Move waiting requests, in order, into free cache rows (lowest first) while the cache
        can hold them (the paged cache: the blocks of their longest possible length). Returns the
        prompt prefixes the runner must cache, one per distinct prompt."""
        table, waiting = self.cache.table, self.waiting
        by_prompt: dict[tuple[int, ...], list[Seq]] = {}
        while waiting and table.n_free:
            s = waiting[0]
            prompt = tuple(s.req.prompt_ids)
            # The most positions it caches: prompt + response - 1 (the last token is never fed).
            longest = min(len(prompt) + s.req.params.max_new_tokens, self.cfg.max_seq_len) - 1
            shared = len(prompt) - 1 if prompt in by_prompt else 0
            if not table.can_allocate(longest, shared):
                if not self.running and not by_prompt:  # an empty cache cannot hold it: it never will
                    raise RuntimeError(table.out_of_blocks(table.blocks_needed(longest), (
                        f"request (uid={s.req.uid}, sample_idx={s.req.sample_idx}) of up to {longest} cached "
                        f"positions, alone in the cache,")))
                break
            waiting.popleft()
            s.slot = table.allocate(longest, shared)
            self.running.append(s)
            by_prompt.setdefault(prompt, []).append(s)
        return [Prefill(list(p[:-1]), seqs) for p, seqs in by_prompt.items() if len(p) > 1]

    def schedule(self) -> Batch:
        """One decode row per running request, its pending token plus the speculator's draft
        tokens, if any."""
        seqs = list(self.running)
        pending = [[s.tokens[-1] if s.tokens else s.req.prompt_ids[-1]] for s in seqs]
        if self.spec is None:
            drafts = [[] for _ in seqs]
        else:
            drafts = self.spec.propose([s.req for s in seqs], [s.tokens for s in seqs],
                                       [s.room(self.cfg.max_seq_len) for s in seqs], len(seqs))
        return Batch(seqs, pending, drafts)

    def postprocess(self, batch: Batch, out: Verified) -> tuple[list[Seq], int]:
        """Append each row's verified tokens up to a stop condition, roll the cache back past
        rejected drafts, retire finished requests. Returns the requests that finished (in batch
        order) and the number of tokens produced."""
        finished, n_tokens = [], 0
        table = self.cache.table
        for s, draft, toks, lps, ents, n_acc in zip(batch.seqs, batch.drafts, out.tokens, out.logprobs,
                                                    out.entropies, out.n_accept):
            n0 = len(s.tokens)
            for tok, lp, ent in zip(toks, lps, ents):
                s.tokens.append(tok)
                s.logprobs.append(lp)
                s.entropies.append(ent)
                s.finish_reason = self._finish_reason(s, tok)
                if s.finish_reason is not None:
                    break
            s.n_forwards += 1
            new = s.tokens[n0:]
            if self.spec is not None:
                self.spec.feedback(s.req, new, len(draft), n_acc)
            if s.finish_reason is not None:
                self.running.remove(s)
                table.free(s.slot)
                finished.append(s)
            else:
                # The cache holds pending + all drafts; keep pending + the accepted drafts (the
                # last produced token is fed, and cached, by the next forward).
                table.truncate(s.slot, table.lengths[s.slot] - (len(draft) - n_acc))
            n_tokens += len(new)
        if finished:
            self._compact()
        return finished, n_tokens

    def _compact(self) -> None:
        """Fill the slots freed below the highest used one with the requests of the highest
        slots, and keep ``running`` in slot order: the next decode's rows then sit in consecutive
        slots, which attention reads in place instead of gathering (most of a CPU forward's cost
        in the tail of a step, where finished requests leave holes everywhere)."""
        if not self.cache.needs_compaction:  # the paged cache gathers rows through block tables
            return
        table = self.cache.table
        by_slot = {s.slot: s for s in self.running}
        while 0 <= (lo := table.lowest_free()) < (hi := table.highest_used()):
            self.cache.move(hi, lo)
            by_slot[hi].slot = lo
            by_slot[lo] = by_slot.pop(hi)
        self.running.sort(key=lambda s: s.slot)

    def abort(self) -> None:
        """Stop now: free the running requests' slots (the cache is left empty) and mark every
        unfinished request aborted."""
        for s in list(self.running) + list(self.waiting):
            s.finish_reason = "aborted"
        for s in self.running:
            self.cache.table.free(s.slot)
        self.running.clear()
        self.waiting.clear()

    def _finish_reason(self, s: Seq, tok: int) -> str | None:
        p = s.req.params
        full = len(s.tokens) >= p.max_new_tokens or len(s.req.prompt_ids) + len(s.tokens) >= self.cfg.max_seq_len
        return "stop" if tok in p.stop_token_ids else "length" if full else None
