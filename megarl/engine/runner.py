"""The engine's model runner: the device work of continuous batching (docs/design.md §2).

It owns the model (with its fused projections and, on CPU, its packed linears), the KV cache, and
the sampling call:
- ``prefill``: one packed forward over the admitted requests' distinct prompt prefixes, whose k/v
  the other samples of the same prompt then share;
- ``run``: one forward through the cache over every row's pending + draft tokens, packed without
  padding, then one verify call: the target's own sample at the last pending position and at every
  draft position, and the length of the accepted draft prefix (megarl/engine/verify.py), or, with
  ``EngineConfig.static_shapes``, the same work over fixed shapes (megarl/engine/static_step.py);
- ``load_weights``: HF-named tensors copied into the model in place.

Tensor parallelism: given a ``TPCausalLM`` (megarl/engine/tp_model.py), the model's collectives
hand every rank the same full logits; only the KV cache differs (it holds the rank's own KV heads).
"""
from __future__ import annotations

import contextlib
import itertools

import torch

from megarl.engine.kv_cache import CacheAttention, KVCache
from megarl.engine.paged_kv_cache import PagedKVCache
from megarl.engine.requests import EngineConfig
from megarl.engine.sampler import token_stats
from megarl.engine.sampling_rows import SamplingRows
from megarl.engine.scheduler import Batch, Prefill, Verified
from megarl.engine.speculation import Speculation
from megarl.engine.static_step import StaticStep
from megarl.engine.tp_model import TPCausalLM, tp_shard
from megarl.engine.verify import sample_rows, verify
from megarl.models import packed_linear
from megarl.models.llama import CausalLM
from megarl.utils.cpu_alloc import keep_freed_memory


class ModelRunner:
    """The target model, its KV cache and the forwards and sampling of one engine."""

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
        # CPU fp32/bf16: oneDNN linears (models/packed_linear.py); with them or bf16, ``forward``'s twin row.
        self.packs = (packed_linear.PackedLinears(self.model) if cfg.cpu_packed_linears
                      and packed_linear.supports(self.dtype, self.device) else None)
        self.pad_single_row = (self.device.type == "cpu" and isinstance(self.cache, KVCache)
                               and (self.packs is not None or self.dtype == torch.bfloat16))
        # A learned drafter (spec.drafter) reads the target's hidden states: set per generate call,
        # False keeps the forward path exactly the plain one.
        self.hidden_hook = False
        self.static = StaticStep(self) if cfg.static_shapes else None

    @torch.no_grad()
    def load_weights(self, named: dict[str, torch.Tensor], sliced: bool = False) -> None:
        """``Engine.load_weights``: every name and shape checked before anything is copied."""
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

    def prefill(self, fills: list[Prefill]) -> bool:
        """Cache each prompt prefix in its first request's row (one packed forward) and share it
        with the other requests of the same prompt. Returns whether a forward ran."""
        if not fills:
            return False
        hidden = self.forward([f.seqs[0].slot for f in fills], [f.prefix for f in fills])[None]
        if self.hidden_hook:  # ... and, for a learned drafter, the prompts' hidden states
            self.spec.on_prefill([[s.req for s in f.seqs] for f in fills], hidden[0])
        for f in fills:
            self.cache.share_prefix(f.seqs[0].slot, [s.slot for s in f.seqs[1:]], len(f.prefix))
        return True

    def run(self, batch: Batch, step: int) -> Verified:
        """Device work for one batch: one forward over every row's pending + draft tokens through
        the cache, then the target's own sample at the last pending position and at every draft
        position, compared with the drafts (megarl.engine.verify)."""
        if self.static is not None:  # the same work over fixed shapes (EngineConfig.static_shapes)
            return Verified(*self.static.run(batch, step))
        inputs = [p + d for p, d in zip(batch.pending, batch.drafts)]
        n_new, dev = [len(x) for x in inputs], self.device
        hidden = self.forward([s.slot for s in batch.seqs], inputs)  # [N, H], packed
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
        rows = SamplingRows.of(reqs, [len(s.tokens) for s in batch.seqs], self.seed, step, self.sample_dtype, dev)
        if len(keep) == len(reqs) and dev.type == "cpu" and not self.hidden_hook:  # no drafts: nothing to verify
            tokens = sample_rows(logits, rows)
            n_accept, row_temp = [0] * len(reqs), rows.temperature
        else:
            per_req = lambda vals: torch.tensor(vals, dtype=torch.int64, device=dev)  # noqa: E731
            row_start = per_req([0] + list(itertools.accumulate(n_rows)))
            tokens, n_acc = verify(logits, per_req(draft_next), row_start, rows)
            n_accept, row_temp = n_acc.tolist(), rows.temperature.repeat_interleave(per_req(n_rows))
        logprobs, entropies = token_stats(logits, row_temp, tokens)
        if self.hidden_hook:  # the accepted rows' hidden states, for a learned drafter
            self.spec.on_verify(reqs, h, tokens, n_rows, n_accept, [len(s.tokens) for s in batch.seqs])
        return _split_rows(tokens.tolist(), logprobs.tolist(), entropies.tolist(), n_rows, n_accept)

    def forward(self, slots: list[int], inputs: list[list[int]]) -> torch.Tensor:
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
        with self.linears():
            return self.model.hidden_states(ids_t, positions, attn)[0, :sum(n_new)]

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head as the engine runs it: packed linears, a lone row with its twin (``forward``)."""
        with self.linears():
            if self.pad_single_row and hidden.shape[0] == 1:
                return self.model.logits(hidden.expand(2, -1))[:1]
            return self.model.logits(hidden)

    def linears(self):
        """The context the target's forwards run in: its packed linears, if any."""
        return self.packs.active() if self.packs is not None else contextlib.nullcontext()


def _split_rows(tokens: list[int], logprobs: list[float], entropies: list[float], n_rows: list[int],
                n_accept: list[int]) -> Verified:
    """Per request (``n_rows`` verified rows each) its accepted rows and the target's own row."""
    out = Verified([], [], [], n_accept)
    for b, lo in enumerate(itertools.accumulate([0] + n_rows[:-1])):
        hi = lo + n_accept[b] + 1
        out.tokens.append(tokens[lo:hi])
        out.logprobs.append(logprobs[lo:hi])
        out.entropies.append(entropies[lo:hi])
    return out
