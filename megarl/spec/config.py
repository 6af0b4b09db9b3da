"""Settings of speculative rollouts (the ``spec`` section of a run config)."""
from __future__ import annotations

from dataclasses import dataclass, field

SOURCES = ("bubble", "history", "group", "prompt")
# What the speculator proposes with a learned drafter configured (spec.drafter.strategy);
# ``bandit`` chooses among the fixed ones online (megarl/spec/bandit.py).
STRATEGIES = ("combined", "drafter", "sources", "bandit")


@dataclass
class DrafterConfig:
    """The learned EAGLE-style drafter (TLT; megarl/spec/drafter.py): one decoder layer
    over the target's last hidden states and the token embeddings, using the target's (frozen)
    embedding and LM head. Its draft tokens are sampled with the request's own counter-based
    noise (coupled drafts), and verification is unchanged: output stays token-identical."""

    enabled: bool = False
    """Build the drafter: the engine then also keeps the target's hidden states of running and
    recent requests (off: the engine's forward path is the plain one)."""
    k: int = 4
    """Draft length of the drafter's chain (strategies ``combined`` and ``drafter``)."""
    window: int = 8
    """Target positions (hidden state + token) the drafter attends to before its chain."""
    strategy: str = "combined"
    """``combined``: the draft sources and the drafter, per request the proposal with the longer
    expected accepted run; ``drafter``: the drafter only; ``sources``: the draft sources only (the
    drafter is still trained); ``bandit``: per batch-size bucket an online bandit picks one of
    off / sources / drafter K=2,4,8 / combined from measured tokens per second."""
    buffer_tokens: int = 65536
    """Most target hidden states (one per token) kept from recent rollouts for training; the
    oldest responses are dropped first."""
    lr: float = 3e-3
    """Adam learning rate of drafter training (bubbles are short: measured on the tiny task after SFT,
    3e-3 reaches a given acceptance in about half the steps of 1e-3; 1e-2 is worse again)."""
    batch_size: int = 16
    """Segments per training step."""
    seq_len: int = 32
    """Tokens per training segment."""
    train_depth: int = 2
    """Chain steps unrolled in training: depth d feeds the drafter its own predicted features of
    depth d-1, as drafting does after its first token."""
    ce_weight: float = 1.0
    """Weight of the cross-entropy to the target's next-token distribution (soft labels)."""
    feature_weight: float = 1.0
    """Weight of the smooth-L1 regression onto the target's next hidden state."""
    steps_per_bubble: int = 0
    """Most training steps in one bubble (0: until the bubble ends)."""
    steps_after_rollout: int = 20
    """Training steps after each rollout phase when there is no bubble to train in (one rollout
    replica, or ``drafter_train`` not in ``schedule.bubble_work``): these cost step time."""
    init_from: str | None = None
    """A drafter folder (``RUN_DIR/hf/drafter``) to start from instead of a fresh init."""
    bandit_c: float = 0.2
    """UCB1 exploration weight of the ``bandit`` strategy (rewards scaled to [0, 1] per bucket)."""
    bandit_discount: float = 0.99
    """Per-update discount of a bucket's past rewards (the best arm changes as the drafter trains)."""
    seed: int = 0
    """Seed of the drafter's init, its training batches and the bandit's tie-breaking."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"spec.drafter.strategy={self.strategy!r} is invalid; valid choices: {list(STRATEGIES)}")
        for name in ("k", "window", "buffer_tokens", "batch_size", "seq_len", "train_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"spec.drafter.{name}={getattr(self, name)} is invalid; valid range: >= 1")
        if self.seq_len < 2:
            raise ValueError(f"spec.drafter.seq_len={self.seq_len} is invalid; valid range: >= 2")
        for name in ("steps_per_bubble", "steps_after_rollout"):
            if getattr(self, name) < 0:
                raise ValueError(f"spec.drafter.{name}={getattr(self, name)} is invalid; valid range: >= 0")
        from megarl.utils.dataclass_config import check_number

        for name in ("lr", "ce_weight", "feature_weight", "bandit_c", "bandit_discount"):
            check_number(f"spec.drafter.{name}", getattr(self, name))
        check_number("spec.drafter.seed", self.seed, ge=0, integer=True)
        weights_ok = self.ce_weight >= 0 and self.feature_weight >= 0 and self.ce_weight + self.feature_weight > 0
        if not self.lr > 0 or not weights_ok:
            raise ValueError(f"spec.drafter: lr={self.lr} must be > 0 and ce_weight={self.ce_weight}, "
                             f"feature_weight={self.feature_weight} >= 0, not both 0")
        if self.bandit_c < 0 or not 0 < self.bandit_discount <= 1:
            raise ValueError(f"spec.drafter: bandit_c={self.bandit_c} (valid: >= 0), bandit_discount="
                             f"{self.bandit_discount} (valid: (0, 1])")


@dataclass
class SpecConfig:
    """Speculative decoding in the rollout engine. Output is token-for-token the output with
    speculation off (docs/design.md §1); these settings change speed only."""

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
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    """The learned drafter (off by default), trained on rollout hidden states in bubble time
    (``schedule.bubble_work``: ``drafter_train``), and the adaptive strategy."""

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
        if not 0 <= self.forward_cost_tokens < float("inf"):
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
        if self.drafter.enabled and not self.enabled:
            raise ValueError("spec.drafter.enabled=true needs spec.enabled=true (the drafter drafts for the "
                             "speculative engine)")
        if self.suffix_backend not in ("auto", "native", "python"):
            raise ValueError(f"spec.suffix_backend={self.suffix_backend!r} is invalid; valid: auto, native, python")
