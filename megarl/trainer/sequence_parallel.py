"""Megatron's sequence parallelism in megarl's trainer (``parallel.sequence_parallel``).

With ``sequence_parallel=True`` in the TransformerConfig, Megatron splits the activations that sit
outside the tensor-parallel linears along the sequence: the embedding reduce-scatters its output
over the TP group ([s / tp, b, h] on each rank), every column-parallel linear all-gathers its
input's sequence and every row-parallel linear reduce-scatters its output instead of
all-reducing it, so the layernorms and residual adds each run on 1/tp of the tokens. Their
weights' gradients are then partial sums (each rank saw its tokens only), which Megatron's
``finalize_model_grads`` all-reduces over TP. The same update as without it, up to the rounding of
summing in another order (docs/design.md §1.4).

Three things around the model are megarl's:

- The norms. Megatron's torch-only RMSNorm (the local layer spec's without apex or Transformer
  Engine) refuses sequence parallelism: megarl's layers take :func:`norm_class`'s, the same
  ``torch.nn.RMSNorm`` with its weight tagged ``sequence_parallel`` as Megatron's fused norms tag
  theirs, so that ``finalize_model_grads`` sums its gradient over TP (:func:`block_spec`).
- The output layer. The trainer scores only the loss mask's positions (``Trainer._select_hidden``
  picks them from the [s, b, h] hidden states), and those span every rank's part of the sequence.
  So the final norm's output is gathered over TP *before* the output layer (backward: the
  reduce-scatter that sums the vocab slices' partial input gradients), and the output layer runs
  without its own sequence gather, as Megatron's GPTModel does for its inference path's
  last-token logits (:func:`gather_before_output_layer`).
- The length: the sequence must split evenly over TP, so the trainer pads each micro-batch
  (packed or right padded) to a multiple of ``tp`` (:func:`megarl.trainer.micro_batches.model_input`);
  callers of ``gpt_logits`` / ``pipeline_logits`` pass such lengths (:func:`check_length`).
"""
from __future__ import annotations

import functools

from megarl.parallel.dist import ParallelDims


def length_multiple(dims: ParallelDims) -> int:
    """What a micro-batch's sequence length must be a multiple of: ``tp`` with sequence
    parallelism, else 1."""
    return dims.tp if dims.sequence_parallel else 1


def check_length(length: int, dims: ParallelDims | None) -> None:
    """Raise unless a sequence of ``length`` tokens splits evenly over the TP ranks (sequence
    parallelism; any length without it)."""
    if dims is not None and length % length_multiple(dims):
        raise ValueError(f"sequence length {length} does not divide over tp={dims.tp} ranks with sequence "
                         f"parallelism: pad the input to a multiple of {dims.tp}")


def local_length(length: int, dims: ParallelDims) -> int:
    """Tokens of a ``length``-token sequence that one TP rank holds between the linears (what
    pipeline stages exchange)."""
    check_length(length, dims)
    return length // length_multiple(dims)


def gather_before_output_layer(model) -> None:
    """On the last pipeline stage of a GPTModel built with sequence parallelism: gather the hidden
    states' sequence over TP in a forward pre-hook of the output layer, and turn the layer's own
    sequence gather and input-gradient all-reduce off (the gather's backward reduce-scatters,
    which sums the TP ranks' partial gradients, each from its vocab slice). Registered when the
    model is built, so that later pre-hooks (the trainer's position selection) see the whole
    sequence. A no-op without sequence parallelism or without an output layer."""
    if not model.config.sequence_parallel or not model.post_process:
        return
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    layer, group = model.output_layer, model.pg_collection.tp
    layer.sequence_parallel = False
    layer.disable_grad_reduce = True

    def gather_sequence(module, args):
        return (gather_from_sequence_parallel_region(args[0], tensor_parallel_output_grad=True, group=group),
                *args[1:])

    layer.register_forward_pre_hook(gather_sequence)


@functools.cache
def norm_class():
    """``torch.nn.RMSNorm`` built from a TransformerConfig (Megatron's norm signature), its weight
    tagged ``sequence_parallel``: each TP rank normalises its own tokens, so the weight's gradient
    on a rank is a partial sum, which Megatron's ``finalize_model_grads`` all-reduces over TP for
    tagged parameters. Built on first use (no torch import cost for the module's importers)."""
    import torch

    class SequenceParallelRMSNorm(torch.nn.RMSNorm):
        def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
            if config.normalization != "RMSNorm":
                raise ValueError(f"megarl's sequence-parallel norm is RMSNorm; got {config.normalization}")
            super().__init__(hidden_size, eps=eps)
            self.weight.sequence_parallel = config.sequence_parallel

    return SequenceParallelRMSNorm


def block_spec(layer_spec, config, vp_stage: int | None):
    """The transformer block of a GPTModel with sequence parallelism: ``layer_spec`` (the local
    spec, modified in place) with :func:`norm_class` norms, for this stage's layers, and the
    same norm as the block's final one (a bare layer spec would get Megatron's torch norm)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    norm, sub = norm_class(), layer_spec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = norm
    attn = sub.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):  # Qwen3's; IdentityOp otherwise
        if getattr(attn, name) is not IdentityOp:
            setattr(attn, name, norm)
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * layers, layer_norm=norm)
