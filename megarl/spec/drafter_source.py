"""The drafter as the engine's draft source: it keeps, per running request, the target's last
hidden states (a ring of ``window`` positions), drafts a chain for a batch of requests at once,
and turns each finished rollout into training data (``HiddenBuffer``).

The engine feeds it only when a drafter is configured (``Speculator.needs_hidden``):
- ``on_prefill``: the hidden states of each new prompt but its last token (the prefill forward
  computes them anyway), as pairs ``(f_i, prompt[i+1])``;
- ``on_verify``: after every verify forward, the hidden state of each accepted row and the token
  the target sampled there, ``(f_i, s[i+1])``. Rejected rows are dropped: their hidden states
  were computed on draft tokens that are not in the sequence.
A pair is stored at its "sequence index" q = i + 1 (the index of its token), ring slot q % window.
"""
from __future__ import annotations

import logging

import torch

from megarl.engine.sampling_rows import SamplingRows
from megarl.engine.speculation import DraftTarget
from megarl.spec.config import SpecConfig
from megarl.spec.drafter import Drafter, load_drafter
from megarl.spec.drafter_train import DrafterTrainer, HiddenBuffer

log = logging.getLogger(__name__)


class DrafterSource:
    name = "drafter"

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg.drafter
        self.model: Drafter | None = None
        self.trainer: DrafterTrainer | None = None
        self.target: DraftTarget | None = None
        self.buffer = HiddenBuffer(self.cfg.buffer_tokens)
        self._rows: dict[tuple[int, int], int] = {}
        self._row_cost: float | None = None

    # ------------------------------------------------------------------ set-up
    def attach(self, target: DraftTarget) -> None:
        """Bind to the target it drafts for (its embedding, LM head, seed, dtype, device: the
        engine's ``draft_target()``). The drafter is built (or loaded from ``init_from``) on the
        first attach."""
        if target.tp_size > 1:
            raise ValueError("spec.drafter.enabled with rollout TP > 1 is not supported yet "
                             "(the drafter reads the full embedding and LM head); use parallel.rollout_tp=1")
        self.target = target
        if self.model is None:
            c = self.cfg
            if c.init_from:
                model = load_drafter(c.init_from, target.args, target.dtype)
            else:
                with torch.random.fork_rng(devices=[]):  # a fixed init that leaves the global RNG alone
                    torch.manual_seed(c.seed)
                    model = Drafter(target.args, c.window)
            self.model = model.to(device=target.device, dtype=target.dtype)
            self.trainer = DrafterTrainer(self.model, self.embed_weight, self.head_weight, c, self.buffer)

    @property
    def row_cost(self) -> float:
        """Cost of one drafter row relative to one target row, by the weights each reads per
        token (matmul work; attention over the context is left out): the drafter's own layers
        plus the shared LM head, against the target's layers plus its LM head."""
        if self._row_cost is None:
            own = sum(p.numel() for p in self.model.parameters())
            self._row_cost = (own + self.head_weight().numel()) / self.target.matmul_params
        return self._row_cost

    def embed_weight(self) -> torch.Tensor:
        return self.target.embed_weight()

    def head_weight(self) -> torch.Tensor:
        return self.target.head_weight()

    # ------------------------------------------------------------------ one generate call
    def begin(self, requests, step: int) -> None:
        e, w = self.target, self.model.window
        n, h = len(requests), e.args.hidden_size
        self.step = step
        self._rows = {(r.uid, r.sample_idx): i for i, r in enumerate(requests)}
        self._plen = [len(r.prompt_ids) for r in requests]
        self._feat = torch.zeros(n, w, h, dtype=e.dtype, device=e.device)
        self._tok = torch.zeros(n, w, dtype=torch.int64, device=e.device)
        self._q = torch.full((n, w), -1, dtype=torch.int64, device=e.device)
        self._chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def _write(self, rows: list[int], qs: list[int], toks: torch.Tensor, feats: torch.Tensor) -> None:
        dev = self._feat.device
        r = torch.tensor(rows, dtype=torch.int64, device=dev)
        q = torch.tensor(qs, dtype=torch.int64, device=dev)
        slot = q % self.model.window
        self._feat[r, slot] = feats.to(self._feat.dtype)
        self._tok[r, slot] = toks
        self._q[r, slot] = q
        self._chunks.append((r, q, toks, feats))

    def on_prefill(self, groups: list[list], hidden: torch.Tensor) -> None:
        """``hidden`` [N, H]: the packed hidden states of each group's prompt but its last token,
        group after group (the requests of a group share the prompt)."""
        w, rows, qs, sel, toks, off = self.model.window, [], [], [], [], 0
        for reqs in groups:
            p = reqs[0].prompt_ids
            n = len(p) - 1
            m = min(w, n)
            for req in reqs:
                rows += [self._rows[(req.uid, req.sample_idx)]] * m
                qs += range(n - m + 1, n + 1)
                sel += range(off + n - m, off + n)
                toks += p[n - m + 1:n + 1]
            off += n
        if rows:
            idx = torch.tensor(sel, device=hidden.device)
            self._write(rows, qs, torch.tensor(toks, dtype=torch.int64, device=hidden.device), hidden[idx])

    def on_verify(self, reqs, hidden: torch.Tensor, tokens: torch.Tensor, n_rows: list[int],
                  n_accept: list[int], n_before: list[int]) -> None:
        """``hidden`` [N, H] / ``tokens`` [N]: every verified row's hidden state and target token,
        request after request (``n_rows`` each); rows 0..n_accept of a request are accepted."""
        rows, qs, sel, off = [], [], [], 0
        for req, nr, na, nb in zip(reqs, n_rows, n_accept, n_before):
            row = self._rows[(req.uid, req.sample_idx)]
            q0 = self._plen[row] + nb
            rows += [row] * (na + 1)
            qs += range(q0, q0 + na + 1)
            sel += range(off, off + na + 1)
            off += nr
        idx = torch.tensor(sel, device=hidden.device)
        self._write(rows, qs, tokens[idx], hidden[idx])

    def draft(self, reqs, tokens: list[list[int]], k: int) -> list[list[int]]:
        """``k`` draft tokens for each request (its response so far: ``tokens``), sampled with
        the request's own noise at their positions."""
        e, w = self.target, self.model.window
        dev = e.device
        rows = torch.tensor([self._rows[(r.uid, r.sample_idx)] for r in reqs], dtype=torch.int64, device=dev)
        seq_len = torch.tensor([len(r.prompt_ids) + len(t) for r, t in zip(reqs, tokens)], dtype=torch.int64,
                               device=dev)
        qs = seq_len[:, None] - w + torch.arange(w, device=dev)[None]  # the window's sequence indices
        slot = qs % w
        valid = (qs >= 1) & (self._q[rows[:, None], slot] == qs)
        sampling = SamplingRows.of(reqs, [len(t) for t in tokens], e.seed, self.step, e.sample_dtype, dev)
        out = self.model.draft(self._feat[rows[:, None], slot], self._tok[rows[:, None], slot], valid, k,
                               self.embed_weight(), self.target.logits, sampling)
        return out.tolist()

    def end(self, results, step: int, purpose: str) -> None:
        """Rollout responses become training records: per request its pairs from the prompt's
        tail to its last token, oldest records leaving the buffer first."""
        chunks, self._chunks = self._chunks, []
        if purpose != "rollout" or not chunks:
            return
        with torch.inference_mode(False), torch.no_grad():
            r = torch.cat([c[0] for c in chunks])
            q = torch.cat([c[1] for c in chunks])
            t = torch.cat([c[2] for c in chunks])
            f = torch.cat([c[3] for c in chunks])
            order = torch.argsort(r * (1 << 32) + q)
            r, q, t, f = r[order], q[order], t[order], f[order].clone()
            last = torch.tensor([self._plen[i] + len(res.tokens) - 1 for i, res in enumerate(results)],
                                dtype=torch.int64, device=r.device)
            keep = q <= last[r]  # pairs past a stop token (accepted with it in one verify) are not the response's
            r, q, t, f = r[keep], q[keep], t[keep], f[keep]
            ids, counts = torch.unique_consecutive(r, return_counts=True)
            start = 0
            for i, n in zip(ids.tolist(), counts.tolist()):
                qs = q[start:start + n]
                resp = int((qs < self._plen[i]).sum())  # pairs before the first response token
                self.buffer.add(f[start:start + n], t[start:start + n], resp)
                start += n
