"""The native rollout engine: continuous batching over a KV cache (slots, or paged:
``EngineConfig.kv_cache``), Gumbel-max sampling, speculative decoding.

One iteration is ``admit() -> schedule() -> run() -> postprocess()`` (docs/design.md §2):
- ``admit`` moves waiting requests into free slots, so a freed slot is refilled at once. The
  prompt minus its last token is cached by one forward per distinct prompt (the G samples of a
  GRPO group share it) and copied into the slots of the prompt's other samples.
- ``schedule`` (host only) picks every running request for one decode step: its last token (the
  prompt's last for a new request) plus, with a speculator, draft tokens (megarl/spec).
- ``run`` does the device work: one forward through the cache over the rows' tokens, packed
  without padding, then one verify call: the target's own sample at the last pending position
  and at every draft position, and the length of the accepted draft prefix.
- ``postprocess`` (host) appends the accepted drafts plus the target's token, rolls the cache back
  past rejected drafts, retires finished requests and frees their slots.

Every token is a function of (weights, prompt, seed, step, uid, sample_idx, position) only (docs/design.md
§1): batches never change a response (up to the float reductions' batch-invariance; exact in float64).

Tensor parallelism: given a ``TPCausalLM`` (megarl/engine/tp_model.py), every rank of the rollout
group runs its own ``Engine`` over the same requests. The model's collectives hand every rank
the same full logits, so the host-side decisions (tokens, stops, drafts, slots) are identical on
all ranks and each rank's forwards meet the others' collectives in the same order. Only the KV
cache differs: it holds the rank's own KV heads.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from megarl.engine.kv_cache import CacheAttention, KVCache
from megarl.engine.paged_kv_cache import PagedKVCache
from megarl.engine.requests import EngineConfig, Request, Result
from megarl.engine.sampler import SamplingParams, token_stats
from megarl.engine.speculation import DraftTarget, Speculation
from megarl.engine.static_step import StaticStep
from megarl.engine.tp_model import TPCausalLM, tp_shard
from megarl.models import packed_linear
from megarl.models.llama import CausalLM
from megarl.engine.verify import sample_rows, verify
from megarl.utils.cpu_alloc import keep_freed_memory

# Uncoupled control drafts (``pregenerate(coupled=False)``) use a step key no real step reaches.
_UNCOUPLED_STEP_BIT = 1 << 31


class _Seq:
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


@dataclass
class _Batch:
    """What ``schedule`` picked for one forward: the rows, their pending token (the last sampled
    token, or the prompt's last for a new request) and their draft tokens."""

    seqs: list[_Seq]
    pending: list[list[int]]
    drafts: list[list[int]]


class _Verified(NamedTuple):
    """What ``run`` returns: per row, the tokens the target sampled (accepted drafts, then its
    own token) with their logprobs and entropies, and how many drafts were accepted."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    entropies: list[list[float]]
    n_accept: list[int]


class Engine:
    """Generates responses for a list of requests with continuous batching, and with
    speculative decoding when given a ``Speculator`` (megarl/spec). ``model`` is a ``CausalLM``
    or, in a rollout group with TP > 1, this rank's ``TPCausalLM``."""

    def __init__(self, model: CausalLM, cfg: EngineConfig, seed: int, spec: Speculation | None = None):
        self.cfg, self.seed, self.spec = cfg, seed, spec
        self.dtype, self.device = cfg.torch_dtype, torch.device(cfg.device)
        if self.device.type == "cpu":
            # fp32 denormal attention probabilities take x86's slow path (a tiny-model rollout: 17 s
            # vs 0.4 s); flushing them to zero (as GPUs do) is process-wide, harmless for training.
            torch.set_flush_denormal(True)
            keep_freed_memory()  # large [rows, vocab] temporaries reuse the heap (megarl/utils/cpu_alloc.py)
        self.sample_dtype = torch.promote_types(self.dtype, torch.float32)  # bf16 + noise would tie
        # In place; q/k/v and gate/up then run as one matmul each (llama.fuse_linears).
        self.model = model.to(device=self.device, dtype=self.dtype).eval().fuse_projections()
        a = model.args
        self.vocab_size = a.vocab_size
        tp = isinstance(model, TPCausalLM)
        self.tp_size, self.tp_rank = (model.tp_size, model.tp_rank) if tp else (1, 0)
        n_kv = model.local_args.num_key_value_heads if tp else a.num_key_value_heads  # this rank's KV heads
        if cfg.kv_cache == "paged":
            self.cache = PagedKVCache(a.num_hidden_layers, cfg.max_batch_size, cfg.max_seq_len, n_kv, a.head_dim,
                                      self.dtype, self.device, cfg.kv_block_size, cfg.num_kv_blocks, a.windows)
        else:
            self.cache = KVCache(a.num_hidden_layers, cfg.max_batch_size, cfg.max_seq_len,
                                 n_kv, a.head_dim, self.dtype, self.device, a.windows)
        # CPU fp32/bf16: oneDNN linears (models/packed_linear.py); with them or bf16, ``_forward``'s twin row.
        self.packs = (packed_linear.PackedLinears(self.model) if cfg.cpu_packed_linears
                      and packed_linear.supports(self.dtype, self.device) else None)
        self.pad_single_row = (self.device.type == "cpu" and isinstance(self.cache, KVCache)
                               and (self.packs is not None or self.dtype == torch.bfloat16))
        # A learned drafter (spec.drafter) reads the target's hidden states: set per generate call,
        # False keeps the forward path exactly the plain one.
        self._hidden_hook = False
        self.static = StaticStep(self) if cfg.static_shapes else None
        self.reset_stats()

    def draft_target(self) -> DraftTarget:
        """What a learned drafter needs of this engine's target (megarl/engine/speculation.py)."""
        return DraftTarget.of(self)

    def reset_stats(self) -> None:
        """``forwards``: batched forward calls; ``target_forwards``: forwards summed over requests
        (each produced >= 1 token); ``tokens``: tokens produced."""
        self.stats = {"forwards": 0, "tokens": 0, "target_forwards": 0}
        if self.spec is not None:
            self.spec.reset_stats()

    def after_sync(self, sync: Callable[[], dict]) -> Callable[[], dict]:
        """The weight sync as it is: it writes into this engine's parameters in place, which the
        next ``generate`` reads (its packed linears refreshed there). The rollout backend interface
        (megarl/rollout/backend.py); the vLLM backend adds its load here."""
        return sync

    def close(self) -> None:
        """Nothing to release beyond memory: no process, thread or process group of its own
        (the rollout backend interface, megarl/rollout/backend.py)."""

    @torch.no_grad()
    def load_weights(self, named: dict[str, torch.Tensor], sliced: bool = False) -> None:
        """Copy HF-named tensors into the model in place, cast to the engine dtype. All names
        and shapes are checked before anything is copied. A ``lm_head.weight`` sent for a
        tied-embedding model is ignored (HF checkpoints sometimes carry it).

        With TP > 1, ``named`` holds the full tensors and each rank copies its own slice, or,
        with ``sliced=True``, only this rank's pieces as ``tp_model.tp_slice`` cuts them (what a
        per-rank weight sync sends)."""
        if self.tp_size > 1 and not sliced:
            named = tp_shard(named, self.tp_rank, self.tp_size)
        params = self.model.state_dict()
        names = set(named)
        if self.model.args.tie_word_embeddings:
            names.discard("lm_head.weight")
        missing, unexpected = sorted(set(params) - names), sorted(names - set(params))
        bad_shape = [f"{k}: got {tuple(named[k].shape)}, expected {tuple(params[k].shape)}"
                     for k in sorted(names & set(params)) if named[k].shape != params[k].shape]
        if missing or unexpected or bad_shape:
            raise ValueError(f"load_weights: missing={missing} unexpected={unexpected} mis-shaped={bad_shape}")
        for k in names:
            params[k].copy_(named[k].to(device=self.device, dtype=self.dtype))

    # ------------------------------------------------------------------ generation
    def generate(self, requests: list[Request], step: int, progress: bool = False,
                 purpose: str = "rollout", on_finish: Callable[[int, Result], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> list[Result]:
        """Responses for ``requests`` (same order), sampled with RL step ``step``'s noise.

        ``purpose`` tells the draft sources what the responses are: ``rollout`` (this step's
        samples: they become history) or ``bubble`` (see ``pregenerate``). ``on_finish(i, result)``
        is called for request ``i`` as soon as it finishes, between engine iterations and outside
        inference mode (stream training runs its forward/backward there).

        ``should_stop()`` is asked before every engine iteration (preemptible bubble work); once
        it says yes, the unfinished requests are returned as they are, with ``finish_reason``
        ``"aborted"`` (their tokens are still exact samples: a prefix of the full response)."""
        self._validate(requests)
        if self.packs is not None:  # drop packed weights that in-place writes made stale, once per call
            self.packs.refresh()
        if self.tp_size > 1:
            self._check_group_agrees(requests, step)
        seqs = [_Seq(i, r) for i, r in enumerate(requests)]
        waiting, running = deque(seqs), []
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(seqs), desc=f"rollout step {step}", unit="req")
        self._hidden_hook = self.spec is not None and self.spec.needs_hidden
        if self._hidden_hook:
            self.spec.attach(self.draft_target())
        if self.spec is not None:
            self.spec.begin(requests, step)
        with torch.inference_mode():
            while waiting or running:
                if should_stop is not None and should_stop():
                    self._abort(waiting, running)
                    break
                self.admit(waiting, running)
                batch = self.schedule(running)
                out = self.run(batch, step)
                n_done = self.postprocess(batch, out, running)
                if self._hidden_hook:
                    self.spec.step_end()
                if bar is not None:
                    bar.update(n_done)
                if n_done and on_finish is not None:
                    with torch.inference_mode(False):
                        for s in batch.seqs:
                            if s.finish_reason is not None:  # finished now: retired, never seen again
                                on_finish(s.index, self._result(s))
        if bar is not None:
            bar.close()
        results = [self._result(s) for s in seqs]
        if self.spec is not None:
            self.spec.end(results, step, purpose)
        return results

    def pregenerate(self, requests: list[Request], step: int, coupled: bool = True,
                    should_stop: Callable[[], bool] | None = None) -> list[Result]:
        """Bubble work: generate ``requests`` of a FUTURE step ``step`` with the current weights
        and keep the responses as that step's bubble drafts (docs/design.md §1, coupled drafts).
        ``coupled=False`` samples them with unrelated noise instead (a control that measures
        what coupling gains; the drafts stay valid, just less often accepted). Preempted by
        ``should_stop`` (see ``generate``), the partial responses are kept: a prefix of a coupled
        draft is a coupled draft of that prefix's positions."""
        bubble = self.spec.bubble if self.spec is not None else None
        if bubble is None:
            raise ValueError("pregenerate needs a speculator with the 'bubble' source (spec.sources)")
        noise_step = step if coupled else step ^ _UNCOUPLED_STEP_BIT
        results = self.generate(requests, noise_step, purpose="bubble", should_stop=should_stop)
        bubble.merge(step, {(r.uid, r.sample_idx): r.tokens for r in results if r.tokens})
        return results

    def admit(self, waiting: deque, running: list[_Seq]) -> None:
        """Move waiting requests, in order, into free cache rows (lowest first) while the cache
        can hold them (the paged cache: the blocks of their longest possible length), and cache
        their prompts but the last token (which the first decode row feeds): one packed forward
        over the distinct prompts, whose k/v the other samples of the same prompt then share."""
        table = self.cache.table
        by_prompt: dict[tuple[int, ...], list[_Seq]] = {}
        while waiting and table.n_free:
            s = waiting[0]
            prompt = tuple(s.req.prompt_ids)
            # The most positions it caches: prompt + response - 1 (the last token is never fed).
            longest = min(len(prompt) + s.req.params.max_new_tokens, self.cfg.max_seq_len) - 1
            shared = len(prompt) - 1 if prompt in by_prompt else 0
            if not table.can_allocate(longest, shared):
                if not running and not by_prompt:  # an empty cache cannot hold it: it never will
                    raise RuntimeError(table.out_of_blocks(table.blocks_needed(longest), (
                        f"request (uid={s.req.uid}, sample_idx={s.req.sample_idx}) of up to {longest} cached "
                        f"positions, alone in the cache,")))
                break
            waiting.popleft()
            s.slot = table.allocate(longest, shared)
            running.append(s)
            by_prompt.setdefault(prompt, []).append(s)
        fills = [(p[:-1], seqs) for p, seqs in by_prompt.items() if len(p) > 1]
        if not fills:
            return
        hidden = self._forward([seqs[0].slot for _, seqs in fills], [list(p) for p, _ in fills])[None]
        if self._hidden_hook:  # ... and, for a learned drafter, the prompts' hidden states
            self.spec.on_prefill([[s.req for s in seqs] for _, seqs in fills], hidden[0])
        self.stats["forwards"] += 1
        for p, seqs in fills:
            self.cache.share_prefix(seqs[0].slot, [s.slot for s in seqs[1:]], len(p))

    def schedule(self, running: list[_Seq]) -> _Batch:
        """Host only: one decode row per running request, its pending token plus the
        speculator's draft tokens, if any."""
        seqs = list(running)
        pending = [[s.tokens[-1] if s.tokens else s.req.prompt_ids[-1]] for s in seqs]
        if self.spec is None:
            drafts = [[] for _ in seqs]
        else:
            drafts = self.spec.propose([s.req for s in seqs], [s.tokens for s in seqs],
                                       [s.room(self.cfg.max_seq_len) for s in seqs], len(seqs))
        return _Batch(seqs, pending, drafts)

    def run(self, batch: _Batch, step: int) -> _Verified:
        """Device work for one batch: one forward over every row's pending + draft tokens through
        the cache, then the target's own sample at the last pending position and at every draft
        position, compared with the drafts (megarl.engine.verify)."""
        self.stats["forwards"] += 1
        if self.static is not None:  # the same work over fixed shapes (EngineConfig.static_shapes)
            return _Verified(*self.static.run(batch, step))
        inputs = [p + d for p, d in zip(batch.pending, batch.drafts)]
        n_new, dev = [len(x) for x in inputs], self.device
        hidden = self._forward([s.slot for s in batch.seqs], inputs)  # [N, H], packed
        # Verified rows: the last pending token and each draft token, in order, request by request.
        keep, draft_next, n_rows, off = [], [], [], 0
        for n, d in zip(n_new, batch.drafts):
            keep += range(off + n - 1 - len(d), off + n)
            draft_next += d + [-1]
            n_rows.append(len(d) + 1)
            off += n
        h = hidden if len(keep) == off else hidden[torch.tensor(keep, device=dev)]
        logits = self.head_logits(h).to(self.sample_dtype)
        reqs = [s.req for s in batch.seqs]
        per_req = lambda vals, dtype: torch.tensor(vals, dtype=dtype, device=dev)  # noqa: E731
        temp, top_p = per_req([[r.params.temperature, r.params.top_p] for r in reqs], self.sample_dtype).T
        top_k, uid, sample_idx, position0 = per_req(
            [[r.params.top_k, r.uid, r.sample_idx, len(s.tokens)] for r, s in zip(reqs, batch.seqs)], torch.int64).T
        if len(keep) == len(reqs) and dev.type == "cpu" and not self._hidden_hook:  # no drafts: nothing to verify
            tokens = sample_rows(logits, temp, top_k, top_p, uid, sample_idx, position0, self.seed, step)
            n_accept, row_temp = [0] * len(reqs), temp
        else:
            row_start = per_req([0] + list(itertools.accumulate(n_rows)), torch.int64)
            tokens, n_acc = verify(logits, per_req(draft_next, torch.int64), row_start, temp, top_k, top_p,
                                   uid, sample_idx, position0, self.seed, step)
            n_accept, row_temp = n_acc.tolist(), temp.repeat_interleave(per_req(n_rows, torch.int64))
        logprobs, entropies = token_stats(logits, row_temp, tokens)
        out = _Verified([], [], [], n_accept)
        if self._hidden_hook:  # the accepted rows' hidden states, for a learned drafter
            self.spec.on_verify(reqs, h, tokens, n_rows, out.n_accept, [len(s.tokens) for s in batch.seqs])
        tokens, logprobs, entropies = tokens.tolist(), logprobs.tolist(), entropies.tolist()
        for b, lo in enumerate(itertools.accumulate([0] + n_rows[:-1])):
            hi = lo + out.n_accept[b] + 1
            out.tokens.append(tokens[lo:hi])
            out.logprobs.append(logprobs[lo:hi])
            out.entropies.append(entropies[lo:hi])
        return out

    def _forward(self, slots: list[int], inputs: list[list[int]]) -> torch.Tensor:
        """One forward through the cache over ``inputs[i]`` appended to slot ``slots[i]``, packed
        without padding; the final hidden states [N, H]. With ``pad_single_row`` a one-token
        forward carries a twin (same token, slot and position, outputs dropped), so no linear runs
        with one row: on CPU a 1-row linear (torch's bf16 GEMV; packed fp32 with 1536 inputs) can
        differ in the last bit from the same row among 2+ (which agree for every count), so a
        request decoding alone got other logits than in a batch or verify row (docs/benchmarks.md
        "Token identity in bf16"). Cost: a 2-row GEMM on those steps (about a 1-row one, packed)."""
        n_new = [len(x) for x in inputs]
        ids = [t for x in inputs for t in x]
        if self.pad_single_row and len(ids) == 1:
            starts = self.cache.table.reserve(slots, n_new)
            attn = CacheAttention(self.cache, slots * 2, starts * 2, n_new * 2)
            ids, positions = ids * 2, attn.positions
        else:
            attn, positions = self.cache.batch(slots, n_new)
        ids_t = torch.tensor([ids], dtype=torch.int64).to(self.device)
        with self._linears():
            return self.model.hidden_states(ids_t, positions, attn)[0, :sum(n_new)]

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head as the engine runs it: packed linears, a lone row with its twin (``_forward``)."""
        with self._linears():
            if self.pad_single_row and hidden.shape[0] == 1:
                return self.model.logits(hidden.expand(2, -1))[:1]
            return self.model.logits(hidden)

    def _linears(self):  # the context the target's forwards run in: its packed linears, if any
        return self.packs.active() if self.packs is not None else contextlib.nullcontext()

    def postprocess(self, batch: _Batch, out: _Verified, running: list[_Seq]) -> int:
        """Host only: append each row's verified tokens up to a stop condition, roll the cache
        back past rejected drafts, retire finished requests. Returns how many finished."""
        n_done = 0
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
                running.remove(s)
                table.free(s.slot)
                n_done += 1
            else:
                # The cache holds pending + all drafts; keep pending + the accepted drafts (the
                # last produced token is fed, and cached, by the next forward).
                table.truncate(s.slot, table.lengths[s.slot] - (len(draft) - n_acc))
            self.stats["tokens"] += len(new)
        self.stats["target_forwards"] += len(batch.seqs)
        if n_done:
            self._compact(running)
        return n_done

    def _compact(self, running: list[_Seq]) -> None:
        """Fill the slots freed below the highest used one with the requests of the highest
        slots, and keep ``running`` in slot order: the next decode's rows then sit in consecutive
        slots, which attention reads in place instead of gathering (most of a CPU forward's cost
        in the tail of a step, where finished requests leave holes everywhere)."""
        if not self.cache.needs_compaction:  # the paged cache gathers rows through block tables
            return
        table = self.cache.table
        by_slot = {s.slot: s for s in running}
        while 0 <= (lo := table.lowest_free()) < (hi := table.highest_used()):
            self.cache.move(hi, lo)
            by_slot[hi].slot = lo
            by_slot[lo] = by_slot.pop(hi)
        running.sort(key=lambda s: s.slot)

    def _abort(self, waiting: deque, running: list[_Seq]) -> None:
        """Stop now: free the running requests' slots (the cache is left empty) and mark every
        unfinished request aborted."""
        for s in list(running) + list(waiting):
            s.finish_reason = "aborted"
        for s in running:
            self.cache.table.free(s.slot)
        running.clear()
        waiting.clear()

    def _finish_reason(self, s: _Seq, tok: int) -> str | None:
        p = s.req.params
        full = len(s.tokens) >= p.max_new_tokens or len(s.req.prompt_ids) + len(s.tokens) >= self.cfg.max_seq_len
        return "stop" if tok in p.stop_token_ids else "length" if full else None

    # ------------------------------------------------------------------ helpers
    def _validate(self, requests: list[Request]) -> None:
        seen = set()
        for r in requests:
            if not isinstance(r.params, SamplingParams):
                raise ValueError(f"request (uid={r.uid}, sample_idx={r.sample_idx}): params must be SamplingParams")
            if not 1 <= len(r.prompt_ids) < self.cfg.max_seq_len:
                raise ValueError(f"request (uid={r.uid}, sample_idx={r.sample_idx}): prompt length "
                                 f"{len(r.prompt_ids)} not in [1, max_seq_len - 1 = {self.cfg.max_seq_len - 1}]")
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= self.vocab_size:
                raise ValueError(f"request (uid={r.uid}, sample_idx={r.sample_idx}): prompt token ids "
                                 f"must be in [0, {self.vocab_size})")
            # Same (uid, sample_idx) means the same noise, hence the same response: a caller bug.
            if (r.uid, r.sample_idx) in seen:
                raise ValueError(f"duplicate request key (uid={r.uid}, sample_idx={r.sample_idx})")
            seen.add((r.uid, r.sample_idx))

    def _check_group_agrees(self, requests: list[Request], step: int) -> None:
        """TP ranks must generate the same requests with the same seed and step: otherwise their
        forwards pair up wrongly in the collectives (a hang or garbage). One tiny all-gather per
        call turns that caller bug into an error on every rank."""
        key = repr((self.seed, step, [(r.uid, r.sample_idx, r.prompt_ids, r.params) for r in requests]))
        mine = torch.tensor([int.from_bytes(hashlib.sha256(key.encode()).digest()[:7], "little")],
                            dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.tp_size)]
        dist.all_gather(every, mine, group=self.model.group)
        if any(int(t) != int(mine) for t in every):
            raise ValueError(f"generate: the ranks of the rollout TP group were given different requests, seeds "
                             f"or steps (digests {[int(t) for t in every]}); every rank must pass the same ones")

    @staticmethod
    def _result(s: _Seq) -> Result:
        return Result(s.req.uid, s.req.sample_idx, list(s.req.prompt_ids), s.tokens, s.logprobs,
                      s.entropies, s.finish_reason, s.n_forwards)
