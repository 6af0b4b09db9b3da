"""How many parameters each trainer and engine process holds, from the model's shapes alone.

Counts follow the pieces Megatron-core's local layer spec builds (megarl/trainer/model.py) and
the engine's tensor-parallel split (megarl/engine/tp_model.py): per decoder layer the fused
``linear_qkv`` (with Qwen2's bias), ``linear_proj``, the gated ``linear_fc1`` (2 x ffn rows) and
``linear_fc2``, cut over TP; RMSNorm weights (and Qwen3's q/k norms) whole on every rank; an MoE
layer's router whole and ``num_experts / ep`` experts (MoE runs at TP=1). The embedding sits on the
first pipeline stage and the output layer on the last, each ``padded_vocab / tp`` rows; a tied
model with PP > 1 keeps a copy of the embedding on the last stage (Megatron's shared embedding).
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.models.config import ModelArgs
from megarl.models.mcore_sharding import padded_vocab


@dataclass(frozen=True)
class StageParams:
    """Parameters of one trainer process (its TP piece of one pipeline stage)."""

    dense: int
    """Parameters whose optimizer state is sharded over the whole data-parallel group."""
    expert: int
    """MoE expert parameters (sharded over the expert-data-parallel group, ``dp / ep``)."""

    @property
    def total(self) -> int:
        return self.dense + self.expert


def attention_params(args: ModelArgs, tp: int) -> int:
    """One layer's attention projections and norms on one of ``tp`` ranks."""
    d, hq, hkv, h = args.head_dim, args.num_attention_heads, args.num_key_value_heads, args.hidden_size
    qkv_rows = (hq + 2 * hkv) * d // tp
    n = qkv_rows * h + (qkv_rows if args.qkv_bias else 0)
    n += (hq * d // tp) * h + (h if args.o_bias else 0)
    n += h  # input RMSNorm
    if args.qk_norm:
        n += 2 * d
    return n


def mlp_params(args: ModelArgs, tp: int, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of one layer's MLP block and its norm on one rank."""
    h = args.hidden_size
    if args.is_moe:
        experts = args.num_experts // ep * 3 * h * args.moe_intermediate_size
        return h + args.num_experts * h, experts  # pre-MLP norm and the router stay whole
    return h + 3 * h * args.intermediate_size // tp, 0


def stage_params(args: ModelArgs, tp: int, pp: int, ep: int = 1, stage: int = 0) -> StageParams:
    """Parameters of pipeline stage ``stage`` (of ``pp``) on one TP/EP rank."""
    layers = args.num_hidden_layers // pp
    mlp_dense, mlp_expert = mlp_params(args, tp, ep)
    dense = layers * (attention_params(args, tp) + mlp_dense)
    vocab_rows = padded_vocab(args.vocab_size, tp) // tp * args.hidden_size
    first, last = stage == 0, stage == pp - 1
    if first:
        dense += vocab_rows
    if last:
        dense += args.hidden_size  # final norm
        if not args.tie_word_embeddings or pp > 1:  # tied at PP > 1: the last stage's copy
            dense += vocab_rows
    return StageParams(dense=dense, expert=layers * mlp_expert)


def worst_stage(args: ModelArgs, tp: int, pp: int, ep: int = 1) -> tuple[int, StageParams]:
    """The pipeline stage holding the most parameters, and its counts."""
    stages = [stage_params(args, tp, pp, ep, s) for s in range(pp)]
    best = max(range(pp), key=lambda s: stages[s].total)
    return best, stages[best]


def model_params(args: ModelArgs) -> int:
    """Parameters of the whole model (HF count: the embedding once when tied)."""
    p = stage_params(args, 1, 1)
    return p.total


def engine_params(args: ModelArgs, rollout_tp: int) -> int:
    """Parameters one rank of a rollout group holds: every layer's TP piece, the embedding and
    LM head cut by vocabulary rows (``ceil(V / tp)`` each, one slice when tied)."""
    h = args.hidden_size
    mlp_dense, mlp_expert = mlp_params(args, rollout_tp)
    per_layer = attention_params(args, rollout_tp) + mlp_dense + mlp_expert
    vocab = -(-args.vocab_size // rollout_tp) * h
    return args.num_hidden_layers * per_layer + h + vocab * (1 if args.tie_word_embeddings else 2)


def drafter_params(args: ModelArgs) -> int:
    """The learned drafter (megarl/spec/drafter.py): ``fc`` (2h -> h, with bias), one dense
    decoder layer of the target's shapes, an output norm; it reads the target's embedding and LM
    head, so owns none."""
    h = args.hidden_size
    layer = attention_params(args, 1) + h + 3 * h * args.intermediate_size
    return 2 * h * h + h + layer + h
