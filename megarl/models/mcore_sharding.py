"""Full Megatron-core GPTModel state dict <-> the local state dicts of every TP x PP (x EP) rank.

The full dict is :func:`megarl.models.mcore_mapping.hf_to_mcore`'s output (TP=1, PP=1, EP=1 names
and shapes). :func:`shard` cuts it into exactly what Megatron-core 0.16.1's ``GPTModel`` (local
layer spec, as built by ``megarl.trainer.model.build_gpt_model``) holds on rank ``(tp_rank,
pp_rank)`` (``(tp_rank, pp_rank, ep_rank)`` with expert parallelism); :func:`merge` puts the
pieces back. Pure tensor code: no torch.distributed.

Tensor parallel layout (``t = tp``, rank ``k`` holds the ``k``-th of ``t`` equal pieces):

=====================================================  ========  ==========================================
tensor                                                 Megatron  rank ``k`` holds
=====================================================  ========  ==========================================
``embedding.word_embeddings.weight`` [V, h]            vocab     rows ``k*Vp/t .. (k+1)*Vp/t`` of the vocab
                                                                 padded with zero rows to ``Vp``
``output_layer.weight`` [V, h]                         column    same as the embedding
``self_attention.linear_qkv.weight`` [(q+2kv)*d, h]    column    rows of KV-head groups ``k*kv/t ..``: whole
(and ``.bias``)                                                  groups ``[q heads of g; k_g; v_g]``
``self_attention.linear_proj.weight`` [h, q*d]         row       columns of query heads ``k*q/t ..``
``mlp.linear_fc1.weight`` [2*ff, h] = [gate; up]       column    ``[gate rows k; up rows k]`` (gate and up
                                                                 split separately, then concatenated)
``mlp.linear_fc2.weight`` [h, ff]                      row       columns ``k*ff/t .. (k+1)*ff/t``
``*layernorm.weight`` [h] (and q/k ``[head_dim]``)     --        replicated (a full copy on every rank)
``mlp.router.weight`` [E, h]                           --        replicated
``mlp.experts.local_experts.j.linear_fc1.weight``      column    like the dense fc1 (expert TP size = tp)
``mlp.experts.local_experts.j.linear_fc2.weight``      row       like the dense fc2
=====================================================  ========  ==========================================

Why these cuts: a column-parallel linear computes output features ``rows(k)`` of its weight on
rank ``k`` and the next row-parallel linear consumes exactly those features as its input columns
``cols(k)``. Megatron's attention reads its local qkv rows as ``kv/t`` complete groups (it splits
each group into its query heads, key, value), so qkv must be cut at group boundaries, and the
query heads of those groups are the input columns of the local ``linear_proj``. Megatron's
swiglu ``chunk(2)``s the local fc1 output into ``silu(gate) * up``, so each rank needs its own
halves of gate and up stacked: a plain row cut of ``[gate; up]`` would give rank 0 only gate.

Vocab padding: ``VocabParallelEmbedding`` and the output ``ColumnParallelLinear`` split the vocab
into equal pieces, so with TP > 1 the vocab is padded to :func:`padded_vocab` (a multiple of
``vocab_multiple * tp``, Megatron's ``make_vocab_size_divisible_by`` convention) with zero rows.
Padded ids are never fed and their logits are stripped after the TP gather, so the padding rows'
values never matter; :func:`merge` drops them. With TP=1 nothing is padded: megarl's TP=1 model
(and its checkpoints) always had the exact vocab.

Expert layout (``ep`` ranks, MoE models): ``ep`` divides ``num_experts = E``; EP rank ``r`` holds
the experts ``r*E/ep .. (r+1)*E/ep - 1`` of every layer of its stage, renumbered from 0
(``mlp.experts.local_experts.<j>`` is global expert ``r*E/ep + j``: Megatron's
``local_expert_indices``), each cut over TP like a dense MLP. Everything else, the router
included, is the same on every EP rank (the EP ranks are data-parallel ranks of the dense part);
:func:`merge` checks that those copies are bitwise equal.

Pipeline layout (``p = pp`` stages, ``n = num_hidden_layers``, ``p`` divides ``n``): stage ``s``
holds layers ``s*n/p .. (s+1)*n/p - 1`` renumbered from 0 (``decoder.layers.<local>``: the
TransformerBlock's ``ModuleList`` index; only each layer's ``layer_number`` attribute is global).
``embedding.word_embeddings.weight`` is on stage 0 only; ``decoder.final_layernorm.weight`` and
``output_layer.weight`` on the last stage only. With tied embeddings and PP > 1 the last stage's
output layer allocates its own weight (``skip_weight_param_allocation`` is only set where the
embedding lives), so Megatron keeps a copy of the (padded, vocab-parallel) word embeddings on the
last stage under the key ``output_layer.weight``; stage 0 and the last stage keep the two copies
equal (Megatron all-reduces the copy from stage 0 at init, then their gradients every step).
:func:`merge` checks that the two copies, and each replicated tensor across TP ranks, are
bitwise equal: a difference means the pieces do not come from one model.

Virtual pipeline stages (interleaved 1F1B, ``vpp`` chunks per pipeline rank): the layers are cut
into ``pp * vpp`` stages exactly as above, and stage ``s`` is model chunk ``s // pp`` of pipeline
rank ``s % pp`` (Megatron's layout: ``get_transformer_layer_offset`` with ``vp_stage``; each
chunk numbers its layers from 0). A chunk's local state dict is therefore the piece of stage ``s``
of a ``pp * vpp``-stage cut: the functions here take that stage count as ``pp`` and the stage as
``pp_rank`` (``ParallelDims.stages`` and ``ParallelDims.stage(chunk)``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.models import mcore_mapping
from megarl.models.config import ModelArgs

Rank = tuple[int, ...]  # (tp_rank, pp_rank), with ep_rank appended when ep > 1

_EMB = "embedding.word_embeddings.weight"
_OUT = "output_layer.weight"
_FINAL_NORM = "decoder.final_layernorm.weight"

# Kind of each per-layer tensor (name after ``decoder.layers.<i>.``); absent ones are skipped.
_LAYER_KINDS = {
    "input_layernorm.weight": "replicated",
    "self_attention.linear_qkv.weight": "qkv",
    "self_attention.linear_qkv.bias": "qkv",
    "self_attention.linear_proj.weight": "row",
    "self_attention.q_layernorm.weight": "replicated",
    "self_attention.k_layernorm.weight": "replicated",
    "pre_mlp_layernorm.weight": "replicated",
    "mlp.linear_fc1.weight": "fc1",
    "mlp.linear_fc2.weight": "row",
    "mlp.router.weight": "replicated",
}
# Kind of each tensor of an MoE expert (name after ``decoder.layers.<i>.mlp.experts.local_experts.<e>.``).
_EXPERT_KINDS = {"linear_fc1.weight": "fc1", "linear_fc2.weight": "row"}
_EXPERTS = "mlp.experts.local_experts."


def _expert_key(layer: int, expert: int, name: str) -> str:
    return f"decoder.layers.{layer}.{_EXPERTS}{expert}.{name}"


def _rank_key(tp_rank: int, pp_rank: int, ep_rank: int, ep: int) -> Rank:
    return (tp_rank, pp_rank) if ep == 1 else (tp_rank, pp_rank, ep_rank)


def _rank_name(rank: Rank) -> str:
    return ", ".join(f"{n}={r}" for n, r in zip(("tp_rank", "pp_rank", "ep_rank"), rank))


def padded_vocab(vocab_size: int, tp: int, vocab_multiple: int = 128) -> int:
    """Vocab rows of the TP-sharded embedding / output layer: ``vocab_size`` rounded up to a
    multiple of ``vocab_multiple * tp`` when ``tp > 1``, ``vocab_size`` itself when ``tp == 1``."""
    if tp < 1 or vocab_multiple < 1:
        raise ValueError(f"tp={tp} and vocab_multiple={vocab_multiple} must be >= 1")
    if tp == 1:
        return vocab_size
    multiple = vocab_multiple * tp
    return -(-vocab_size // multiple) * multiple


def check_parallel(args: ModelArgs, tp: int, pp: int, ep: int = 1, vpp: int = 1) -> None:
    """Raise ``ValueError`` unless ``args``'s model can be cut into ``tp`` x ``pp`` (x ``ep``) pieces,
    each pipeline rank holding ``vpp`` virtual stages (``pp * vpp`` stages in all)."""
    if tp < 1 or pp < 1 or ep < 1 or vpp < 1:
        raise ValueError(f"tp={tp}, pp={pp}, ep={ep} and vpp={vpp} must be >= 1")

    def divisors(*ns: int) -> list[int]:
        return [x for x in range(1, min(ns) + 1) if all(n % x == 0 for n in ns)]

    ffn = "moe_intermediate_size" if args.is_moe else "intermediate_size"
    tp_fields = {"num_attention_heads": args.num_attention_heads,
                 "num_key_value_heads": args.num_key_value_heads,
                 ffn: getattr(args, ffn)}
    for field, n in tp_fields.items():
        if n % tp:
            raise ValueError(f"tensor parallel size tp={tp} does not divide {field}={n}; valid tp "
                             f"(dividing {', '.join(tp_fields)}): {divisors(*tp_fields.values())}")
    if vpp > 1 and args.num_hidden_layers % (pp * vpp):
        raise ValueError(f"pp * vpp = {pp} * {vpp} pipeline stages do not divide num_hidden_layers="
                         f"{args.num_hidden_layers}; valid pp * vpp: {divisors(args.num_hidden_layers)}")
    if args.num_hidden_layers % pp:
        raise ValueError(f"pipeline parallel size pp={pp} does not divide num_hidden_layers="
                         f"{args.num_hidden_layers}; valid pp: {divisors(args.num_hidden_layers)}")
    if ep > 1 and not args.is_moe:
        raise ValueError(f"expert parallel size ep={ep} needs an MoE model; model_type={args.model_type!r} "
                         f"is dense (valid ep: [1])")
    if args.is_moe and args.num_experts % ep:
        raise ValueError(f"expert parallel size ep={ep} does not divide num_experts={args.num_experts}; "
                         f"valid ep: {divisors(args.num_experts)}")


def stage_layers(args: ModelArgs, pp: int, pp_rank: int) -> range:
    """Global indices of the decoder layers on pipeline stage ``pp_rank`` (Megatron's even split)."""
    per = args.num_hidden_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def local_shapes(args: ModelArgs, tp: int, pp: int, tp_rank: int, pp_rank: int,
                 vocab_multiple: int = 128, ep: int = 1, ep_rank: int = 0) -> dict[str, tuple[int, ...]]:
    """Every tensor name of rank ``(tp_rank, pp_rank, ep_rank)``'s GPTModel with its local shape."""
    check_parallel(args, tp, pp, ep)
    full = mcore_mapping.mcore_shapes(args)
    shapes: dict[str, tuple[int, ...]] = {}
    vocab_rows = (padded_vocab(args.vocab_size, tp, vocab_multiple) // tp, args.hidden_size)
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        shapes[_EMB] = vocab_rows
    if last:
        shapes[_FINAL_NORM] = full[_FINAL_NORM]
        if not args.tie_word_embeddings or not first:  # tied + PP > 1: the last stage's copy
            shapes[_OUT] = vocab_rows

    def cut(shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
        if kind in ("qkv", "fc1"):
            return (shape[0] // tp, *shape[1:])
        if kind == "row":
            return (shape[0], shape[1] // tp)
        return shape

    for local, i in enumerate(stage_layers(args, pp, pp_rank)):
        for name, kind in _LAYER_KINDS.items():
            shape = full.get(f"decoder.layers.{i}.{name}")
            if shape is not None:  # absent: qkv bias, q/k norm, dense MLP or router of another model
                shapes[f"decoder.layers.{local}.{name}"] = cut(shape, kind)
        for j, e in enumerate(local_experts(args, ep, ep_rank)):
            for name, kind in _EXPERT_KINDS.items():
                shapes[_expert_key(local, j, name)] = cut(full[_expert_key(i, e, name)], kind)
    return shapes


def local_experts(args: ModelArgs, ep: int, ep_rank: int) -> range:
    """Global indices of the experts on EP rank ``ep_rank`` (empty for a dense model)."""
    per = args.num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def _cut(w: torch.Tensor, kind: str, tp: int, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s piece of a full per-layer tensor of ``kind`` (see the module table)."""
    if kind == "replicated" or tp == 1:
        return w
    if kind == "qkv":  # rows are whole KV-head groups in order, so equal row pieces = whole groups
        return w.chunk(tp, dim=0)[tp_rank]
    if kind == "row":
        return w.chunk(tp, dim=1)[tp_rank].contiguous()
    gate, up = w.chunk(2, dim=0)  # fc1
    return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])


def _join(pieces: list[torch.Tensor], kind: str) -> torch.Tensor:
    """Inverse of :func:`_cut` over all TP ranks' pieces (in rank order)."""
    if kind == "replicated" or len(pieces) == 1:
        return pieces[0]
    if kind == "qkv":
        return torch.cat(pieces, dim=0)
    if kind == "row":
        return torch.cat(pieces, dim=1)
    halves = [p.chunk(2, dim=0) for p in pieces]  # fc1: [gate_k; up_k] per rank
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


def shard_rank(full_sd: dict[str, torch.Tensor], args: ModelArgs, tp: int, pp: int, tp_rank: int,
               pp_rank: int, vocab_multiple: int = 128, ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """Local state dict of rank ``(tp_rank, pp_rank, ep_rank)`` from the full mcore dict (what each
    rank loads). Row pieces may be views of ``full_sd``'s tensors: clone before changing them in place."""
    check_parallel(args, tp, pp, ep)
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp and 0 <= ep_rank < ep):
        raise ValueError(f"rank (tp_rank={tp_rank}, pp_rank={pp_rank}, ep_rank={ep_rank}) is outside "
                         f"tp={tp} x pp={pp} x ep={ep}")
    mcore_mapping.check_state_dict(full_sd, mcore_mapping.mcore_shapes(args), "full Megatron-core")
    vocab = padded_vocab(args.vocab_size, tp, vocab_multiple)
    first, last = pp_rank == 0, pp_rank == pp - 1
    out: dict[str, torch.Tensor] = {}
    if first:
        out[_EMB] = _pad_rows(full_sd[_EMB], vocab).chunk(tp, dim=0)[tp_rank]
    if last:
        out[_FINAL_NORM] = full_sd[_FINAL_NORM]
        if not args.tie_word_embeddings:
            out[_OUT] = _pad_rows(full_sd[_OUT], vocab).chunk(tp, dim=0)[tp_rank]
        elif not first:  # Megatron's last-stage copy of the tied embeddings
            out[_OUT] = _pad_rows(full_sd[_EMB], vocab).chunk(tp, dim=0)[tp_rank]
    for local, i in enumerate(stage_layers(args, pp, pp_rank)):
        for name, kind in _LAYER_KINDS.items():
            w = full_sd.get(f"decoder.layers.{i}.{name}")
            if w is not None:
                out[f"decoder.layers.{local}.{name}"] = _cut(w, kind, tp, tp_rank)
        for j, e in enumerate(local_experts(args, ep, ep_rank)):
            for name, kind in _EXPERT_KINDS.items():
                out[_expert_key(local, j, name)] = _cut(full_sd[_expert_key(i, e, name)], kind, tp, tp_rank)
    return out


def shard(full_sd: dict[str, torch.Tensor], args: ModelArgs, tp: int, pp: int,
          vocab_multiple: int = 128, ep: int = 1) -> dict[Rank, dict[str, torch.Tensor]]:
    """Local state dicts of every rank, keyed ``(tp_rank, pp_rank)``, or ``(tp_rank, pp_rank,
    ep_rank)`` when ``ep > 1`` (see :func:`shard_rank`)."""
    return {_rank_key(t, p, e, ep): shard_rank(full_sd, args, tp, pp, t, p, vocab_multiple, ep, e)
            for e in range(ep) for p in range(pp) for t in range(tp)}


def merge(local_sds: dict[Rank, dict[str, torch.Tensor]], args: ModelArgs, tp: int, pp: int,
          vocab_multiple: int = 128, ep: int = 1) -> dict[str, torch.Tensor]:
    """Full mcore state dict from every rank's local dict (keys as :func:`shard` gives them;
    ``_extra_state`` entries ignored), the vocab padding stripped. ``merge(shard(sd, ...), ...)``
    is bitwise ``sd``."""
    check_parallel(args, tp, pp, ep)
    ranks = {_rank_key(t, p, e, ep) for e in range(ep) for p in range(pp) for t in range(tp)}
    if set(local_sds) != ranks:
        names = "(tp_rank, pp_rank)" if ep == 1 else "(tp_rank, pp_rank, ep_rank)"
        raise ValueError(f"merge needs the local state dicts of ranks {names} {sorted(ranks)}; "
                         f"got {sorted(local_sds)}")
    for rank, sd in local_sds.items():
        t, p, e = (*rank, 0)[:3]
        mcore_mapping.check_state_dict(sd, local_shapes(args, tp, pp, t, p, vocab_multiple, ep, e),
                                       f"rank ({_rank_name(rank)}) local")
    if ep > 1:
        _check_ep_replicas(local_sds, tp, pp, ep)
    # The dense part (everything but the experts) from EP rank 0: the other EP ranks hold copies.
    dense = {(t, p): local_sds[_rank_key(t, p, 0, ep)] for p in range(pp) for t in range(tp)}

    def vocab_rows(pp_rank: int, key: str) -> torch.Tensor:
        rows = torch.cat([dense[(t, pp_rank)][key] for t in range(tp)])
        # Clone a padded result: a view would keep (and torch.save would write) the padding.
        return rows if rows.shape[0] == args.vocab_size else rows[:args.vocab_size].clone()

    last = pp - 1
    out: dict[str, torch.Tensor] = {_EMB: vocab_rows(0, _EMB)}
    if not args.tie_word_embeddings:
        out[_OUT] = vocab_rows(last, _OUT)
    elif pp > 1:
        # The two copies of tied embeddings stay equal in training (their gradients are
        # all-reduced); a difference means the pieces are not from one model.
        copy = torch.cat([dense[(t, last)][_OUT] for t in range(tp)])
        first = torch.cat([dense[(t, 0)][_EMB] for t in range(tp)])
        if not torch.equal(copy, first):
            raise ValueError(f"tied embeddings: the last stage's copy ({_OUT} of pp_rank={last}) "
                             f"differs from {_EMB} of pp_rank=0")
    out[_FINAL_NORM] = _replicated(dense, last, _FINAL_NORM, tp)
    for p in range(pp):
        for local, i in enumerate(stage_layers(args, pp, p)):
            for name, kind in _LAYER_KINDS.items():
                key = f"decoder.layers.{local}.{name}"
                if key not in dense[(0, p)]:
                    continue
                if kind == "replicated":
                    w = _replicated(dense, p, key, tp)
                else:
                    w = _join([dense[(t, p)][key] for t in range(tp)], kind)
                out[f"decoder.layers.{i}.{name}"] = w
            for e in range(ep):
                for j, g in enumerate(local_experts(args, ep, e)):
                    for name, kind in _EXPERT_KINDS.items():
                        pieces = [local_sds[_rank_key(t, p, e, ep)][_expert_key(local, j, name)] for t in range(tp)]
                        out[_expert_key(i, g, name)] = _join(pieces, kind)
    return out


def _check_ep_replicas(local_sds: dict[Rank, dict[str, torch.Tensor]], tp: int, pp: int, ep: int) -> None:
    """Every non-expert tensor of an EP rank > 0 equals EP rank 0's bitwise (the dense part and the
    router are data-parallel replicas over EP: a difference means the pieces are not one model)."""
    for p in range(pp):
        for t in range(tp):
            ref = local_sds[(t, p, 0)]
            for e in range(1, ep):
                for key, w in local_sds[(t, p, e)].items():
                    if _EXPERTS in key or key.endswith("_extra_state"):
                        continue
                    if not torch.equal(w, ref[key]):
                        raise ValueError(f"tensor {key} of (tp_rank={t}, pp_rank={p}) differs between "
                                         f"ep_rank=0 and ep_rank={e} (only experts differ over EP)")


def _replicated(local_sds: dict[tuple[int, int], dict[str, torch.Tensor]], pp_rank: int, key: str,
                tp: int) -> torch.Tensor:
    """A replicated tensor's value, checked equal on every TP rank of stage ``pp_rank``."""
    w = local_sds[(0, pp_rank)][key]
    for t in range(1, tp):
        if not torch.equal(local_sds[(t, pp_rank)][key], w):
            raise ValueError(f"replicated tensor {key} of pp_rank={pp_rank} differs between "
                             f"tp_rank=0 and tp_rank={t}")
    return w


# ---------------------------------------------------------------------- per-tensor plan (weight sync)


@dataclass(frozen=True)
class LocalTensor:
    """One tensor of a rank's GPTModel piece and the full tensor it is cut from (:func:`local_plan`)."""

    name: str
    """Full (TP=1, PP=1, EP=1) Megatron name: global layer and expert numbers."""
    kind: str
    """How TP cuts it (module table): ``vocab``, ``qkv``, ``fc1``, ``row`` or ``replicated``."""
    shape: tuple[int, ...]
    """Local shape on every TP rank of the stage (vocab pieces include their padding rows)."""
    full_shape: tuple[int, ...]
    """Shape of the full tensor (vocab padding stripped)."""
    tied_copy: bool = False
    """True for the last stage's copy of tied embeddings (``output_layer.weight`` with PP > 1):
    it holds stage 0's ``embedding.word_embeddings.weight``, so ``name`` is that."""


def local_plan(args: ModelArgs, tp: int, pp: int, pp_rank: int, vocab_multiple: int = 128, ep: int = 1,
               ep_rank: int = 0) -> dict[str, LocalTensor]:
    """Every tensor name of the GPTModel piece of stage ``pp_rank`` and EP rank ``ep_rank`` (any
    TP rank: the TP pieces of a stage have equal shapes), in :func:`local_shapes` order, with the
    full tensor it is cut from. Lets a rank find, without any communication, which full tensor
    every other rank's piece belongs to (the weight sync plans its buckets from it)."""
    shapes = local_shapes(args, tp, pp, 0, pp_rank, vocab_multiple, ep, ep_rank)
    full = mcore_mapping.mcore_shapes(args)
    layers = stage_layers(args, pp, pp_rank)
    experts = local_experts(args, ep, ep_rank)
    plan: dict[str, LocalTensor] = {}
    for local, shape in shapes.items():
        if local in (_EMB, _OUT):
            tied_copy = local == _OUT and args.tie_word_embeddings
            name = _EMB if tied_copy else local
            plan[local] = LocalTensor(name, "vocab", shape, full[name], tied_copy)
            continue
        if local == _FINAL_NORM:
            plan[local] = LocalTensor(local, "replicated", shape, full[local])
            continue
        layer, rest = local[len("decoder.layers."):].split(".", 1)
        i = layers[int(layer)]
        if rest.startswith(_EXPERTS):
            j, sub = rest[len(_EXPERTS):].split(".", 1)
            name = _expert_key(i, experts[int(j)], sub)
            kind = _EXPERT_KINDS[sub]
        else:
            name, kind = f"decoder.layers.{i}.{rest}", _LAYER_KINDS[rest]
        plan[local] = LocalTensor(name, kind, shape, full[name])
    return plan


def join_pieces(pieces: list[torch.Tensor], kind: str, full_shape: tuple[int, ...],
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The full tensor of ``kind`` from all TP ranks' pieces (in rank order), vocab padding
    stripped: the inverse of :func:`shard_rank` for one tensor. Written into ``out`` (of
    ``full_shape``) when given; otherwise a new tensor, except where the full tensor is one piece
    (TP=1, or a replicated tensor: ``pieces[0]`` itself is returned)."""
    full_shape = tuple(full_shape)
    if kind == "vocab":
        if len(pieces) == 1 and tuple(pieces[0].shape) == full_shape:
            joined = pieces[0]
        else:
            out = pieces[0].new_empty(full_shape) if out is None else out
            row = 0
            for p in pieces:  # the padding rows are the last ones: stop once the vocab is full
                n = min(p.shape[0], full_shape[0] - row)
                if n <= 0:
                    break
                out[row:row + n].copy_(p[:n])
                row += n
            return out
    elif kind == "replicated" or len(pieces) == 1:
        joined = pieces[0]
    elif kind in ("qkv", "row"):
        dim = 0 if kind == "qkv" else 1
        return torch.cat(pieces, dim=dim, out=out) if out is not None else torch.cat(pieces, dim=dim)
    elif kind == "fc1":
        halves = [p.chunk(2, dim=0) for p in pieces]  # [gate_k; up_k] per rank
        parts = [h[0] for h in halves] + [h[1] for h in halves]
        return torch.cat(parts, out=out) if out is not None else torch.cat(parts)
    else:
        raise ValueError(f"join_pieces: kind={kind!r}; valid choices: ['vocab', 'qkv', 'fc1', 'row', 'replicated']")
    if tuple(joined.shape) != full_shape:
        raise ValueError(f"join_pieces: a {kind} piece of shape {tuple(joined.shape)} is not the full "
                         f"shape {full_shape}")
    return joined if out is None else out.copy_(joined)
