"""What the rollout side of a run uses of a rollout engine (docs/design.md §2, §3): the
:class:`RolloutBackend` Protocol. megarl's :class:`megarl.engine.Engine` (the exactness reference)
and :class:`megarl.engine.vllm_backend.VLLMEngine` both satisfy it structurally (neither imports
this module: the engine layer stays below the rollout one); tests/rollout/test_backend.py checks
that both have every member with a compatible signature and that megarl/rollout calls nothing
else on an engine. Another backend (e.g. SGLang) implements these members and nothing more.

The engine calls back into the layers above it only through the two callables typed here,
:data:`OnFinish` (a response is done: scoring, then stream training) and :data:`ShouldStop`
(stop generating: bubble work's end, tail batching's short rounds), and through the weight sync
it is handed in :meth:`RolloutBackend.after_sync`.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from megarl.engine.requests import Request, Result
from megarl.spec.speculator import Speculator

OnFinish = Callable[[int, Result], None]
"""``on_finish(i, result)``: request ``i`` of a ``generate`` call finished, called between engine
iterations right after the one that finished it, outside inference mode."""
ShouldStop = Callable[[], bool]
"""Asked before every engine iteration; once it says yes, the unfinished requests come back as
they stand, ``finish_reason`` ``"aborted"`` (their tokens a prefix of the full response)."""
WeightSyncFn = Callable[[], dict]
"""One weight sync into the engine (``megarl.parallel.weight_sync.WeightSync``), returning its
figures."""


class RolloutBackend(Protocol):
    """A rollout engine as the rollout stage, the step's weight sync and the run's end use it."""

    spec: Speculator | None
    """megarl's speculator (its draft sources propose, and the stage shares drafts and reads its
    figures through it), or None without speculation."""
    device: torch.device
    """Where the engine runs (the bubble phase's end flag lives there)."""
    stats: dict[str, int]
    """``forwards``, ``tokens``, ``target_forwards`` since the last :meth:`reset_stats`."""
    model: torch.nn.Module
    """The weight sync's target: HF-named parameters, written in place (this rank's TP slice)."""
    tp_rank: int
    """This process's rank in the engine's rollout TP group."""
    tp_size: int
    """The engine's rollout TP size."""

    def reset_stats(self) -> None:
        """Zero :attr:`stats` (and the speculator's figures)."""

    def generate(self, requests: list[Request], step: int, progress: bool = False, purpose: str = "rollout",
                 on_finish: OnFinish | None = None, should_stop: ShouldStop | None = None) -> list[Result]:
        """Responses for ``requests`` (same order), sampled as RL step ``step``'s; ``purpose``:
        ``rollout`` (they become history drafts) or ``bubble`` (drafts of a future step)."""

    def pregenerate(self, requests: list[Request], step: int, coupled: bool = True,
                    should_stop: ShouldStop | None = None) -> list[Result]:
        """Bubble work: responses of the future step ``step``, kept as its bubble drafts (a
        backend without bubble drafts refuses it with a clear error)."""

    def after_sync(self, sync: WeightSyncFn) -> WeightSyncFn:
        """``sync`` followed by what the backend does once the weights are written into
        :attr:`model` (vLLM: load them into its own copy), as one callable with the sync's
        figures and any of its own."""

    def close(self) -> None:
        """Release what the engine holds beyond its memory (vLLM: its engine core and process
        groups), after the run's last collective."""
