"""Tensor-parallel dense Llama/Qwen2/Qwen3 decoder for a rollout group (Megatron-style split).

``TPCausalLM(args, group)`` is ``megarl.models.llama.CausalLM`` built at this rank's widths over
an explicit process group of ``tp`` ranks; parameter names stay the HF names, with local shapes.
Rank ``r`` holds the ``r``-th of ``tp`` contiguous pieces:

==================================================  ========  ===================================
HF tensor                                           split     rank ``r`` holds
==================================================  ========  ===================================
``q_proj`` / ``k_proj`` / ``v_proj`` weight, bias   column    query heads ``r*Hq/tp ..``, KV heads
                                                              ``r*Hkv/tp ..`` (rows are head-major)
``gate_proj`` / ``up_proj`` weight                  column    rows ``r*I/tp ..``
``o_proj`` / ``down_proj`` weight                   row       the matching input columns
``embed_tokens`` / ``lm_head`` weight               vocab     rows ``r*c .. min((r+1)*c, V)``,
                                                              ``c = ceil(V/tp)`` (:func:`vocab_range`)
norms (Qwen3 ``q_norm``/``k_norm`` too),           --        a full copy
``o_proj.bias``
==================================================  ========  ===================================

Why contiguous head blocks: query head ``h`` reads KV head ``h // (Hq/Hkv)`` (HF's repeat_kv), so
the ``Hq/tp`` query heads of rank ``r`` read exactly its ``Hkv/tp`` KV heads, in the same local
order; attention needs no communication and the KV cache holds the local KV heads only.

Collectives per forward: one all-reduce (sum) after each row-parallel linear (``o_proj``,
``down_proj``; their bias is added once, after the sum), one for the embedding, and one
all-gather of the logits. The embedding is vocab-parallel rather than replicated: a tied model
then keeps one ``[~V/tp, h]`` slice for both embedding and LM head (a replicated embedding would
cost a full ``[V, h]`` copy per rank), every vocab-sized tensor is cut by the same rule (one
slicing rule for the weight sync), and the lookup's all-reduce is exact (each element is the
sum of one row value and zeros), so embeddings match TP=1 bit for bit.

The LM head is vocab-parallel and its logits are all-gathered, so every rank of the group holds
the same full ``[N, V]`` logits and the unchanged sampler picks the same token everywhere (the
engine's decisions never diverge between ranks). The gather moves ``N * V * (tp-1)/tp`` values
per rank per forward and every rank samples over the full vocab; a vocab-parallel Gumbel-argmax
(per-slice max of filtered logits + noise, then an all-reduce of (value, index) pairs and of the
logsumexp statistics) would move O(N) values instead and is a later optimisation.

The row-parallel sums round differently from TP=1's single reduction, so logits match TP=1 to
~1e-15 (fp64), not bitwise; tokens match exactly in the fp64 tests (a flip needs a near-tie at
that scale). The module is inference-only (its parameters do not require grad): the trainer is
Megatron-core; this is the rollout engine's model.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM
from megarl.models.packed_linear import linear

# How each HF tensor is cut, by name suffix (per-layer names) or full name.
_COLUMN = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
           "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
           "mlp.gate_proj.weight", "mlp.up_proj.weight")
_ROW = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
# Qwen3's q_norm / k_norm weights [head_dim] are shared by every head: each rank needs all of them.
_REPLICATED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.bias",
               "self_attn.q_norm.weight", "self_attn.k_norm.weight")
# Dense model types: MoE layers would need their experts sharded (expert parallelism), not this.
_DENSE_TYPES = ("llama", "qwen2", "qwen3")
_VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
_TP_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first row, rows) of rank ``tp_rank``'s vocab slice: pieces of ``ceil(V/tp)`` rows, the
    last one shorter when ``tp`` does not divide ``V``. Uneven pieces instead of padding keep the
    HF tensors' shapes (a tokenizer's vocab, e.g. 27 characters, rarely divides by tp); only the
    logits gather pads, to equal-size messages."""
    c = -(-vocab_size // tp_size)
    start = min(tp_rank * c, vocab_size)
    return start, min(c, vocab_size - start)


def tp_divisors(args: ModelArgs) -> list[int]:
    """Every TP size that divides all the split dimensions of ``args``'s model."""
    ns = [getattr(args, f) for f in _TP_FIELDS]
    return [d for d in range(1, min(ns) + 1) if all(n % d == 0 for n in ns)]


def check_tp(args: ModelArgs, tp_size: int) -> None:
    """Raise ``ValueError`` naming the field unless the model can be cut into ``tp_size`` pieces."""
    if args.model_type not in _DENSE_TYPES:
        raise ValueError(f"rollout tensor parallelism does not cover model_type={args.model_type!r} "
                         f"(MoE layers); valid choices: {list(_DENSE_TYPES)}")
    if tp_size < 1:
        raise ValueError(f"tensor parallel size tp={tp_size} is invalid; valid range: >= 1")
    for name in _TP_FIELDS:
        n = getattr(args, name)
        if n % tp_size:
            raise ValueError(f"rollout tensor parallel size tp={tp_size} does not divide {name}={n}; valid tp "
                             f"(dividing {', '.join(_TP_FIELDS)}): {tp_divisors(args)}")
    if vocab_range(args.vocab_size, tp_size - 1, tp_size)[1] < 1:
        raise ValueError(f"rollout tensor parallel size tp={tp_size} leaves the last rank no rows of "
                         f"vocab_size={args.vocab_size} (pieces of ceil(V/tp) rows); use a smaller tp")


def tp_split(name: str) -> str:
    """How the HF tensor ``name`` is cut: ``column`` (dim 0), ``row`` (dim 1), ``vocab`` (dim 0)
    or ``replicated``; see the module table."""
    if name in _VOCAB_NAMES:
        return "vocab"
    if name == "model.norm.weight":
        return "replicated"
    if name.startswith("model.layers."):
        suffix = name.split(".", 3)[3]  # after "model.layers.<i>."
        for kind, names in (("column", _COLUMN), ("row", _ROW), ("replicated", _REPLICATED)):
            if suffix in names:
                return kind
    raise ValueError(f"tp_split: {name!r} is not a parameter name of a dense Llama/Qwen2/Qwen3 model")


def tp_slice(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s piece of the full HF tensor ``name`` (a view of ``full``, no copy; a
    row-parallel piece is a non-contiguous view: call ``.contiguous()`` before sending it).
    This is what ``TPCausalLM`` holds, so a per-rank weight sync can send exactly this."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is invalid for tp_size={tp_size}; valid range: 0..{tp_size - 1}")
    kind = tp_split(name)
    if kind == "replicated" or tp_size == 1:
        return full
    if kind == "vocab":
        start, rows = vocab_range(full.shape[0], tp_rank, tp_size)
        return full.narrow(0, start, rows)
    dim = 1 if kind == "row" else 0
    n = full.shape[dim]
    if n % tp_size:
        raise ValueError(f"tp_slice: {name} has {n} entries along dim {dim}, not divisible by tp_size={tp_size}")
    return full.narrow(dim, tp_rank * (n // tp_size), n // tp_size)


def tp_shard(named: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """``tp_slice`` of every tensor of a full HF-named state dict."""
    return {k: tp_slice(k, v, tp_rank, tp_size) for k, v in named.items()}


class RowParallelLinear(nn.Linear):
    """``y = x_r @ W_r^T`` summed over the group, then ``+ bias``: ``x_r`` is this rank's slice
    of the input features (the output of the matching column-parallel linear). The bias is
    added once, after the sum, not once per rank."""

    def __init__(self, in_local: int, out_features: int, bias: bool, group: dist.ProcessGroup, tp_size: int):
        super().__init__(in_local, out_features, bias=bias)
        self.group, self.tp_size = group, tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``vocab_start .. vocab_start + num_embeddings`` of the embedding; ids outside them
    give zeros here and are filled in by their owner's rows in the all-reduce."""

    def __init__(self, vocab_local: int, hidden: int, vocab_start: int, group: dist.ProcessGroup, tp_size: int):
        super().__init__(vocab_local, hidden)
        self.vocab_start, self.group, self.tp_size = vocab_start, group, tp_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0)
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x


class TPCausalLM(CausalLM):
    """``CausalLM`` cut over the ranks of ``group`` (see the module docstring).

    Same interface as ``CausalLM`` for the engine: ``args`` are the FULL model's args (vocab
    size, head counts), ``local_args`` this rank's widths (the KV cache uses
    ``local_args.num_key_value_heads``); ``hidden_states`` returns the full (replicated) hidden
    states and ``logits`` the full-vocab logits, identical on every rank of the group. Every
    rank must call them with the same inputs in the same order (they are collective).
    ``state_dict()`` / ``hf_state_dict()`` hold this rank's pieces under their HF names."""

    def __init__(self, args: ModelArgs, group: dist.ProcessGroup):
        tp_size, tp_rank = dist.get_world_size(group), dist.get_rank(group)
        if tp_rank < 0:
            raise ValueError(f"TPCausalLM: rank {dist.get_rank()} is not a member of the given rollout group")
        check_tp(args, tp_size)
        local = dataclasses.replace(
            args, num_attention_heads=args.num_attention_heads // tp_size,
            num_key_value_heads=args.num_key_value_heads // tp_size,
            intermediate_size=args.intermediate_size // tp_size,
            vocab_size=vocab_range(args.vocab_size, tp_rank, tp_size)[1])
        super().__init__(local)  # column-parallel linears and the LM head are plain local linears
        self.args, self.local_args = args, local
        self.group, self.tp_size, self.tp_rank = group, tp_size, tp_rank
        h = args.hidden_size
        self.vocab_start = vocab_range(args.vocab_size, tp_rank, tp_size)[0]
        self.vocab_piece = vocab_range(args.vocab_size, 0, tp_size)[1]  # ceil(V/tp): every rank's message
        self.model.embed_tokens = VocabParallelEmbedding(local.vocab_size, h, self.vocab_start, group, tp_size)
        for layer in self.model.layers:
            layer.self_attn.o_proj = RowParallelLinear(local.num_attention_heads * args.head_dim, h, args.o_bias,
                                                       group, tp_size)
            layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, h, False, group, tp_size)
        self.requires_grad_(False)  # inference only; collectives write their outputs in place

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits [..., V]: this rank's slice, all-gathered over the group (see the
        module docstring for the cost)."""
        local = linear(hidden, self.lm_head_weight).contiguous()
        if self.tp_size == 1:
            return local
        if local.shape[-1] < self.vocab_piece:  # the short last piece: pad to equal-size messages
            local = F.pad(local, (0, self.vocab_piece - local.shape[-1]))
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., :self.args.vocab_size]
