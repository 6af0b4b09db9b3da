"""The native rollout engine v1: continuous batching over a slot KV cache, Gumbel-max sampling.

One iteration is ``schedule() -> run() -> postprocess()`` (DESIGN.md §3):
- ``schedule`` (host only) admits waiting requests into free slots, or else picks every running
  request for one decode step. Prefill has priority, so a freed slot is refilled at once.
- ``run`` does the device work: one batched forward through the cache, then one sampler call.
- ``postprocess`` (host) appends the tokens, retires finished requests and frees their slots.

Every token is a function of (weights, prompt, seed, step, uid, sample_idx, position) only
(DESIGN.md §2), so which requests share a batch never changes a response (up to the
batch-invariance of the float reductions: exact in the float64 CPU tests).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from megarl.engine.kv_cache import KVCache
from megarl.engine.sampler import SamplingParams, gumbel_noise, sample
from megarl.models.llama import CausalLM

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    """Shape of the rollout engine."""

    max_batch_size: int = 64
    """Most requests running at once (= KV-cache slots)."""
    max_seq_len: int = 2048
    """Longest prompt + response, in tokens (= KV-cache positions per slot)."""
    dtype: str = "float32"
    """Model and cache dtype: one of float32, float64, bfloat16."""
    device: str = "cpu"
    """Device of the model and cache: cpu or cuda (cuda:N also accepted)."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size} is invalid; valid range: >= 1")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len} is invalid; valid range: >= 2")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid; valid choices: {sorted(_DTYPES)}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device={self.device!r} is invalid; valid choices: cpu, cuda")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass
class Request:
    """One response to generate."""

    uid: int
    """Prompt uid (same for every sample of a GRPO group); part of the noise key."""
    sample_idx: int
    """Index of this sample within its prompt's group; part of the noise key."""
    prompt_ids: list[int]
    """Prompt token ids."""
    params: SamplingParams = field(default_factory=SamplingParams)
    """How to sample."""


@dataclass
class Result:
    """One finished response."""

    uid: int
    """Prompt uid of the request."""
    sample_idx: int
    """Sample index of the request."""
    prompt_ids: list[int]
    """Prompt token ids of the request."""
    tokens: list[int]
    """Generated token ids (a final stop token included)."""
    logprobs: list[float]
    """log p(token) under softmax(logits / T), unfiltered (T=1 for greedy)."""
    entropies: list[float]
    """Entropy of softmax(logits / T) at each generated position (T=1 for greedy)."""
    finish_reason: str
    """"stop" (a stop token was sampled) or "length" (max_new_tokens or max_seq_len)."""
    n_forwards: int
    """Target forward passes this request took part in, prefill included."""


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


@dataclass
class _Batch:
    """What ``schedule`` picked for one forward: the rows and their new input tokens."""

    seqs: list[_Seq]
    inputs: list[list[int]]
    is_prefill: bool


class Engine:
    """Generates responses for a list of requests with continuous batching."""

    def __init__(self, model: CausalLM, cfg: EngineConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self.dtype, self.device = cfg.torch_dtype, torch.device(cfg.device)
        # Sampling math runs in at least fp32: bf16 logits + noise would tie constantly.
        self.sample_dtype = torch.promote_types(self.dtype, torch.float32)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()  # in place
        a = model.args
        self.vocab_size = a.vocab_size
        self.cache = KVCache(a.num_hidden_layers, cfg.max_batch_size, cfg.max_seq_len,
                             a.num_key_value_heads, a.head_dim, self.dtype, self.device)
        self.stats = {"forwards": 0, "tokens": 0, "target_forwards": 0}

    def reset_stats(self) -> None:
        self.stats = dict.fromkeys(self.stats, 0)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the model in place, cast to the engine dtype. All names
        and shapes are checked before anything is copied. A ``lm_head.weight`` sent for a
        tied-embedding model is ignored (HF checkpoints sometimes carry it)."""
        params = self.model.state_dict()
        names = set(named)
        if self.model.args.tie_word_embeddings:
            names.discard("lm_head.weight")
        missing, unexpected = sorted(set(params) - names), sorted(names - set(params))
        bad_shape = [f"{k}: got {tuple(named[k].shape)}, expected {tuple(params[k].shape)}"
                     for k in sorted(names & set(params)) if named[k].shape != params[k].shape]
        if missing or unexpected or bad_shape:
            raise ValueError(f"load_weights: missing={missing} unexpected={unexpected} "
                             f"mis-shaped={bad_shape}")
        for k in names:
            params[k].copy_(named[k].to(device=self.device, dtype=self.dtype))

    # ------------------------------------------------------------------ generation
    def generate(self, requests: list[Request], step: int, progress: bool = False) -> list[Result]:
        """Responses for ``requests`` (same order), sampled with RL step ``step``'s noise."""
        self._validate(requests)
        seqs = [_Seq(i, r) for i, r in enumerate(requests)]
        waiting, running = deque(seqs), []
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(seqs), desc=f"rollout step {step}", unit="req")
        with torch.inference_mode():
            while waiting or running:
                batch = self.schedule(waiting, running)
                out = self.run(batch, step)
                n_done = self.postprocess(batch, out, running)
                if bar is not None:
                    bar.update(n_done)
        if bar is not None:
            bar.close()
        return [self._result(s) for s in seqs]

    def schedule(self, waiting: deque, running: list[_Seq]) -> _Batch:
        """Host only: prefill as many waiting requests as there are free slots, else decode all
        running ones."""
        table = self.cache.table
        if waiting and table.n_free:
            seqs = [waiting.popleft() for _ in range(min(len(waiting), table.n_free))]
            for s in seqs:
                s.slot = table.allocate()
            return _Batch(seqs, [list(s.req.prompt_ids) for s in seqs], is_prefill=True)
        return _Batch(list(running), [[s.tokens[-1]] for s in running], is_prefill=False)

    def run(self, batch: _Batch, step: int) -> tuple[list[int], list[float], list[float]]:
        """Device work for one batch: forward through the cache and sample one token per row."""
        n_new = [len(x) for x in batch.inputs]
        t = max(n_new)
        attn, positions = self.cache.batch([s.slot for s in batch.seqs], n_new)
        ids = torch.tensor([x + [0] * (t - len(x)) for x in batch.inputs], dtype=torch.int64)
        ids = ids.to(self.device)
        hidden = self.model.hidden_states(ids, positions, attn)
        rows = torch.arange(len(n_new), device=self.device)
        last = hidden[rows, torch.tensor(n_new, device=self.device) - 1]  # last real token per row
        logits = self.model.logits(last).to(self.sample_dtype)

        reqs = [s.req for s in batch.seqs]
        key = torch.tensor([[r.uid, r.sample_idx, len(s.tokens)] for r, s in zip(reqs, batch.seqs)],
                           dtype=torch.int64).to(self.device)
        noise = gumbel_noise(self.seed, step, key[:, 0], key[:, 1], key[:, 2], self.vocab_size,
                             self.sample_dtype)
        temp = torch.tensor([r.params.temperature for r in reqs], dtype=self.sample_dtype)
        top_k = torch.tensor([r.params.top_k for r in reqs], dtype=torch.int64)
        top_p = torch.tensor([r.params.top_p for r in reqs], dtype=self.sample_dtype)
        out = sample(logits, noise, temp.to(self.device), top_k.to(self.device), top_p.to(self.device))
        self.stats["forwards"] += 1
        return out.tokens.tolist(), out.logprobs.tolist(), out.entropies.tolist()

    def postprocess(self, batch: _Batch, out, running: list[_Seq]) -> int:
        """Host only: record each row's token; retire finished requests. Returns how many
        finished."""
        tokens, logprobs, entropies = out
        n_done = 0
        for s, tok, lp, ent in zip(batch.seqs, tokens, logprobs, entropies):
            s.tokens.append(tok)
            s.logprobs.append(lp)
            s.entropies.append(ent)
            s.n_forwards += 1
            p = s.req.params
            if tok in p.stop_token_ids:
                s.finish_reason = "stop"
            elif (len(s.tokens) >= p.max_new_tokens
                  or len(s.req.prompt_ids) + len(s.tokens) >= self.cfg.max_seq_len):
                s.finish_reason = "length"
            if batch.is_prefill and s.finish_reason is None:
                running.append(s)
            elif not batch.is_prefill and s.finish_reason is not None:
                running.remove(s)
            if s.finish_reason is not None:
                self.cache.table.free(s.slot)
                n_done += 1
        self.stats["tokens"] += len(batch.seqs)
        self.stats["target_forwards"] += len(batch.seqs)
        return n_done

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

    @staticmethod
    def _result(s: _Seq) -> Result:
        return Result(s.req.uid, s.req.sample_idx, list(s.req.prompt_ids), s.tokens, s.logprobs,
                      s.entropies, s.finish_reason, s.n_forwards)
