"""Speculative acceptance models, one per draft source, and the draft-length choice.

A draft token is accepted with probability ``alpha`` (per token, independently: the standard
geometric model). A verify forward with ``k`` draft tokens then yields, in expectation,

    tau(alpha, k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)

tokens (the accepted prefix plus the target's own token), for ``1 + k`` token rows. The
simulator runs that expectation as a fluid (a request advances ``tau`` tokens per iteration).

Sources (megarl/spec, docs/design.md §6) and their default per-token acceptance:

- ``history`` (RhymeRL): suffix match on earlier epochs' responses to the same prompt; only for
  prompts seen before (``history_coverage``). Other noise, so ``alpha`` ~ p(draft) ~ 0.5.
- ``group`` (Seer): sibling responses of the GRPO group; ~0.4.
- ``bubble`` (BubbleSpec, coupled): the next step's responses pre-generated in bubbles with that
  step's noise by the one-step-older policy: ~0.9 (same noise, one RL step of drift), but only
  over the prefix that was pre-generated (megarl/sim/step.py tracks it).
- ``drafter`` (TLT): a small learned drafter: ``drafter_alpha`` when trained on the current
  policy's hidden states in the previous step's bubbles, decaying to ``drafter_stale`` without.

Each request uses its best available source (the highest ``alpha``). The draft length is chosen
per replica per engine iteration to maximise tokens per second given the batch (TLT's adaptive
SD: long drafts at small batch, where decode is memory-bound and a verify row is nearly free;
none past ``max_batch``), from ``k_choices``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SOURCES = ("history", "group", "bubble", "drafter")


@dataclass
class SpecModel:
    """Acceptance per draft source (see the module docstring)."""

    sources: tuple = ()
    """Enabled sources, a subset of ``SOURCES``; empty = no speculation."""
    history_alpha: float = 0.5
    """Per-token acceptance of history drafts."""
    history_coverage: float = 1.0
    """Share of a step's prompts seen in an earlier epoch (1 from the second epoch on)."""
    group_alpha: float = 0.4
    """Per-token acceptance of sibling drafts."""
    bubble_alpha: float = 0.9
    """Per-token acceptance of coupled bubble drafts, over their pre-generated prefix."""
    drafter_alpha: float = 0.7
    """Per-token acceptance of a learned drafter kept fresh by bubble training."""
    drafter_stale: float = 0.45
    """... of a drafter that got no training in the previous step."""
    k_choices: tuple = (0, 1, 2, 3, 4, 6, 8)
    """Draft lengths the adaptive policy may pick."""
    max_batch: int = 256
    """Running requests above which speculation is off."""

    def __post_init__(self) -> None:
        bad = [s for s in self.sources if s not in SOURCES]
        if bad:
            raise ValueError(f"spec sources {bad} are invalid; valid choices: {list(SOURCES)}")
        for name in ("history_alpha", "group_alpha", "bubble_alpha", "drafter_alpha", "drafter_stale",
                     "history_coverage"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0 + (name == "history_coverage"):
                raise ValueError(f"spec {name}={v} is invalid; valid range: [0, 1)")

    @property
    def enabled(self) -> bool:
        return bool(self.sources)

    def rest_alpha(self, seen: np.ndarray, drafter_fresh: float = 1.0) -> np.ndarray:
        """Per-request acceptance outside a bubble-draft prefix. ``seen``: prompt has history;
        ``drafter_fresh`` in [0, 1]: how much of the drafter's training the last bubbles held."""
        a = np.zeros(seen.shape)
        if "history" in self.sources:
            a = np.where(seen, np.maximum(a, self.history_alpha), a)
        if "group" in self.sources:
            a = np.maximum(a, self.group_alpha)
        if "drafter" in self.sources:
            a = np.maximum(a, self.drafter_stale + (self.drafter_alpha - self.drafter_stale) * drafter_fresh)
        return a

    def cover_alpha(self, rest: np.ndarray) -> np.ndarray:
        """Per-request acceptance inside its bubble-draft prefix."""
        return np.maximum(rest, self.bubble_alpha) if "bubble" in self.sources else rest


def tokens_per_forward(alpha, k):
    """Expected tokens per verify forward with ``k`` draft tokens at per-token acceptance ``alpha``."""
    alpha = np.asarray(alpha, dtype=np.float64)
    k = np.asarray(k)
    safe = np.where(alpha < 1.0, alpha, 0.5)
    geo = (1.0 - safe ** (k + 1)) / (1.0 - safe)
    return np.where(alpha < 1.0, geo, k + 1.0)
