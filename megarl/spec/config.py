"""Settings of speculative rollouts (the ``spec`` section of a run config)."""
from __future__ import annotations

from dataclasses import dataclass

SOURCES = ("bubble", "history", "group", "prompt")


@dataclass
class SpecConfig:
    """Speculative decoding in the rollout engine. Output is token-for-token the output with
    speculation off (DESIGN.md §2); these settings change speed only."""

    enabled: bool = False
    """Draft and verify in the rollout engine."""
    sources: tuple[str, ...] = ("bubble", "history", "group", "prompt")
    """Draft sources, in order of preference among equally long suffix matches: ``bubble``
    (responses pre-generated for this step with the previous weights and this step's noise),
    ``history`` (responses to the same prompt in earlier epochs), ``group`` (the partial
    responses of the other samples of the same GRPO group), ``prompt`` (n-grams of the prompt)."""
    k_init: int = 4
    """Draft length a request starts with."""
    k_min: int = 1
    """Shortest draft length the adaptive policy shrinks to."""
    k_max: int = 8
    """Longest draft length the adaptive policy grows to."""
    max_batch: int = 256
    """Speculation is off in a decode step with more running requests than this (a hard limit on
    top of ``forward_cost_tokens``, which already cuts drafts that do not pay in large batches)."""
    max_draft_tokens: int = 0
    """Most draft tokens in one forward, over all its requests (0 = no limit). A large batch
    gets short drafts and the tail of a step, where a few long requests run alone, gets up to
    k_max: verify cost grows with the tokens per forward once the device is busy."""
    forward_cost_tokens: float = 80.0
    """Fixed cost of one target forward (launches, host work, reading the weights), in units of
    the cost of one more token row in it; 0 turns the cost rule off. A draft is cut to the
    tokens that pay for their verify rows: token j stays only if the chance that the first j
    are all accepted is at least B / (B + forward_cost_tokens), B = running requests (an
    accepted token saves its row and a 1/B share of a forward). The chance comes from each
    source's running acceptance rate. Measure it with benchmarks/bench_verify_cost.py (it prints
    the fit): 80 for the tiny model on 2 CPU cores (2.0 ms per forward, 0.025 ms per token row);
    decode on a GPU is memory-bound, so there it is far larger."""
    max_match: int = 16
    """Longest suffix of a request's recent tokens looked up in the suffix indexes."""
    min_match: int = 1
    """Shortest suffix match that may propose a draft (uncoupled sources)."""
    min_prob: float = 0.0
    """Stop extending a suffix-index draft when the empirical probability of the drafted path
    falls below this (0 = draft as far as the index and the draft length allow)."""
    prompt_tail: int = 4
    """Prompt tokens indexed in front of each response, so that the first response tokens can be
    drafted from the end of the prompt."""
    history_epochs: int = 1
    """Epochs of earlier responses kept per prompt by the history source."""
    suffix_max_depth: int = 24
    """Longest substring (match + draft) stored in a suffix index."""
    suffix_backend: str = "auto"
    """Suffix index implementation: ``auto`` (C++ if built, else the Python twin), ``native``
    or ``python``."""
    bubble_pregen: bool = False
    """After each step's rollout, pre-generate the next step's responses with the current weights
    and the next step's noise, as bubble drafts. On a cluster ranks do this in their idle time
    (the scheduler decides when); in a one-process run it costs a full extra rollout."""

    def __post_init__(self) -> None:
        self.sources = tuple(self.sources)
        bad = [s for s in self.sources if s not in SOURCES]
        if bad or len(set(self.sources)) != len(self.sources):
            raise ValueError(f"spec.sources={list(self.sources)} is invalid; valid: distinct names from {list(SOURCES)}")
        if not 1 <= self.k_min <= self.k_init <= self.k_max:
            raise ValueError(f"spec draft lengths must satisfy 1 <= k_min <= k_init <= k_max, got "
                             f"k_min={self.k_min} k_init={self.k_init} k_max={self.k_max}")
        if self.max_draft_tokens < 0:
            raise ValueError(f"spec.max_draft_tokens={self.max_draft_tokens} is invalid; valid range: >= 0 (0 = no limit)")
        if self.forward_cost_tokens < 0:
            raise ValueError(f"spec.forward_cost_tokens={self.forward_cost_tokens} is invalid; valid range: >= 0 (0 = off)")
        if self.max_batch < 1:
            raise ValueError(f"spec.max_batch={self.max_batch} is invalid; valid range: >= 1")
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"spec.min_match={self.min_match}, spec.max_match={self.max_match}: "
                             f"need 1 <= min_match <= max_match")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"spec.min_prob={self.min_prob} is invalid; valid range: [0, 1]")
        if self.prompt_tail < 0 or self.history_epochs < 1:
            raise ValueError(f"spec.prompt_tail={self.prompt_tail} (valid: >= 0) and spec.history_epochs="
                             f"{self.history_epochs} (valid: >= 1)")
        if self.suffix_max_depth < 2:
            raise ValueError(f"spec.suffix_max_depth={self.suffix_max_depth} is invalid; valid range: >= 2")
        if self.suffix_backend not in ("auto", "native", "python"):
            raise ValueError(f"spec.suffix_backend={self.suffix_backend!r} is invalid; valid: auto, native, python")
