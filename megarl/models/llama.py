"""Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral decoder in plain torch, for the rollout engine and
for reference checks.

Parameter names are exactly the Hugging Face names (``model.layers.0.self_attn.q_proj.weight``,
...), so a HF safetensors file loads with ``load_state_dict`` and the weight sync from the
trainer speaks the same names (docs/design.md §2).

Attention is pluggable: every layer computes q/k/v (RoPE applied) and hands them to an
*attention backend* ``attn(layer_idx, q, k, v) -> out`` with shapes ``[B, T, H, D]``. Without
one, plain causal attention over the given tokens is used. The engine passes a backend that
writes k/v into its KV cache and attends over the cached prefix, so the model never knows how
the cache is laid out.

MoE layers (Qwen3-MoE ``mlp.gate`` + ``mlp.experts.E.{gate,up,down}_proj``, Mixtral
``block_sparse_moe.gate`` + ``block_sparse_moe.experts.E.{w1,w3,w2}``) route each token on its own
hidden state and never drop tokens, so a token's output depends on that token only: the engine's
batch composition cannot change it (docs/design.md §1).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megarl.models.config import ModelArgs
from megarl.models.packed_linear import Linear, linear
from megarl.models.rope import inv_freq_and_scale


class AttentionBackend(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (RoPE applied). Returns [B, T, Hq, D]."""


# torch's CPU softmax reduces a row shorter than one vector (16 fp32 lanes with AVX-512, 8 with
# AVX2) in another order than a longer row, so without padding a row's probabilities would depend
# on how many hidden keys pad it: the batch's longest row in the engine, the micro-batch's in the
# trainer. Rows of fewer keys get hidden ones up to this width; from one vector up, hidden keys
# (exp = 0) add exact zeros to their lanes and change no bit (tests/models/test_attention_math.py).
MIN_SOFTMAX_KEYS = 16


def masked_softmax(scores: torch.Tensor, masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """softmax over the last dim of ``scores`` with ``masked`` (True = hidden, broadcastable) keys
    at probability 0, computed in at least fp32 and rounded once to ``dtype`` (HF's eager
    attention); the same bits for a row whatever the number of hidden keys after its own."""
    scores = scores.masked_fill(masked, float("-inf"))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    s = scores.shape[-1]
    if s < MIN_SOFTMAX_KEYS:
        pad = scores.new_full((*scores.shape[:-1], MIN_SOFTMAX_KEYS - s), float("-inf"))
        return torch.softmax(torch.cat((scores, pad), -1), dim=-1)[..., :s].to(dtype)
    return torch.softmax(scores, dim=-1).to(dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Reference attention. q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D]; mask: bool [B or 1, Tq, Tk]
    (True = may attend). Softmax runs in at least fp32, as in HF's eager attention."""
    n_rep = q.shape[2] // k.shape[2]
    if n_rep > 1:  # GQA: query head h reads kv head h // n_rep (HF's repeat_kv)
        k = k.repeat_interleave(n_rep, dim=2)
        v = v.repeat_interleave(n_rep, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    hidden = torch.zeros((), dtype=torch.bool, device=q.device) if mask is None else ~mask[:, None]
    return torch.matmul(masked_softmax(scores, hidden, q.dtype), v).transpose(1, 2)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
    """Attention over keys in the KV cache's head-major layout, the math of :func:`attention`
    without its copies: GQA by folding the query heads of one kv head into the query rows
    (instead of repeating k/v), k/v read in place. The engine's attention on CPU, and the
    trainer's with ``trainer.attention: eager`` (megarl/trainer/model.py), so that the two
    compute a token's logprob with the same bits (docs/design.md §1.3).

    q: [B, T, Hq, D] (any strides); k, v: [B, Hkv, S, D] (any batch stride); masked: bool
    [B or 1, T, S], True = may not attend; ``scale``: of q kᵀ, D ** -0.5 by default. Returns
    [B, T, Hq, D]."""
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    rep = hq // hkv  # query head h reads kv head h // rep (HF's repeat_kv)
    qg = q.reshape(b, t, hkv, rep, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, rep * t, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)  # [B, Hkv, rep*T, S]
    probs = masked_softmax(scores.view(b, hkv, rep, t, s), masked[:, None, None], q.dtype)
    out = torch.matmul(probs.view(b, hkv, rep * t, s), v)  # [B, Hkv, rep*T, D]
    return out.view(b, hkv, rep, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, hq, d)


def causal_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Default backend: each token attends to itself and the tokens before it in the same row."""
    t = q.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()[None]
    return attention(q, k, v, mask)


class WindowedCausalAttention:
    """Default backend of a sliding-window model: causal, and in a sliding layer (window w) each
    token sees only itself and the w - 1 tokens before it (HF's sliding_window_overlay)."""

    handles_window = True  # CausalLM refuses a backend of a sliding-window model without this

    def __init__(self, args: ModelArgs):
        self.args = args

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t, window = q.shape[1], self.args.window(layer_idx)
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        if window is not None:
            mask = mask.triu(1 - window)  # key j visible from query i iff i - window < j
        return attention(q, k, v, mask[None])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused norm, which Megatron's torch-only RMSNorm also calls: statistics in at
        # least fp32 and one rounding of (x * rsqrt(mean x² + eps) * weight) to x's dtype. HF's
        # eager norm rounds twice in bf16 (the normalised x, then times the weight); one rounding
        # is closer to exact and makes the bf16 engine's norm the bf16 trainer's bit for bit.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: dict | None = None):
    """cos and signed sin, each [B, T, 1, D], for the rotate-half RoPE convention used by HF
    Llama/Qwen2 (``apply_rope``); ``scaling``: a llama3/yarn ``ModelArgs.rope_scaling``
    (megarl/models/rope.py), None for plain RoPE. The sin's first half is negated: rotate-half's
    sign, folded in once per forward instead of a negation of q and k in every layer (``-a * b``
    and ``a * -b`` are the same float, so the result is HF's bit for bit)."""
    calc = torch.promote_types(dtype, torch.float32)
    inv_freq, scale = inv_freq_and_scale(head_dim, theta, scaling, calc, positions.device)
    freqs = positions.to(calc)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    sin = (emb.sin() * scale).to(dtype)
    half = head_dim // 2
    return (emb.cos() * scale).to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for linears that read the same input, their rows stacked, with each
    linear's ``weight``/``bias`` re-pointed to a view of it: one matmul instead of several (fewer
    dispatches per layer, a wider and better-used GEMM), while the parameters keep their HF names
    and ``copy_`` into them (``load_weights``, the weight sync) writes the fused tensor. Each
    output column is the same dot product over the same inputs, and on the CPU kernels used here
    the stacked matmul gives the separate ones' values bit for bit (tests/engine/test_fused.py);
    the exactness contract does not depend on it (plain and speculative decoding both use it).
    A later ``module.to()`` that converts the parameters replaces the views: fuse again after it."""
    weight = torch.cat([m.weight.detach() for m in linears])
    biases = [m.bias for m in linears]
    bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
    if any(b is not None for b in biases) and bias is None:
        raise ValueError("fuse_linears: every linear needs a bias, or none")
    off = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[off:off + n]
        if bias is not None:
            m.bias.data = bias[off:off + n]
        off += n
    return weight, bias


def _fused_is_current(fused, first: nn.Linear) -> bool:
    """Whether ``fused`` (from ``fuse_linears``) still backs ``first``'s weight."""
    return fused is not None and first.weight.data_ptr() == fused[0].data_ptr() \
        and first.weight.dtype == fused[0].dtype and first.weight.device == fused[0].device


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with ``sin`` signed as ``rope_cos_sin`` returns it:
    rotate_half(x) = cat(-x2, x1), so rotate_half(x) * sin = cat(x2, x1) * signed sin, exactly."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        h, d = args.hidden_size, args.head_dim
        self.q_proj = Linear(h, self.n_heads * d, bias=args.qkv_bias)
        self.k_proj = Linear(h, self.n_kv * d, bias=args.qkv_bias)
        self.v_proj = Linear(h, self.n_kv * d, bias=args.qkv_bias)
        self.o_proj = Linear(self.n_heads * d, h, bias=args.o_bias)
        self._qkv = None  # (weight, bias) of fuse(), when fused

    def fuse(self) -> None:
        """Run q/k/v as one matmul from now on (``fuse_linears``)."""
        if not _fused_is_current(self._qkv, self.q_proj):
            self._qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v projections of ``x`` [B, T, H] (one matmul once fused), heads unflattened."""
        b, t, _ = x.shape
        if _fused_is_current(self._qkv, self.q_proj):
            q, k, v = linear(x, *self._qkv).split(
                [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.view(b, t, self.n_heads, self.head_dim), k.view(b, t, self.n_kv, self.head_dim),
                v.view(b, t, self.n_kv, self.head_dim))

    def forward(self, x, cos, sin, attn: AttentionBackend):
        b, t, _ = x.shape
        if _fused_is_current(self._qkv, self.q_proj):
            # q and k sit side by side in the fused projection's output: RoPE runs once over both
            # heads (elementwise, so each value is what separate calls give; 4 kernels, not 8).
            qkv = linear(x, *self._qkv)
            n_qk = (self.n_heads + self.n_kv) * self.head_dim
            qk = apply_rope(qkv[..., :n_qk].view(b, t, self.n_heads + self.n_kv, self.head_dim), cos, sin)
            q, k = qk.split([self.n_heads, self.n_kv], dim=2)
            v = qkv[..., n_qk:].view(b, t, self.n_kv, self.head_dim)
        else:
            q, k, v = self.project(x)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))


class QKNormAttention(Attention):
    """Qwen3 attention: each query and key head is RMS-normalised over ``head_dim`` (``q_norm`` /
    ``k_norm``, one weight shared by all heads) before RoPE. A subclass, so that Llama/Qwen2
    attention runs its own forward untouched."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(self, x, cos, sin, attn: AttentionBackend):
        b, t, _ = x.shape
        q, k, v = self.project(x)
        q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, intermediate_size: int | None = None):
        super().__init__()
        ff = intermediate_size or args.intermediate_size
        self.gate_proj = Linear(args.hidden_size, ff, bias=False)
        self.up_proj = Linear(args.hidden_size, ff, bias=False)
        self.down_proj = Linear(ff, args.hidden_size, bias=False)
        self._gate_up = None  # (weight, None) of fuse(), when fused

    def fuse(self) -> None:
        """Run gate and up as one matmul from now on (``fuse_linears``)."""
        if not _fused_is_current(self._gate_up, self.gate_proj):
            self._gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x):
        if _fused_is_current(self._gate_up, self.gate_proj):
            gate, up = linear(x, self._gate_up[0]).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MixtralExpert(nn.Module):
    """One Mixtral expert: the SwiGLU MLP under HF Mixtral's names (w1 = gate, w3 = up, w2 = down)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = Linear(args.hidden_size, args.moe_intermediate_size, bias=False)
        self.w3 = Linear(args.hidden_size, args.moe_intermediate_size, bias=False)
        self.w2 = Linear(args.moe_intermediate_size, args.hidden_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Top-k routed experts without a shared expert (Qwen3-MoE / Mixtral), HF's math exactly:
    router logits ``gate(x)`` in the model dtype; softmax over all experts in at least fp32 (HF
    forces fp32; fp64 stays fp64 for the exactness tests); the top-k of those probabilities,
    renormalised to sum 1 when ``norm_topk_prob``; the weights cast to the model dtype; the output
    ``sum_j w_j * expert_j(x)`` accumulated from zeros in ascending expert order.

    Every step is per token and no token is ever dropped (no capacity), so a token's output is a
    function of that token alone. The (token, expert) pairs are sorted by expert once; the loop
    runs over the experts that received tokens, each on its contiguous rows, and ``index_add_``s
    its weighted output into the tokens' rows. An expert adds at most once to a token, so the
    order of a token's sum is the loop's (ascending experts, as in HF) on every backend."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = (args.num_experts, args.num_experts_per_tok,
                                                             args.norm_topk_prob)
        self.gate = Linear(args.hidden_size, args.num_experts, bias=False)
        if args.model_type == "mixtral":
            self.experts = nn.ModuleList(MixtralExpert(args) for _ in range(args.num_experts))
        else:
            self.experts = nn.ModuleList(MLP(args, args.moe_intermediate_size) for _ in range(args.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing of tokens ``x`` [N, H]: (weights [N, k] in x's dtype, expert ids [N, k])."""
        logits = self.gate(x)
        probs = torch.softmax(logits.to(torch.promote_types(x.dtype, torch.float32)), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.route(x)
        flat = experts.flatten()  # entry n*k + j: token n's j-th expert
        order = torch.argsort(flat, stable=True)  # grouped by expert, tokens ascending in a group
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        picked = x.index_select(0, tokens)
        w = weights.flatten().index_select(0, order)[:, None]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                out.index_add_(0, tokens[rows], self.experts[e](picked[rows]) * w[rows])
                start += n
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = (QKNormAttention if args.qk_norm else Attention)(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = SparseMoE(args) if args.is_moe else MLP(args)

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class MixtralDecoderLayer(nn.Module):
    """Mixtral's layer: the same computation, with HF's name ``block_sparse_moe`` for the MoE block."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.block_sparse_moe = SparseMoE(args)

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        layer = MixtralDecoderLayer if args.model_type == "mixtral" else DecoderLayer
        self.layers = nn.ModuleList(layer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    """``model.*`` / ``lm_head`` modules named as in HF; ``lm_head`` is absent when tied."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = DecoderModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      attn: AttentionBackend | None = None) -> torch.Tensor:
        """Final-norm hidden states [B, T, H] of ``input_ids`` [B, T] at ``positions`` [B, T]."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, x.dtype, self.args.rope_scaling)
        if attn is None:
            attn = causal_attention if self.args.sliding_window is None else WindowedCausalAttention(self.args)
        elif self.args.sliding_window is not None and not getattr(attn, "handles_window", False):
            raise ValueError(f"this model has sliding-window layers (sliding_window={self.args.sliding_window}) "
                             f"and the attention backend {type(attn).__name__} does not apply windows")
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head_weight)

    def forward(self, input_ids, positions=None, attn=None):
        return self.logits(self.hidden_states(input_ids, positions, attn))

    def fuse_projections(self) -> "CausalLM":
        """Fuse every layer's q/k/v and gate/up linears (``fuse_linears``; the engine does this
        after moving the model to its device and dtype). Returns self."""
        for m in self.modules():
            if isinstance(m, (Attention, MLP)):
                m.fuse()
        return self

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under their HF names (tied ``lm_head.weight`` omitted, as HF saves it)."""
        return {k: v for k, v in self.state_dict().items()}
