"""Build Megatron-core's GPTModel for a Llama/Qwen2-family ``ModelArgs`` and run it batch-first.

The TransformerConfig mirrors the HF architecture exactly (RMSNorm, SwiGLU, no linear biases
except the optional qkv bias, GQA, RoPE with ``rope_theta``, no dropout), so that with weights
loaded through :mod:`megarl.models.mcore_mapping` its logits equal megarl's ``CausalLM``.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from megarl.models.config import ModelArgs
from megarl.parallel.dist import ParallelDims

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; valid choices: {sorted(DTYPES)}")
    return DTYPES[name]


def transformer_config(args: ModelArgs, dims: ParallelDims, dtype: torch.dtype):
    """Megatron ``TransformerConfig`` equivalent to the HF architecture of ``args``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cpu = dims.device.type == "cpu"
    return TransformerConfig(
        num_layers=args.num_hidden_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.intermediate_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_key_value_heads,
        kv_channels=args.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=args.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=args.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        # Fused CUDA kernels (bias+gelu/swiglu, bias+dropout+add, masked softmax, rope) do not
        # exist on CPU; their unfused torch fallbacks give the same math.
        bias_activation_fusion=not cpu,
        bias_dropout_fusion=not cpu,
        masked_softmax_fusion=not cpu,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # Deterministic reductions: the exactness contract (DESIGN.md §2).
        deterministic_mode=True,
        cuda_graph_scope=[],  # the default "full" is deprecated and warns on every build
    )


def seed_megatron(seed: int, dims: ParallelDims) -> None:
    """Seed torch and Megatron's RNG tracker (which the attention forward always forks, even with
    dropout 0). Model init draws from the default generator, so the seed fixes the weights."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=dims.tp_rank, ep_rank=0, etp_rank=0)


def build_gpt_model(args: ModelArgs, dims: ParallelDims, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Megatron ``GPTModel`` with the local (non-TE) layer spec, on CPU, vocab not padded.
    Megatron's own init, seeded by ``seed``, gives the initial weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if dims.tp != 1 or dims.pp != 1:
        raise ValueError(f"tensor/pipeline parallel size {dims.tp}/{dims.pp} is not supported yet: the trainer "
                         f"runs with TP=1 and PP=1 (TP/PP trainers are issue 4)")
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    # The TE spec would only apply with transformer_engine importable; megarl uses the local
    # spec everywhere so that CPU and GPU runs share one module tree (and one name mapping).
    logger.info("GPTModel layer spec: local (transformer_engine %s)",
                "importable" if have_transformer_engine() else "not importable")
    cfg = transformer_config(args, dims, dtype)
    seed_megatron(seed, dims)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=True,
        post_process=True,
        fp16_lm_cross_entropy=False,
        parallel_output=True,
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(args.rope_theta) if float(args.rope_theta).is_integer() else args.rope_theta,
        pg_collection=dims.pg_collection,
    )
    # WrappedTorchNorm builds RMSNorm weights in torch's default dtype, ignoring params_dtype;
    # cast so that every parameter has the model dtype (fp64 tests rely on it).
    model.to(device=dims.device, dtype=dtype)
    if dtype == torch.float64:
        # RotaryEmbedding keeps inv_freq in fp32 whatever the model dtype; in fp64 recompute it
        # the way megarl's CausalLM does, so fp64 exactness tests see identical RoPE angles.
        rope = model.rotary_pos_emb
        exps = torch.arange(0, args.head_dim, 2, dtype=torch.int64).to(torch.float64) / args.head_dim
        rope.inv_freq = (1.0 / (args.rope_theta ** exps)).to(rope.inv_freq.device)
    return model


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """Megatron's boolean attention mask (True = masked out), shape [1, 1, T, T]. Passed
    explicitly: without it the local spec builds its default causal mask on ``device="cuda"``."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def gpt_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of a (possibly DDP-wrapped) GPTModel on right-padded ``input_ids`` [B, T].

    Right padding needs no padding mask: causal attention never lets a real token see the pads
    after it."""
    input_ids = input_ids.to(next(model.parameters()).device)
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    return model(input_ids, positions, causal_mask(t, input_ids.device))
