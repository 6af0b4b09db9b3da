"""The memory plan: what each GPU of a run holds, term by term, and whether it fits.

Trainer state per parameter of a rank's piece (Megatron-core's own table, docs/memory_plan.md):

=========  ===================  =======  =========  =====================
dtype      optimizer            weights  gradients  optimizer state
=========  ===================  =======  =========  =====================
float32    plain                4        4          8 (Adam m, v)
float32    distributed (ZeRO-1) 4        4          8 / DP
bfloat16   plain                2        4 (fp32)   12 (fp32 master, m, v)
bfloat16   distributed          2        4 (fp32)   12 / DP
float64    plain                8        8          16
=========  ===================  =======  =========  =====================

Activations are :mod:`megarl.plan.activations`' per-token bytes times the tokens of the micro-
batches in flight (one without pipelining; with PP the first stage holds ``pp`` micro-batches of
its layers, Megatron's 1F1B, and ``1 + (pp - 1) / (pp vpp)`` times that interleaved). The engine
holds its TP piece of the weights in the rollout dtype and a KV cache of ``max_batch_size`` rows of
``max_seq_len`` positions (the slots cache; the paged one its ``num_kv_blocks`` when set). A
colocated GPU holds both; a disaggregated run's trainer and rollout GPUs each their own.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megarl.models.config import ModelArgs
from megarl.models.mcore_sharding import padded_vocab
from megarl.plan import activations as act
from megarl.plan import params

GIB = 1 << 30
RESERVE = "runtime reserve"


@dataclass(frozen=True)
class PlanSpec:
    """Everything the plan reads: the model, the layout and the sizes of the run."""

    args: ModelArgs
    gpus: int
    placement: str = "colocated"
    rollout_ranks: int = 0
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    rollout_tp: int = 1
    sequence_parallel: bool = False
    trainer_dtype: str = "bfloat16"
    distributed_optimizer: bool = False
    recompute: str = "none"
    attention: str = "sdpa"
    """``trainer.attention``: ``eager`` keeps [heads, L, L] probabilities per row and layer."""
    micro_batch_size: int = 4
    micro_batch_tokens: int = 0
    seq_len: int = 2048
    """Longest prompt + response (the engine's context, the trainer's longest row)."""
    response_len: int = 1024
    """``rollout.max_new_tokens``: positions scored per row."""
    rows_per_dp_rank: int = 64
    """Sequences each trainer data-parallel rank trains per step (micro-batches in flight with PP)."""
    kl_reference: bool = False
    rollout_dtype: str = "bfloat16"
    max_batch_size: int = 64
    kv_cache: str = "slots"
    kv_block_size: int = 16
    num_kv_blocks: int = 0
    spec_tokens: int = 0
    """Draft tokens verified per row and forward (0: no speculation)."""
    drafter: bool = False
    drafter_buffer_tokens: int = 65536
    drafter_window: int = 8
    device: str = "cuda"
    cpu_packed_linears: bool = True
    weight_sync_bucket_mb: float = 64.0
    reserve_gib: float = 0.0
    """Memory outside tensors: CUDA context, NCCL buffers, the caching allocator's slack."""

    @property
    def trainer_gpus(self) -> int:
        return self.gpus - self.rollout_ranks if self.placement == "disaggregated" else self.gpus

    @property
    def dp(self) -> int:
        return self.trainer_gpus // (self.tp * self.pp)

    def replace(self, **changes) -> "PlanSpec":
        return dataclasses.replace(self, **changes)


@dataclass
class Term:
    name: str
    bytes: float
    note: str = ""


@dataclass
class Plan:
    """Per-GPU terms of each kind of GPU the run has (``colocated``: one kind)."""

    spec: PlanSpec
    gpus: dict[str, list[Term]] = field(default_factory=dict)
    per_token: dict[str, float] = field(default_factory=dict)
    """Activation bytes per micro-batch token (all of the worst stage's layers) and per scored token."""

    def total(self, kind: str) -> float:
        return sum(t.bytes for t in self.gpus[kind])

    def peak(self) -> tuple[str, float]:
        """The GPU kind needing the most memory, and how much."""
        kind = max(self.gpus, key=self.total)
        return kind, self.total(kind)

    def biggest(self, kind: str) -> Term:
        """The largest term a setting can change (not the runtime reserve)."""
        return max((t for t in self.gpus[kind] if t.name != RESERVE), key=lambda t: t.bytes)

    def fits(self, device_gib: float) -> bool:
        return self.peak()[1] <= device_gib * GIB


def optimizer_bytes_per_param(dtype: str, distributed: bool, dp: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter of a rank's piece."""
    w = act.DTYPE_BYTES[dtype]
    if dtype == "bfloat16":
        grads, state = 4, 12  # fp32 main grads; fp32 master weights and Adam's m, v
    else:
        grads, state = w, 2 * w
    return float(w), float(grads), state / dp if distributed else float(state)


def micro_batch_tokens(s: PlanSpec) -> tuple[int, int]:
    """(tokens, scored tokens) of the largest micro-batch: ``micro_batch_size`` rows of the
    longest length, or a ``micro_batch_tokens`` budget (a longer row alone)."""
    if s.micro_batch_tokens > 0:
        tokens = max(s.micro_batch_tokens, s.seq_len)
        rows = max(1, tokens // s.seq_len)
        return tokens, min(tokens, rows * s.response_len)
    return s.micro_batch_size * s.seq_len, s.micro_batch_size * s.response_len


def in_flight(s: PlanSpec) -> float:
    """Micro-batches of a stage's layers the first pipeline stage holds at once."""
    if s.pp == 1:
        return 1.0
    rows = s.micro_batch_size if s.micro_batch_tokens <= 0 else max(1, s.micro_batch_tokens // s.seq_len)
    n = max(1, math.ceil(s.rows_per_dp_rank / rows))
    flight = min(s.pp, n)
    return flight * (1 + (s.pp - 1) / (s.pp * s.vpp)) if s.vpp > 1 else float(flight)


def trainer_terms(s: PlanSpec, per_token: dict[str, float]) -> list[Term]:
    """A trainer GPU's terms (its worst pipeline stage)."""
    args = s.args
    stage, p = params.worst_stage(args, s.tp, s.pp, s.ep)
    w, g, o = optimizer_bytes_per_param(s.trainer_dtype, s.distributed_optimizer, s.dp)
    expert_dp = max(1, s.dp // s.ep)
    opt = (o * p.dense + (o * s.dp / expert_dp if s.distributed_optimizer else o) * p.expert)
    mode = f"{s.trainer_dtype}, {'distributed over DP=' + str(s.dp) if s.distributed_optimizer else 'not sharded'}"
    terms = [Term("trainer weights", w * p.total, f"{p.total / 1e9:.3f} B params (stage {stage} of {s.pp}, TP={s.tp})"),
             Term("gradients", g * p.total, f"{g:g} B/param"),
             Term("optimizer state", opt, f"{opt / max(p.total, 1):.2f} B/param ({mode})")]
    if s.kl_reference:
        terms.append(Term("KL reference", w * p.total, "the reference's piece, in the trainer dtype"))
    terms.append(_activation_term(s, p.total, per_token))
    return terms


def _activation_term(s: PlanSpec, stage_params: int, per_token: dict[str, float]) -> Term:
    """Activations at the step's peak (end of a micro-batch's forward), or the optimizer step's
    temporaries when larger: they never coexist (the step runs after the last backward)."""
    args = s.args
    tokens, scored = micro_batch_tokens(s)
    layers = args.num_hidden_layers // s.pp
    eager = act.eager_attention_bytes_per_token(args, s.tp, s.trainer_dtype, s.seq_len) if s.attention == "eager" else 0
    kept = act.layer_bytes_per_token(args, s.tp, s.trainer_dtype, s.recompute, s.sequence_parallel)
    kept += eager if s.recompute == "none" else 0
    per_token["per micro-batch token"] = kept * layers * in_flight(s)
    per_token["per scored token"] = act.head_bytes_per_scored_token(args, s.tp, s.trainer_dtype)
    total = per_token["per micro-batch token"] * tokens + per_token["per scored token"] * scored
    if s.recompute == "full":  # one layer recomputed whole while its backward runs
        total += (act.layer_bytes_per_token(args, s.tp, s.trainer_dtype, "none", s.sequence_parallel) + eager) * tokens
    elif s.recompute == "selective":  # one layer's core attention recomputed while its backward runs
        total += eager * tokens
    # the output layer's weight gradient, made whole in the dtype before it is added to the fp32 main grad
    vocab_grad = act.DTYPE_BYTES[s.trainer_dtype] * padded_vocab(args.vocab_size, s.tp) // s.tp * args.hidden_size
    total += act.head_transient_per_scored_token(args, s.tp, s.trainer_dtype) * scored + vocab_grad
    # torch's multi-tensor Adam (CUDA, without Transformer Engine's fused one) keeps one fp32 copy
    # of sqrt(v) over the optimizer's shard while it steps
    shard = stage_params / s.dp if s.distributed_optimizer else stage_params
    opt_tmp = 4 * shard if s.device == "cuda" else 0
    note = (f"{tokens} tokens x {per_token['per micro-batch token'] / 1024:.1f} KiB + {scored} scored x "
            f"{per_token['per scored token'] / 1024:.1f} KiB; recompute={s.recompute}"
            + (", eager attention" if s.attention == "eager" else ""))
    if opt_tmp > total:
        return Term("activations / step temporaries", opt_tmp, "the optimizer step's fp32 temporaries")
    return Term("activations (peak micro-batch)", total, note)


def engine_terms(s: PlanSpec) -> list[Term]:
    """A rollout GPU's terms: the engine's weights and KV cache, its logits, the drafter."""
    args, a = s.args, act.DTYPE_BYTES[s.rollout_dtype]
    n = params.engine_params(args, s.rollout_tp)
    kv_heads = args.num_key_value_heads // s.rollout_tp
    positions = s.max_batch_size * s.seq_len
    if s.kv_cache == "paged":
        blocks = s.num_kv_blocks or s.max_batch_size * -(-s.seq_len // s.kv_block_size)
        positions = blocks * s.kv_block_size
    kv = 2 * args.num_hidden_layers * kv_heads * args.head_dim * positions * a
    rows = s.max_batch_size * (1 + s.spec_tokens)
    terms = [Term("engine weights", a * n, f"{n / 1e9:.3f} B params (rollout TP={s.rollout_tp}, {s.rollout_dtype})"),
             Term("KV cache", kv, f"{positions} positions x {args.num_hidden_layers} layers x {kv_heads} KV heads"),
             Term("engine logits", rows * args.vocab_size * (a + 8), f"{rows} rows x vocab, fp32 sampling copies")]
    if s.device == "cpu" and s.cpu_packed_linears and s.rollout_dtype != "float64":
        terms.append(Term("packed linears (CPU)", a * n, "oneDNN's reordered copy of the weights"))
    if s.drafter:
        d = params.drafter_params(args)
        terms.append(Term("drafter", 4 * a * d, f"{d / 1e6:.1f} M params: weights, grads, Adam m and v"))
        buf = s.drafter_buffer_tokens * (args.hidden_size * a + 8)
        ring = s.max_batch_size * s.drafter_window * args.hidden_size * a
        terms.append(Term("drafter buffers", buf + ring, f"{s.drafter_buffer_tokens} hidden states for training"))
    return terms


def plan(s: PlanSpec) -> Plan:
    """Every GPU kind's terms (``colocated``: one kind holding both)."""
    per_token: dict[str, float] = {}
    trainer, engine = trainer_terms(s, per_token), engine_terms(s)
    sync = Term("weight-sync buffers", 2 * s.weight_sync_bucket_mb * (1 << 20), "one bucket each way")
    reserve = [Term(RESERVE, s.reserve_gib * GIB, "CUDA context, NCCL, allocator slack")] \
        if s.reserve_gib else []
    if s.placement == "disaggregated":
        gpus = {"trainer GPU": trainer + [sync] + reserve, "rollout GPU": engine + [sync] + reserve}
    else:
        gpus = {"every GPU": trainer + engine + [sync] + reserve}
    return Plan(spec=s, gpus=gpus, per_token=per_token)
