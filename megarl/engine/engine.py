"""The native rollout engine: continuous batching over a KV cache (slots, or paged:
``EngineConfig.kv_cache``), Gumbel-max sampling, speculative decoding.

``Engine`` is the facade; the work is split as in docs/design.md §2:
- the scheduler (megarl/engine/scheduler.py, host only) owns the waiting and running requests:
  admission into free cache rows, the rows of the next forward (pending token plus drafts), what
  the verified tokens do to each request (stops, cache roll-back, retirement, compaction), abort;
- the runner (megarl/engine/runner.py, device work) owns the model and its KV cache: the prompts'
  prefill, one forward over the rows packed without padding, the LM head and one verify call (the
  target's own sample at the last pending position and at every draft position, and the length
  of the accepted draft prefix), and weight loading.

One iteration of ``generate`` is ``admit -> schedule -> run -> postprocess``. Every token is a
function of (weights, prompt, seed, step, uid, sample_idx, position) only (docs/design.md §1):
batches never change a response (up to the float reductions' batch-invariance; exact in float64).

Tensor parallelism: given a ``TPCausalLM`` (megarl/engine/tp_model.py), every rank of the rollout
group runs its own ``Engine`` over the same requests. The model's collectives hand every rank
the same full logits, so the host-side decisions (tokens, stops, drafts, slots) are identical on
all ranks and each rank's forwards meet the others' collectives in the same order. Only the KV
cache differs: it holds the rank's own KV heads.
"""
from __future__ import annotations

import hashlib
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

from megarl.engine.requests import EngineConfig, Request, Result
from megarl.engine.runner import ModelRunner
from megarl.engine.sampler import SamplingParams
from megarl.engine.scheduler import Batch as _Batch, Scheduler, Seq as _Seq, Verified as _Verified
from megarl.engine.speculation import DraftTarget, Speculation
from megarl.models.llama import CausalLM

__all__ = ["Engine", "_Batch", "_Seq", "_Verified"]  # the underscored names: benchmarks and tests drive steps

# Uncoupled control drafts (``pregenerate(coupled=False)``) use a step key no real step reaches.
_UNCOUPLED_STEP_BIT = 1 << 31


class Engine:
    """Generates responses for a list of requests with continuous batching, and with
    speculative decoding when given a ``Speculator`` (megarl/spec). ``model`` is a ``CausalLM``
    or, in a rollout group with TP > 1, this rank's ``TPCausalLM``."""

    def __init__(self, model: CausalLM, cfg: EngineConfig, seed: int, spec: Speculation | None = None):
        self.cfg, self.seed = cfg, seed
        self.runner = r = ModelRunner(model, cfg, seed, spec)
        self.scheduler = Scheduler(cfg, r.cache, spec)
        self.spec = spec
        # The runner's parts, read by the stages, draft targets, benchmarks and tests.
        self.model, self.cache, self.packs, self.static = r.model, r.cache, r.packs, r.static
        self.dtype, self.device, self.sample_dtype, self.vocab_size = r.dtype, r.device, r.sample_dtype, r.vocab_size
        self.tp_size, self.tp_rank, self.pad_single_row = r.tp_size, r.tp_rank, r.pad_single_row
        self.head_logits = r.head_logits
        self.reset_stats()

    @property
    def spec(self) -> Speculation | None:
        """The speculator, or None. Callers swap it between calls (evaluation detaches it): the
        scheduler (drafts, feedback) and the runner (hidden states) always use this one."""
        return self._spec

    @spec.setter
    def spec(self, spec: Speculation | None) -> None:
        self._spec = self.scheduler.spec = self.runner.spec = spec

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
        """Nothing to free but memory: no process, thread or process group of its own
        (the rollout backend interface, megarl/rollout/backend.py)."""

    def load_weights(self, named: dict[str, torch.Tensor], sliced: bool = False) -> None:
        """Copy HF-named tensors into the model in place, cast to the engine dtype. All names
        and shapes are checked before anything is copied. A ``lm_head.weight`` sent for a
        tied-embedding model is ignored (HF checkpoints sometimes carry it).

        With TP > 1, ``named`` holds the full tensors and each rank copies its own slice, or,
        with ``sliced=True``, only this rank's pieces as ``tp_model.tp_slice`` cuts them (what a
        per-rank weight sync sends)."""
        self.runner.load_weights(named, sliced)

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
        seqs = self.scheduler.add(requests)
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(seqs), desc=f"rollout step {step}", unit="req")
        self.runner.hidden_hook = self.spec is not None and self.spec.needs_hidden
        if self.runner.hidden_hook:
            self.spec.attach(self.draft_target())
        if self.spec is not None:
            self.spec.begin(requests, step)
        with torch.inference_mode():
            self._loop(step, bar, on_finish, should_stop)
        if bar is not None:
            bar.close()
        results = [s.result() for s in seqs]
        if self.spec is not None:
            self.spec.end(results, step, purpose)
        return results

    def _loop(self, step: int, bar, on_finish, should_stop) -> None:
        """Engine iterations until every request finished (or ``should_stop`` said so)."""
        sched = self.scheduler
        while not sched.done:
            if should_stop is not None and should_stop():
                sched.abort()
                break
            self.admit(sched.waiting, sched.running)
            batch = sched.schedule()
            out = self.run(batch, step)
            finished, n_tokens = sched.postprocess(batch, out)
            self.stats["tokens"] += n_tokens
            self.stats["target_forwards"] += len(batch.seqs)
            if self.runner.hidden_hook:
                self.spec.step_end()
            if bar is not None:
                bar.update(len(finished))
            if finished and on_finish is not None:
                with torch.inference_mode(False):
                    for s in finished:  # finished now: retired, never seen again
                        on_finish(s.index, s.result())

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
        """Admission over these queues (``Scheduler.admit``: waiting requests into free cache rows,
        in order), then the prefill of their prompts but the last token (``ModelRunner.prefill``:
        one packed forward over the distinct prompts, shared by the other samples of each)."""
        self.scheduler.waiting, self.scheduler.running = waiting, running
        if self.runner.prefill(self.scheduler.admit()):
            self.stats["forwards"] += 1

    def run(self, batch: _Batch, step: int) -> _Verified:
        """Device work for one batch (``ModelRunner.run``): the target's tokens for every row."""
        self.stats["forwards"] += 1
        return self.runner.run(batch, step)

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
