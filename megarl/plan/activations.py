"""Bytes the trainer keeps for the backward, per token, from the model's shapes.

The reference is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", §4): per layer and token a transformer keeps ``h (34 + 5 a s / h)`` bytes in fp16 with
dropout and materialised attention scores, ``h (10 + 24 / t)`` of it outside the tensor-parallel
regions. megarl's layer differs in ways that change the constants, not the form: no dropout, no
[s, s] scores (torch's SDPA keeps its inputs, output and log-sum-exp only), a SwiGLU MLP, GQA, and
its own packing of rows (megarl/trainer/model.py). Each term below names the tensor autograd
keeps (read off the saved-tensor hooks of one layer of megarl's Megatron model on CPU,
tests/plan/test_plan.py checks the totals against them):

per layer and token, with ``a`` the compute dtype's bytes, ``t`` the TP size (``h``-wide terms
are cut by ``t`` only with sequence parallelism), ``dq = heads * head_dim``, ``dkv = kv_heads *
head_dim``:

- two RMSNorms: torch's ``rms_norm`` keeps its input and normalised output in fp32 whatever the
  dtype (it computes in fp32), plus one fp32 rstd: ``2 x (8 h + 4)``;
- the inputs of ``linear_qkv`` and ``linear_fc1`` (``h`` each) and ``linear_proj`` (``dq / t``);
- RoPE's cos and sin for q and k: ``4 head_dim``;
- the fused qkv output ``(dq + 2 dkv) / t``, the rotated q and k ``(dq + dkv) / t``;
- the core attention (SDPA over rows padded to the micro-batch's longest): its q, k, v copies
  ``(dq + 2 dkv) / t``, output ``dq / t``, fp32 log-sum-exp ``4 heads / t``, the packing index (8);
- the SwiGLU MLP: fc1's output (``2 ffn / t``), silu's output, the gate product's other factor and
  fc2's input (``ffn / t`` each): ``5 ffn / t``.

``trainer.recompute: selective`` (core attention and MLP recomputed, megarl/trainer/model.py)
drops the MLP's ``5 ffn / t`` and the core attention's own copies; ``full`` keeps only each layer's
input (``a h``) and recomputes one layer at a time in the backward (one layer's ``none`` bytes on
top, while it runs).

``trainer.attention: eager`` (the engine's attention math) materialises each query's probabilities
over its row's keys: it keeps the fp32 softmax output and, below fp32, its copy in the dtype that
P V reads, ``(4 + a) heads L / t`` per layer and token of rows padded to ``L`` tokens (quadratic
in the length: the SDPA terms' constant bytes are negligible beside it; measured on the test
model at L = 48 and 96, the formula is 120-260 bytes per token above what autograd keeps).
Recompute drops it with the core attention, and holds one layer's while that layer recomputes.

The output layer runs on the scored (response) positions only and the vocab-parallel log-softmax
keeps ``exp(logits - max)`` in fp32: ``4 V / t`` per scored token, plus the layer's input.
"""
from __future__ import annotations

from megarl.models.config import ModelArgs
from megarl.models.mcore_sharding import padded_vocab

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}
RECOMPUTES = ("none", "selective", "full")


def _norm_bytes(dtype: str) -> int:
    """Bytes per element torch's rms_norm keeps (it upcasts bf16 to fp32)."""
    return max(DTYPE_BYTES[dtype], 4)


def layer_bytes_per_token(args: ModelArgs, tp: int, dtype: str, recompute: str = "none",
                          sequence_parallel: bool = False) -> float:
    """Bytes one decoder layer keeps per token of a micro-batch for the backward (dense layer;
    an MoE layer is counted with its top-k experts' MLPs per token, see :func:`_mlp_bytes`)."""
    if recompute not in RECOMPUTES:
        raise ValueError(f"recompute={recompute!r} is invalid; valid choices: {list(RECOMPUTES)}")
    a, h, d = DTYPE_BYTES[dtype], args.hidden_size, args.head_dim
    if recompute == "full":
        return a * h / (tp if sequence_parallel else 1)
    wide = tp if sequence_parallel else 1  # h-wide activations are cut by TP only with SP
    dq, dkv, heads = args.num_attention_heads * d / tp, args.num_key_value_heads * d / tp, args.num_attention_heads / tp
    norms = 2 * (2 * _norm_bytes(dtype) * h / wide + 4)
    linear_inputs = a * (2 * h / wide + dq)
    rope_and_qkv = a * (4 * d + (dq + 2 * dkv) + (dq + dkv))
    core_attention = a * ((dq + 2 * dkv) + dq) + 4 * heads + 8
    mlp = _mlp_bytes(args, tp, a)
    if recompute == "selective":
        return norms + linear_inputs + rope_and_qkv
    return norms + linear_inputs + rope_and_qkv + core_attention + mlp


def eager_attention_bytes_per_token(args: ModelArgs, tp: int, dtype: str, length: int) -> float:
    """What ``trainer.attention: eager`` keeps beyond SDPA per layer and token, rows of ``length``
    tokens: the softmax output (at least fp32) and its cast to a narrower dtype, per head and key."""
    a = DTYPE_BYTES[dtype]
    sm = max(a, 4)
    return (sm + (a if a < sm else 0)) * args.num_attention_heads / tp * length


def _mlp_bytes(args: ModelArgs, tp: int, a: int) -> float:
    """The SwiGLU MLP's ``5 ffn / t`` per token; an MoE layer runs ``top-k`` experts per token
    (each keeps its own SwiGLU tensors) and its router keeps the ``num_experts`` logits."""
    if args.is_moe:
        return 5 * a * args.moe_intermediate_size * args.num_experts_per_tok + 2 * a * args.num_experts
    return 5 * a * args.intermediate_size / tp


def head_bytes_per_scored_token(args: ModelArgs, tp: int, dtype: str) -> float:
    """Bytes kept per scored position by the output layer (its input) and the vocab-parallel
    log-softmax (fp32 ``exp(logits - max)`` over this rank's vocabulary slice)."""
    return 4 * padded_vocab(args.vocab_size, tp) / tp + DTYPE_BYTES[dtype] * args.hidden_size


def head_transient_per_scored_token(args: ModelArgs, tp: int, dtype: str) -> float:
    """Temporaries of the log-softmax beyond what it keeps, per scored position: the logits in
    the compute dtype, their fp32 copy (bf16) and ``logits - max`` in the forward; in the
    backward ``e / s`` and its product with the incoming gradient (fp32), cast back to the dtype."""
    a = DTYPE_BYTES[dtype]
    return (8 + a + (4 if a < 4 else 0)) * padded_vocab(args.vocab_size, tp) / tp
