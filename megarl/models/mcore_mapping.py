"""HF <-> Megatron-core GPTModel state-dict names for the Llama / Qwen2 / Qwen3 family, dense and
MoE (Qwen3-MoE, Mixtral): the one mapping.

Megatron-core (local layer spec) names and layouts, per decoder layer ``i``:

=============================================================  ==========================================
Megatron-core                                                  HF
=============================================================  ==========================================
``embedding.word_embeddings.weight``                           ``model.embed_tokens.weight``
``decoder.layers.i.input_layernorm.weight``                    ``model.layers.i.input_layernorm.weight``
``decoder.layers.i.self_attention.linear_qkv.weight`` (+bias)  ``q_proj`` / ``k_proj`` / ``v_proj`` fused
``decoder.layers.i.self_attention.linear_proj.weight``         ``model.layers.i.self_attn.o_proj.weight``
``decoder.layers.i.pre_mlp_layernorm.weight``                  ``model.layers.i.post_attention_layernorm.weight``
``decoder.layers.i.mlp.linear_fc1.weight``                     ``cat(gate_proj, up_proj)`` along rows
``decoder.layers.i.mlp.linear_fc2.weight``                     ``model.layers.i.mlp.down_proj.weight``
``decoder.final_layernorm.weight``                             ``model.norm.weight``
``output_layer.weight`` (absent when tied)                     ``lm_head.weight`` (absent when tied)
=============================================================  ==========================================

Qwen3 / Qwen3-MoE add the per-head q/k RMSNorms; MoE layers (Qwen3-MoE, Mixtral) replace the dense
``mlp.*`` by a router and ``num_experts`` experts (Megatron's ``SequentialMLP``, expert ``e``):

=====================================================================  ===================================================
Megatron-core                                                          HF (Qwen3-MoE / Mixtral)
=====================================================================  ===================================================
``decoder.layers.i.self_attention.q_layernorm.weight`` (``k_``)        ``model.layers.i.self_attn.q_norm.weight`` (``k_``)
``decoder.layers.i.mlp.router.weight``                                 ``mlp.gate.weight`` / ``block_sparse_moe.gate.weight``
``decoder.layers.i.mlp.experts.local_experts.e.linear_fc1.weight``     ``cat(gate_proj, up_proj)`` / ``cat(w1, w3)``
``decoder.layers.i.mlp.experts.local_experts.e.linear_fc2.weight``     ``down_proj`` / ``w2`` of ``experts.e``
=====================================================================  ===================================================

An expert's ``linear_fc1`` is ``[gate; up]`` exactly like the dense one (each expert is a Megatron
``MLP``). Here ``e`` is the global expert index (EP=1); with EP > 1 each rank numbers its own
experts from 0 (:mod:`megarl.models.mcore_sharding`).

``linear_qkv`` rows are grouped per KV head, as ``SelfAttention.get_query_key_value_tensors``
splits them: for each group ``g`` of ``num_key_value_heads``, the ``r = heads / kv_heads`` query
heads of that group (query heads ``g*r .. g*r+r-1``, the ones HF's ``repeat_kv`` pairs with kv head
``g``), then ``k_g``, then ``v_g``, each ``head_dim`` rows. ``linear_fc1`` is ``[gate; up]``, which
Megatron's swiglu splits with ``chunk(2, dim=-1)`` into ``silu(first) * second``.

The mapping is pure reshaping (``view``/``cat``/``split``), so ``mcore_to_hf(hf_to_mcore(sd))`` is
bitwise ``sd``. Megatron's ``*._extra_state`` entries (TE/FP8 metadata) are ignored on input and
never produced. Works on full (unsharded, TP=1) tensors; TP/PP sharding is a later layer on top.
"""
from __future__ import annotations

import torch

from megarl.models.config import ModelArgs

_EXTRA_STATE = "_extra_state"


# HF names of an MoE block per model type: (block, (gate, up, down) names of an expert's linears).
_MOE_HF_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}


def _layer_names(args: ModelArgs, i: int) -> tuple[dict[str, str], str, dict[str, tuple[str, str]]]:
    """(1:1 renames HF->mcore, mcore qkv prefix, fused fc1 names: mcore -> (HF gate, HF up)) of
    layer ``i``: one fc1 for a dense layer, one per expert for an MoE layer."""
    hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
    renames = {
        hf + "input_layernorm.weight": mc + "input_layernorm.weight",
        hf + "self_attn.o_proj.weight": mc + "self_attention.linear_proj.weight",
        hf + "post_attention_layernorm.weight": mc + "pre_mlp_layernorm.weight",
    }
    if args.qk_norm:
        renames[hf + "self_attn.q_norm.weight"] = mc + "self_attention.q_layernorm.weight"
        renames[hf + "self_attn.k_norm.weight"] = mc + "self_attention.k_layernorm.weight"
    if not args.is_moe:
        renames[hf + "mlp.down_proj.weight"] = mc + "mlp.linear_fc2.weight"
        return renames, mc + "self_attention.linear_qkv.", {
            mc + "mlp.linear_fc1.weight": (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")}
    block, (gate, up, down) = _MOE_HF_NAMES[args.model_type]
    renames[hf + f"{block}.gate.weight"] = mc + "mlp.router.weight"
    fc1 = {}
    for e in range(args.num_experts):
        he, me = hf + f"{block}.experts.{e}.", mc + f"mlp.experts.local_experts.{e}."
        renames[he + f"{down}.weight"] = me + "linear_fc2.weight"
        fc1[me + "linear_fc1.weight"] = (he + f"{gate}.weight", he + f"{up}.weight")
    return renames, mc + "self_attention.linear_qkv.", fc1


def _global_renames(args: ModelArgs) -> dict[str, str]:
    renames = {
        "model.embed_tokens.weight": "embedding.word_embeddings.weight",
        "model.norm.weight": "decoder.final_layernorm.weight",
    }
    if not args.tie_word_embeddings:
        renames["lm_head.weight"] = "output_layer.weight"
    return renames


def hf_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of ``args``'s model with its shape (the names ``CausalLM`` uses)."""
    h, d, nq, nkv, ff = (args.hidden_size, args.head_dim, args.num_attention_heads,
                         args.num_key_value_heads, args.intermediate_size)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, h)
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, heads in (("q_proj", nq), ("k_proj", nkv), ("v_proj", nkv)):
            shapes[p + f"self_attn.{name}.weight"] = (heads * d, h)
            if args.qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (heads * d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, nq * d)
        if args.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if not args.is_moe:
            shapes[p + "mlp.gate_proj.weight"] = (ff, h)
            shapes[p + "mlp.up_proj.weight"] = (ff, h)
            shapes[p + "mlp.down_proj.weight"] = (h, ff)
            continue
        block, (gate, up, down) = _MOE_HF_NAMES[args.model_type]
        shapes[p + f"{block}.gate.weight"] = (args.num_experts, h)
        eff = args.moe_intermediate_size
        for e in range(args.num_experts):
            pe = p + f"{block}.experts.{e}."
            shapes[pe + f"{gate}.weight"] = (eff, h)
            shapes[pe + f"{up}.weight"] = (eff, h)
            shapes[pe + f"{down}.weight"] = (h, eff)
    return shapes


def mcore_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every Megatron-core GPTModel (local spec, TP=1) tensor name of ``args`` with its shape."""
    hf = hf_shapes(args)
    shapes = {mc: hf[name] for name, mc in _global_renames(args).items()}
    d, nq, nkv = args.head_dim, args.num_attention_heads, args.num_key_value_heads
    for i in range(args.num_hidden_layers):
        renames, qkv, fc1 = _layer_names(args, i)
        shapes.update({mc: hf[name] for name, mc in renames.items()})
        shapes[qkv + "weight"] = ((nq + 2 * nkv) * d, args.hidden_size)
        if args.qkv_bias:
            shapes[qkv + "bias"] = ((nq + 2 * nkv) * d,)
        for mc, (gate, _) in fc1.items():
            shapes[mc] = (2 * hf[gate][0], args.hidden_size)
    return shapes


class StateDictMismatch(KeyError, ValueError):
    """Missing or unexpected tensors (a KeyError for lookups, a ValueError for bad input)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def check_state_dict(sd: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], side: str) -> None:
    """Raise naming the first tensors that are missing, unexpected or misshaped
    (``_extra_state`` entries ignored)."""
    keys = {k for k in sd if not k.endswith(_EXTRA_STATE)}
    missing = sorted(set(expected) - keys)
    unexpected = sorted(keys - set(expected))
    if missing or unexpected:
        raise StateDictMismatch(f"{side} state dict does not match the model config: "
                       f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                       f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    for k, shape in expected.items():
        if tuple(sd[k].shape) != shape:
            raise ValueError(f"{side} tensor {k} has shape {tuple(sd[k].shape)}, expected {shape}")


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """HF q/k/v (weights [heads*d, h] or biases [heads*d]) -> Megatron's per-group interleave."""
    nkv, d = args.num_key_value_heads, args.head_dim
    r = args.num_attention_heads // nkv
    tail = q.shape[1:]
    groups = torch.cat([q.reshape(nkv, r * d, *tail), k.reshape(nkv, d, *tail),
                        v.reshape(nkv, d, *tail)], dim=1)  # [nkv, (r+2)*d, ...]
    return groups.reshape(-1, *tail)


def _split_qkv(qkv: torch.Tensor, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nkv, d = args.num_key_value_heads, args.head_dim
    r = args.num_attention_heads // nkv
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(nkv, (r + 2) * d, *tail).split([r * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_mcore(hf_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF-named full tensors -> Megatron-core GPTModel state dict (no ``_extra_state``).

    A tied model's HF dict may carry ``lm_head.weight`` (some exporters write it); it must then
    equal the embedding and is dropped."""
    hf_sd = dict(hf_sd)
    if args.tie_word_embeddings and "lm_head.weight" in hf_sd:
        lm = hf_sd.pop("lm_head.weight")
        emb = hf_sd.get("model.embed_tokens.weight")
        if emb is None or not torch.equal(lm, emb):
            raise ValueError("tied model: lm_head.weight is present and differs from model.embed_tokens.weight")
    check_state_dict(hf_sd, hf_shapes(args), "HF")
    out = {mc: hf_sd[name] for name, mc in _global_renames(args).items()}
    for i in range(args.num_hidden_layers):
        renames, qkv, fc1 = _layer_names(args, i)
        out.update({mc: hf_sd[name] for name, mc in renames.items()})
        p = f"model.layers.{i}."
        kinds = ("weight", "bias") if args.qkv_bias else ("weight",)
        for kind in kinds:
            out[qkv + kind] = _fuse_qkv(*(hf_sd[p + f"self_attn.{n}.{kind}"] for n in ("q_proj", "k_proj", "v_proj")),
                                        args)
        for mc, (gate, up) in fc1.items():
            out[mc] = torch.cat([hf_sd[gate], hf_sd[up]], dim=0)
    return out


def mcore_to_hf(mcore_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Megatron-core GPTModel state dict -> HF-named tensors (``_extra_state`` ignored). Outputs may
    be views of the inputs; callers that keep them while training clone first."""
    check_state_dict(mcore_sd, mcore_shapes(args), "Megatron-core")
    out = {name: mcore_sd[mc] for name, mc in _global_renames(args).items()}
    for i in range(args.num_hidden_layers):
        renames, qkv, fc1 = _layer_names(args, i)
        out.update({name: mcore_sd[mc] for name, mc in renames.items()})
        p = f"model.layers.{i}."
        kinds = ("weight", "bias") if args.qkv_bias else ("weight",)
        for kind in kinds:
            q, k, v = _split_qkv(mcore_sd[qkv + kind], args)
            out.update({p + f"self_attn.q_proj.{kind}": q, p + f"self_attn.k_proj.{kind}": k,
                        p + f"self_attn.v_proj.{kind}": v})
        for mc, (gate, up) in fc1.items():
            out[gate], out[up] = mcore_sd[mc].chunk(2, dim=0)
    return out


def mcore_to_hf_names(args: ModelArgs) -> dict[str, tuple[str, ...]]:
    """For every full Megatron-core tensor name of ``args``'s model, the HF names it becomes, in
    order: ``(q, k, v)`` for ``linear_qkv``, ``(gate, up)`` for ``linear_fc1``, one name otherwise
    (the name map of :func:`mcore_to_hf`, for converting one tensor at a time)."""
    out = {mc: (name,) for name, mc in _global_renames(args).items()}
    for i in range(args.num_hidden_layers):
        renames, qkv, fc1 = _layer_names(args, i)
        out.update({mc: (name,) for name, mc in renames.items()})
        p = f"model.layers.{i}.self_attn."
        for kind in (("weight", "bias") if args.qkv_bias else ("weight",)):
            out[qkv + kind] = tuple(p + f"{n}.{kind}" for n in ("q_proj", "k_proj", "v_proj"))
        out.update({mc: names for mc, names in fc1.items()})
    return out


def mcore_tensor_to_hf(name: str, tensor: torch.Tensor, args: ModelArgs,
                       hf_names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """One full Megatron-core tensor -> its HF-named tensors, as :func:`mcore_to_hf` converts it
    (bitwise). ``hf_names``: its entry of :func:`mcore_to_hf_names` (looked up when None; pass it
    when converting many tensors). The q/k/v of a fused qkv are copies; the rest are views."""
    if hf_names is None:
        hf_names = mcore_to_hf_names(args).get(name)
        if hf_names is None:
            raise KeyError(f"{name!r} is not a Megatron-core tensor name of this model")
    if ".self_attention.linear_qkv." in name:
        return dict(zip(hf_names, _split_qkv(tensor, args)))
    if name.endswith("linear_fc1.weight"):
        return dict(zip(hf_names, tensor.chunk(2, dim=0)))
    (hf_name,) = hf_names
    return {hf_name: tensor}


def hf_tensors_to_mcore(name: str, tensors: tuple[torch.Tensor, ...], args: ModelArgs) -> torch.Tensor:
    """The inverse of :func:`mcore_tensor_to_hf`: the HF tensors of Megatron tensor ``name`` (in
    :func:`mcore_to_hf_names` order) -> that tensor, as :func:`hf_to_mcore` builds it (bitwise).
    Also builds a TP piece of ``linear_qkv`` / ``linear_fc1`` from the matching row ranges of the HF
    tensors when ``args`` carries that piece's head counts (whole KV-head groups per piece)."""
    if ".self_attention.linear_qkv." in name:
        return _fuse_qkv(*tensors, args)
    if name.endswith("linear_fc1.weight"):
        return torch.cat(tensors, dim=0)
    (tensor,) = tensors
    return tensor
