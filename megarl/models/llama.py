"""Llama / Qwen2 decoder in plain torch, for the rollout engine and for reference checks.

Parameter names are exactly the Hugging Face names (``model.layers.0.self_attn.q_proj.weight``,
...), so a HF safetensors file loads with ``load_state_dict`` and the weight sync from the
trainer speaks the same names (DESIGN.md §3).

Attention is pluggable: every layer computes q/k/v (RoPE applied) and hands them to an
*attention backend* ``attn(layer_idx, q, k, v) -> out`` with shapes ``[B, T, H, D]``. Without
one, plain causal attention over the given tokens is used. The engine passes a backend that
writes k/v into its KV cache and attends over the cached prefix, so the model never knows how
the cache is laid out.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megarl.models.config import ModelArgs


class AttentionBackend(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (RoPE applied). Returns [B, T, Hq, D]."""


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Reference attention. q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D]; mask: bool [B or 1, Tq, Tk]
    (True = may attend). Softmax runs in at least fp32, as in HF's eager attention."""
    n_rep = q.shape[2] // k.shape[2]
    if n_rep > 1:  # GQA: query head h reads kv head h // n_rep (HF's repeat_kv)
        k = k.repeat_interleave(n_rep, dim=2)
        v = v.repeat_interleave(n_rep, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
    sm_dtype = torch.promote_types(scores.dtype, torch.float32)
    probs = torch.softmax(scores.to(sm_dtype), dim=-1).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2)


def causal_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Default backend: each token attends to itself and the tokens before it in the same row."""
    t = q.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()[None]
    return attention(q, k, v, mask)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin of shape [B, T, 1, D] for the rotate-half RoPE convention used by HF Llama/Qwen2."""
    calc = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device)
                                .to(calc) / head_dim))
    freqs = positions.to(calc)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        h, d = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=args.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=args.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=args.o_bias)

    def forward(self, x, cos, sin, attn: AttentionBackend):
        b, t, _ = x.shape
        q = apply_rope(self.q_proj(x).view(b, t, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, t, self.n_kv, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    """``model.*`` / ``lm_head`` modules named as in HF; ``lm_head`` is absent when tied."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = DecoderModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      attn: AttentionBackend | None = None) -> torch.Tensor:
        """Final-norm hidden states [B, T, H] of ``input_ids`` [B, T] at ``positions`` [B, T]."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, x.dtype)
        attn = attn or causal_attention
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight)

    def forward(self, input_ids, positions=None, attn=None):
        return self.logits(self.hidden_states(input_ids, positions, attn))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under their HF names (tied ``lm_head.weight`` omitted, as HF saves it)."""
        return {k: v for k, v in self.state_dict().items()}
