"""Build Megatron-core's GPTModel for a Llama/Qwen2-family ``ModelArgs`` and run it batch-first.

The TransformerConfig mirrors the HF architecture exactly (RMSNorm, SwiGLU, no linear biases
except the optional qkv bias, GQA, RoPE with ``rope_theta`` and HF's llama3 / yarn scaling, sliding
windows, no dropout), so that with weights loaded through :mod:`megarl.models.mcore_mapping` its
logits equal megarl's ``CausalLM``.

With TP/PP > 1 each rank builds its own stage and TP piece (layout: :mod:`megarl.models.mcore_sharding`);
:func:`load_hf_state` loads this rank's piece of HF weights, :func:`gpt_logits` gathers the
vocab-parallel logits over the TP group, and :func:`pipeline_logits` runs a forward-only pass
through the pipeline stages (the training schedules are the trainer's).
"""
from __future__ import annotations

import functools
import math
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl.models import mcore_mapping, mcore_sharding
from megarl.models.config import ModelArgs
from megarl.models.llama import grouped_attention
from megarl.models.rope import inv_freq_and_scale
from megarl.trainer import cpu_compat
from megarl.parallel.dist import ParallelDims
from megarl.trainer.sequence_parallel import block_spec, check_length, gather_before_output_layer, local_length

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; valid choices: {sorted(DTYPES)}")
    return DTYPES[name]


# Megatron's activation recompute per ``trainer.recompute`` (megarl/trainer/trainer.py):
# "selective" recomputes the core attention and the dense MLP of every layer in the backward
# (recompute_modules; the MLP's [tokens, 2 x ffn] activations are the largest a layer keeps);
# "full" recomputes each whole layer from its input (uniform, one layer per unit).
RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def transformer_config(args: ModelArgs, dims: ParallelDims, dtype: torch.dtype, recompute: str = "none"):
    """Megatron ``TransformerConfig`` equivalent to the HF architecture of ``args``, with the
    activation recompute ``recompute`` (a key of :data:`RECOMPUTE`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is invalid; valid choices: {list(RECOMPUTE)}")
    return TransformerConfig(
        **_moe_config(args, dims),
        **RECOMPUTE[recompute],
        qk_layernorm=args.qk_norm,
        softmax_scale=_softmax_scale(args),
        **_window_config(args),
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
        sequence_parallel=dims.sequence_parallel,  # megarl/trainer/sequence_parallel.py
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        # Off on every device: Megatron's bias+swiglu and bias+dropout+add fusions go through
        # torch.compile (megatron/core/jit.py), a cold compile on every fresh process of a GPU run
        # on a path the CPU tests never take, for no gain here (no linear biases, no dropout);
        # the masked-softmax kernel is never reached (megarl's attention is SDPA). The unfused
        # torch code is the same math.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # Deterministic reductions: the exactness contract (docs/design.md §1).
        deterministic_mode=True,
        cuda_graph_scope=[],  # the default "full" is deprecated and warns on every build
    )


def _softmax_scale(args: ModelArgs) -> float | None:
    """YaRN multiplies cos and sin by its attention factor m, so each rotated query and key by m and
    every logit q.k by m**2: the same as a softmax scale of m**2 / sqrt(head_dim) on plain-rotated
    q, k (Megatron's rotary embedding rotates without the factor). None: Megatron's default."""
    if args.rope_scaling is None or args.rope_scaling["rope_type"] != "yarn":
        return None
    _, m = inv_freq_and_scale(args.head_dim, args.rope_theta, args.rope_scaling, torch.float64)
    return m * m / math.sqrt(args.head_dim)


def _window_config(args: ModelArgs) -> dict:
    """Megatron's sliding-window fields for HF's window w (a query at i sees keys i - w < j <= i):
    ``window_size=(w - 1, 0)`` keys to the left and right, on the layers flagged 1 in
    ``window_attn_skip_freq`` (megarl's SDPA attention reads both; empty for full attention)."""
    if args.sliding_window is None:
        return {}
    return dict(window_size=(args.sliding_window - 1, 0),
                window_attn_skip_freq=[int(w is not None) for w in args.windows])


def _moe_config(args: ModelArgs, dims: ParallelDims) -> dict:
    """TransformerConfig MoE fields reproducing HF's Qwen3-MoE / Mixtral routing (empty for a dense
    model). Megatron's softmax router picks the top-k *logits* and softmaxes over those k when
    ``moe_router_pre_softmax=False``: exp(l_i) / sum_topk exp(l_j), which is HF's softmax over all
    experts renormalised over the top k (``norm_topk_prob=True``, Mixtral). With
    ``moe_router_pre_softmax=True`` it softmaxes over all experts and keeps the top-k
    probabilities as they are: ``norm_topk_prob=False``. No top-k scaling factor, no expert bias,
    no capacity (dropless: every token reaches its k experts, as in HF), and the router computes
    in the model dtype (``moe_router_dtype=None``), as HF's gate does."""
    if not args.is_moe:
        return {}
    if dims.tp > 1:
        # Megatron's MoE layer refuses to train with TP > 1 unless sequence parallelism splits
        # the activations along the sequence; MoE with TP and sequence parallelism is untried here.
        raise ValueError(f"MoE models need tp=1 (got tp={dims.tp}): split the experts with expert "
                         f"parallelism (ep) instead")
    if args.num_experts_per_tok == 1 and args.norm_topk_prob:
        # Megatron refuses post-softmax top-1 routing (its softmax over one logit has a zero
        # gradient); pre-softmax top-1 does not renormalise, so it is not this model.
        raise ValueError("num_experts_per_tok=1 with norm_topk_prob=True is not supported by the Megatron "
                         "trainer (Megatron's top-1 routing does not renormalise the weight to 1)")
    return dict(
        num_moe_experts=args.num_experts,
        moe_router_topk=args.num_experts_per_tok,
        moe_ffn_hidden_size=args.moe_intermediate_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not args.norm_topk_prob,
        moe_router_topk_scaling_factor=None,
        # No load-balancing loss: the policy gradient is the whole loss, so EP and dense runs
        # (and the HF model) train the same function; an aux loss would change the objective.
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        moe_input_jitter_eps=None,
        moe_expert_capacity_factor=None,
        # all-to-all over the EP group: each token goes only to the ranks of its experts (the
        # allgather dispatcher sends every token to every EP rank); a variable-size
        # all_to_all_single, which gloo implements as NCCL does.
        moe_token_dispatcher_type="alltoall",
        # SequentialMLP: one plain MLP per expert (local spec; no grouped-GEMM kernels on CPU).
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=dims.ep,
    )


def seed_megatron(seed: int, dims: ParallelDims) -> None:
    """Seed torch and Megatron's RNG tracker (which the attention forward always forks, even with
    dropout 0). Model init draws from the default generator, so the seed fixes the weights."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=dims.tp_rank, ep_rank=dims.ep_rank, etp_rank=0)


def build_gpt_model(args: ModelArgs, dims: ParallelDims, dtype: torch.dtype = torch.float32, seed: int = 0,
                    chunk: int = 0, recompute: str = "none", attention: str = "sdpa"):
    """Megatron ``GPTModel`` of this rank with the local (non-TE) layer spec: the pipeline stage
    ``dims.stage(chunk)`` of ``dims.stages`` (with virtual stages, ``vpp`` > 1, one call per model
    chunk; embedding on the first stage, final norm and output layer on the last) and
    the TP piece ``dims.tp_rank``, the vocab padded to ``mcore_sharding.padded_vocab`` (not padded
    at TP=1); for an MoE model the router and this EP rank's ``num_experts / dims.ep`` experts
    (``SequentialMLP``), with the q/k layernorms of Qwen3. Megatron's own init, seeded by
    ``seed``, gives the initial weights. ``recompute``: activation recompute (:data:`RECOMPUTE`);
    ``attention``: the core attention's math, a key of :data:`ATTENTION`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    # Every Megatron module megarl drives on CPU (DDP, optimizers, schedules, checkpoints) acts on
    # a model built here: the CPU patches go in first (no-op with CUDA but the missing-TE names).
    cpu_compat.install()
    mcore_sharding.check_parallel(args, dims.tp, dims.pp, dims.ep, vpp=dims.vpp)
    stage = dims.stage(chunk)
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts or None, moe_grouped_gemm=False,
                                     qk_layernorm=args.qk_norm, normalization="RMSNorm")
    # The TE spec would only apply with transformer_engine importable; megarl uses the local
    # spec everywhere so that CPU and GPU runs share one module tree (and one name mapping).
    # Its core attention (no parameters) is swapped for megarl's: torch's SDPA (the same math
    # without the [b*heads, s, s] score and probability tensors) or the engine's, and packed sequences.
    spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class(attention)
    logger.info("GPTModel layer spec: local (transformer_engine %s)",
                "importable" if cpu_compat.transformer_engine_importable() else "not importable")
    cfg = transformer_config(args, dims, dtype, recompute)
    if dims.sequence_parallel:  # megarl/trainer/sequence_parallel.py: norms that allow it
        spec = block_spec(spec, cfg, vp_stage=chunk if dims.vpp > 1 else None)
    seed_megatron(seed, dims)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=mcore_sharding.padded_vocab(args.vocab_size, dims.tp),
        max_sequence_length=args.max_position_embeddings,
        pre_process=stage == 0,
        post_process=stage == dims.stages - 1,
        fp16_lm_cross_entropy=False,
        parallel_output=True,  # vocab-parallel logits; gpt_logits gathers them over dims.tp_group
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(args.rope_theta) if float(args.rope_theta).is_integer() else args.rope_theta,
        pg_collection=dims.pg_collection,
        vp_stage=chunk if dims.vpp > 1 else None,
    )
    # WrappedTorchNorm builds RMSNorm weights in torch's default dtype, ignoring params_dtype;
    # cast so that every parameter has the model dtype (fp64 tests rely on it).
    model.to(device=dims.device, dtype=dtype)
    gather_before_output_layer(model)
    if dtype == torch.float64 or args.rope_scaling is not None:
        # RotaryEmbedding keeps inv_freq in fp32 whatever the model dtype and knows neither HF's
        # llama3 nor its yarn frequencies: set megarl's CausalLM ones (megarl/models/rope.py), so that
        # fp64 exactness tests see identical RoPE angles and scaled RoPE is HF's.
        rope = model.rotary_pos_emb
        calc = torch.promote_types(dtype, torch.float32)
        inv_freq, _ = inv_freq_and_scale(args.head_dim, args.rope_theta, args.rope_scaling, calc)
        rope.inv_freq = inv_freq.to(rope.inv_freq.device)
    return model


def load_state(model, local_sd: dict[str, torch.Tensor]) -> None:
    """Load this rank's local Megatron state dict (``mcore_sharding.shard_rank``) into ``model``:
    every tensor must match (``_extra_state`` entries excepted)."""
    missing, unexpected = model.load_state_dict(local_sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"Megatron model state mismatch: missing {missing}, unexpected {unexpected}")


def load_hf_state(model, hf_sd: dict[str, torch.Tensor], args: ModelArgs, dims: ParallelDims, chunk: int = 0) -> None:
    """Load this rank's piece of full HF-named weights into its stage/TP piece ``model`` (model
    chunk ``chunk`` with virtual stages)."""
    full = mcore_mapping.hf_to_mcore(hf_sd, args)
    stage = dims.stage(chunk)
    load_state(model, mcore_sharding.shard_rank(full, args, dims.tp, dims.stages, dims.tp_rank, stage,
                                                ep=dims.ep, ep_rank=dims.ep_rank))


@functools.cache
def sdpa_attention_class(attention: str = "sdpa"):
    """Megatron's local ``DotProductAttention`` with its forward on
    ``torch.nn.functional.scaled_dot_product_attention`` (causal; within its window in a sliding layer,
    Megatron's ``window_size`` / ``window_attn_skip_freq``), or on the engine's math (``"eager"``,
    :func:`_eager`): built on first use, so that importing this module does not import Megatron.

    Why: the local spec's attention materialises the scores and the probabilities as
    [b * heads, s, s] tensors (baddbmm into a global buffer, a masked fill with a [s, s] mask, a
    softmax, a bmm, and as many in the backward), which on CPU cost more than the rest of a small
    model's layer (measured: benchmarks/bench_trainer.py, docs/benchmarks.md). SDPA computes the
    same softmax(q k^T * scale) v with causal masking by position, blockwise (flash attention on
    CPU, also for fp64; flash / memory-efficient kernels on CUDA); the GQA groups are the same
    (query head i reads kv head i // (heads / groups), ``enable_gqa``).

    Packed sequences (``packed_seq_params`` in THD format, megarl/trainer/micro_batches.py):
    each sequence of the pack attends only to itself, causally, from its own position 0. The
    sequences' q, k, v are laid out right padded as [sequences, heads, longest, d] for one SDPA call
    (one ``index_copy`` there, one ``index_select`` back): the padding sits after each sequence's
    tokens, so causal attention never lets a real query see it, and only the attention pays for it
    (the projections and the MLP run on the packed tokens). Measured against one call per sequence
    (attention forward + backward alone, 64 long-tailed rows of 17-192 tokens, 2 threads, A/B
    alternated on the shared 2-core VM, CPU-time medians): 2.3x faster at 4 heads / 2 kv heads of
    width 32, 1.3x at SmolLM2's 9 / 3 of width 64 (docs/benchmarks.md, "Trainer speed").

    Only causal self-attention without dropout or attention bias, megarl's only use: the mask is
    the causal one by position and ``attention_mask`` is not read (pass None)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is invalid; valid choices: {list(ATTENTION)}")
    from megatron.core.transformer.utils import is_layer_window_attention

    class SdpaDotProductAttention(DotProductAttention):
        def __init__(self, config, layer_number, attn_mask_type, *args, **kwargs):
            super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
            if attn_mask_type != AttnMaskType.causal:
                raise ValueError(f"megarl's SDPA attention is causal only; got attn_mask_type={attn_mask_type}")
            if self.attention_dropout.p != 0.0 or self.softmax_offset is not None:
                raise ValueError("megarl's SDPA attention takes no attention dropout and no softmax offset")
            # This layer's sliding window (keys to the left; the layer number is global, 1-based).
            cfg = self.config
            self.left = (cfg.window_size[0] if is_layer_window_attention(
                cfg.window_size, cfg.window_attn_skip_freq, self.layer_number) else None)

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            """``query`` [s, b, heads, d], ``key``/``value`` [s, b, groups, d] (THD: [t, heads, d] /
            [t, groups, d]) -> [s, b, heads * d] (THD: [t, heads * d])."""
            if attention_bias is not None:
                raise ValueError("megarl's SDPA attention takes no attention bias")
            attend = functools.partial(ATTENTION[attention], scale=self.softmax_scale, left=self.left,
                                       gqa=query.shape[-2] != key.shape[-2])
            if packed_seq_params is None:
                # [s, b, n, d] -> [b, n, s, d] (views), and back to [s, b, n * d]
                out = attend(*(x.permute(1, 2, 0, 3) for x in (query, key, value)))
                return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
            return _packed_attention(attend, query, key, value, packed_seq_params)

    return SdpaDotProductAttention


def _sdpa(q, k, v, scale: float, left: int | None, gqa: bool) -> torch.Tensor:
    """SDPA over [b, n, s, d]: causal, and within ``left`` keys to the left in a sliding layer."""
    if left is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    s = q.shape[-2]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril().triu(-left)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _eager(q, k, v, scale: float, left: int | None, gqa: bool) -> torch.Tensor:
    """The engine's attention math over [b, n, s, d] (``megarl.models.llama.grouped_attention``:
    q kᵀ and P V in the model dtype, the softmax in fp32, rounded once): causal, and within
    ``left`` keys to the left in a sliding layer. A row's bits do not depend on the other rows or
    on the padding after it (the engine's batch invariance), so in bf16 a token's logprob is the
    engine's bit for bit. The [b, n, s, s] scores and probabilities are materialised: memory
    quadratic in the sequence length."""
    s = q.shape[-2]
    visible = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    if left is not None:
        visible = visible.triu(-left)
    return grouped_attention(q.transpose(1, 2), k, v, ~visible[None], scale=scale).transpose(1, 2)


# ``trainer.attention`` -> the core attention's function over [b, n, s, d]
ATTENTION = {"sdpa": _sdpa, "eager": _eager}


def _packed_attention(attend, query, key, value, packed_seq_params) -> torch.Tensor:
    """``attend`` over packed sequences (THD: ``query`` [t, heads, d], ``key``/``value`` [t, groups,
    d]), each right padded into one [sequences, heads, longest, d] batch -> [t, heads * d]."""
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(f"packed sequences in format {packed_seq_params.qkv_format!r}; valid: 'thd'")
    if query.dim() == 4:  # [t, 1, n, d]
        query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
    cu = packed_seq_params.cu_seqlens_q.long()
    t, n, width = query.shape[0], len(cu) - 1, int(packed_seq_params.max_seqlen_q)
    lengths = cu[1:] - cu[:-1]
    # where each packed token goes in the [n * width] padded layout: row * width + position
    slot = torch.arange(t, device=cu.device) + torch.repeat_interleave(
        torch.arange(n, device=cu.device) * width - cu[:-1], lengths, output_size=t)

    def padded(x):  # [t, heads, d] -> [n, heads, width, d]
        out = x.new_zeros(n * width, *x.shape[1:]).index_copy(0, slot, x)
        return out.view(n, width, *x.shape[1:]).transpose(1, 2)

    out = attend(padded(query), padded(key), padded(value))  # [n, heads, width, d]
    return out.transpose(1, 2).reshape(n * width, -1).index_select(0, slot)


class _GatherVocab(torch.autograd.Function):
    """All-gather vocab-parallel logits [..., V/tp] over ``group`` and keep the first ``vocab``
    entries. Backward: this rank's slice of the gradient, the padding's gradient dropped; like
    Megatron's ``gather_from_tensor_model_parallel_region`` it assumes every TP rank computes the
    same loss from the gathered logits. (Megatron's version allocates on the CUDA device.)"""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, vocab: int) -> torch.Tensor:
        ctx.rank, ctx.width, ctx.vocab = dist.get_rank(group), local.shape[-1], vocab
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)[..., :vocab]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lo = ctx.rank * ctx.width
        hi = min(lo + ctx.width, ctx.vocab)
        out = grad.new_zeros(*grad.shape[:-1], ctx.width)
        if hi > lo:
            out[..., :hi - lo] = grad[..., lo:hi]
        return out, None, None


def gather_logits(local_logits: torch.Tensor, tp_group, vocab_size: int) -> torch.Tensor:
    """Full-vocab logits [..., vocab_size] from this rank's vocab-parallel piece [..., Vp/tp]:
    gathered over ``tp_group`` (differentiable), the vocab padding stripped."""
    if dist.get_world_size(tp_group) == 1:
        return local_logits[..., :vocab_size]
    return _GatherVocab.apply(local_logits, tp_group, vocab_size)


def _positions_and_mask(input_ids: torch.Tensor) -> tuple[torch.Tensor, None]:
    """Position ids [B, T] and the attention mask: None, the core attention is causal by position
    (:func:`sdpa_attention_class`)."""
    b, t = input_ids.shape
    return torch.arange(t, device=input_ids.device).expand(b, t), None


def gpt_logits(model, input_ids: torch.Tensor, dims: ParallelDims | None = None,
               vocab_size: int | None = None) -> torch.Tensor:
    """Logits [B, T, V] of a (possibly DDP-wrapped) single-stage GPTModel on right-padded
    ``input_ids`` [B, T]. With TP > 1 pass ``dims`` and the true ``vocab_size``: the vocab-parallel
    logits are gathered over ``dims.tp_group`` and the padding stripped (differentiably).

    Right padding needs no padding mask: causal attention never lets a real token see the pads
    after it."""
    if dims is not None and dims.pp > 1:
        raise ValueError(f"gpt_logits runs one stage holding the whole model; with pp={dims.pp} "
                         f"use pipeline_logits (forward only)")
    input_ids = input_ids.to(next(model.parameters()).device)
    check_length(input_ids.shape[1], dims)
    logits = model(input_ids, *_positions_and_mask(input_ids))
    if dims is None or dims.tp == 1:
        return logits if vocab_size is None else logits[..., :vocab_size]
    if vocab_size is None:
        raise ValueError(f"gpt_logits with tp={dims.tp} needs vocab_size to strip the vocab padding")
    return gather_logits(logits, dims.tp_group, vocab_size)


@torch.no_grad()
def pipeline_logits(model, input_ids: torch.Tensor, dims: ParallelDims, vocab_size: int) -> torch.Tensor | None:
    """Forward-only pass through the pipeline: every stage of ``dims.pp_group`` calls this with the
    same ``input_ids`` [B, T] and its model (with virtual stages, the list of its ``dims.vpp`` model
    chunks). A stage other than the first receives the hidden states [T, B, h] from the previous
    stage (``set_input_tensor``), runs its layers and sends its output to the next stage (with
    virtual stages, the last pipeline rank's chunk hands on to the first rank's next chunk); the
    last stage returns the full-vocab logits [B, T, vocab_size] (gathered over TP), the others
    return None."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != dims.vpp:
        raise ValueError(f"pipeline_logits got {len(chunks)} model chunks; this rank holds vpp={dims.vpp}")
    check_length(input_ids.shape[1], dims)
    for c, m in enumerate(chunks):
        gpt = getattr(m, "module", m)
        device, dtype = next(gpt.parameters()).device, next(gpt.parameters()).dtype
        ids = input_ids.to(device)
        b, t = ids.shape
        stage = dims.stage(c)
        if stage > 0:
            hidden = torch.empty(local_length(t, dims), b, gpt.config.hidden_size, dtype=dtype, device=device)
            dist.recv(hidden, group=dims.pp_group, group_src=(dims.pp_rank - 1) % dims.pp)
            gpt.set_input_tensor(hidden)
        out = m(ids, *_positions_and_mask(ids))
        if stage == dims.stages - 1:
            return gather_logits(out, dims.tp_group, vocab_size)
        dist.send(out.contiguous(), group=dims.pp_group, group_dst=(dims.pp_rank + 1) % dims.pp)
    return None
