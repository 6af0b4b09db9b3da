"""The engine's side of speculative decoding: the hooks it calls on a speculator, and what a
learned drafter may read of the target model.

The engine owns this interface and imports nothing of megarl/spec: ``megarl.spec.speculator.
Speculator`` implements :class:`Speculation`, and a drafter is handed a :class:`DraftTarget` (the
target's embedding and LM head, its shapes and its sampling set-up), never the engine itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from megarl.models.config import ModelArgs


@dataclass(frozen=True)
class DraftTarget:
    """What a learned drafter reads of the model it drafts for."""

    args: ModelArgs
    """The target's shapes (hidden size, vocabulary, heads)."""
    embed_weight: Callable[[], torch.Tensor]
    """The target's token embedding [V, H] (current weights: they change every RL step)."""
    head_weight: Callable[[], torch.Tensor]
    """The target's LM head [V, H] (the embedding when tied)."""
    logits: Callable[[torch.Tensor], torch.Tensor]
    """The target's LM head applied to hidden states [N, H] -> [N, V], computed as the engine
    computes its own (on CPU through its packed linears: the head is most of a drafter's step)."""
    matmul_params: int
    """Weights the target reads per token in matmuls (for the drafter's cost relative to it)."""
    seed: int
    """The run seed of the sampling noise (drafts are sampled with the requests' own noise)."""
    dtype: torch.dtype
    """Model and cache dtype."""
    sample_dtype: torch.dtype
    """Dtype of the sampling math (at least fp32)."""
    device: torch.device
    tp_size: int
    """Tensor-parallel size of the target (a drafter reads the full embedding: 1 only)."""

    @classmethod
    def of(cls, engine) -> "DraftTarget":
        """The target of an ``Engine`` (its current weights, read at call time)."""
        m = engine.model
        matmul = sum(p.numel() for p in m.parameters())  # a tied head is counted once, as the embedding
        if not m.args.tie_word_embeddings:  # an untied embedding is a lookup, not a matmul
            matmul -= m.model.embed_tokens.weight.numel()
        return cls(args=m.args, embed_weight=lambda: m.model.embed_tokens.weight.detach(),
                   head_weight=lambda: m.lm_head_weight.detach(), logits=engine.head_logits, matmul_params=matmul,
                   seed=engine.seed, dtype=engine.dtype, sample_dtype=engine.sample_dtype, device=engine.device,
                   tp_size=engine.tp_size)


class Speculation(Protocol):
    """The hooks the engine calls, in this order within ``generate``: ``reset_stats`` (per run of
    figures), ``attach`` (with ``needs_hidden``), ``begin``; per iteration ``propose`` (drafts for
    the scheduled rows), ``on_prefill``/``on_verify`` (hidden states, with ``needs_hidden``),
    ``feedback`` per request, ``step_end``; ``end`` with the results. ``bubble`` is the source
    that keeps pre-generated (bubble) drafts, or None."""

    needs_hidden: bool
    bubble: object | None

    def reset_stats(self) -> None: ...

    def attach(self, target: DraftTarget) -> None: ...

    def begin(self, requests: list, step: int) -> None: ...

    def propose(self, reqs: list, tokens: list[list[int]], room: list[int], n_rows: int) -> list[list[int]]: ...

    def on_prefill(self, groups: list[list], hidden: torch.Tensor) -> None: ...

    def on_verify(self, reqs: list, hidden: torch.Tensor, tokens: torch.Tensor, n_rows: list[int],
                  n_accept: list[int], n_before: list[int]) -> None: ...

    def feedback(self, req, new_tokens: list[int], n_drafted: int, n_accepted: int) -> None: ...

    def step_end(self) -> None: ...

    def end(self, results: list, step: int, purpose: str) -> None: ...
