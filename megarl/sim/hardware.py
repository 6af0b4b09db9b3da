"""Cost profiles: seconds per engine iteration, per training pass, per weight sync.

Two kinds, one interface (:class:`Profile`):

- :class:`LinearProfile` (``cpu``): fitted on measured megarl engine and trainer runs on this
  machine by ``benchmarks/calibrate_sim.py`` and loaded from ``megarl/sim/profiles/<name>.json``.
  An engine iteration costs ``a + b * rows + c * ctx`` (rows: token rows of the forward, i.e.
  requests x (1 + draft tokens); ctx: KV positions read, summed over the running requests),
  plus, when speculating, ``spec_request`` per running request and ``spec_row`` per draft token
  (host work: drafting, acceptance). Processes of a run share ``cores`` CPU cores, with the
  measured ``slowdown`` of n processes at once and ``bubble_interference`` of idle-priority
  bubble work beside the generating ones: see megarl/sim/share.py.
- :class:`RooflineProfile` (``h100``): from first principles, for a model shape
  (:data:`QWEN25_7B`) on one H100 SXM per rollout rank.

H100 arithmetic (Qwen2.5-7B, bf16; the numbers :func:`h100` uses)::

    weights       7.62e9 params x 2 B                         = 15.2 GB
    matmul params 7.62e9 - 0.545e9 (input embedding: a gather) = 7.07e9 -> 14.1 GFLOP per token row
    KV per token  2 (k, v) x 28 layers x 4 kv heads x 128 x 2 B = 57,344 B
    attention     4 x 28 layers x 3584 (q width) = 0.40 MFLOP per row per context token

    decode iteration = overhead + max(memory, compute)
      memory  = (15.2 GB + ctx x 57,344 B) / (3.35 TB/s x 0.8)
              = 5.7 ms at ctx 0; + 1.4 ms for 64 requests at 1k context
      compute = (rows x 14.1 GFLOP + rows/batch x ctx x 0.40 MFLOP) / (989 TFLOP/s x 0.6)
              = 1.5 ms for 64 rows: decode is memory-bound below ~240 rows, which is why a verify
                row (speculation) is nearly free at small batch and not at large batch
      overhead = 1 ms (kernel launches with CUDA graphs, sampling, host scheduling)

    training, per token of a sequence of length s (prompt + response):
      passes x (14.1 GFLOP + 2 x 28 x 3584 x s FLOP) / (989 TFLOP/s x 0.35 MFU)
      passes = 5 forward-equivalents for the plain step (old-logprob forward 1, forward +
      backward 3, activation recompute 1); 4 for stream training, whose old logprobs are the
      training forward's own (megarl/stages/update.py). At s = 1.5k: 5 x 14.4 GFLOP / 346 TFLOP/s
      = 0.21 ms per token, ~4.8k tokens/s per GPU.
    gradient all-reduce: 2 x 15.2 GB x (dp-1)/dp over 40 GB/s per GPU (400 Gb/s InfiniBand):
      0.76 s; optimizer (distributed Adam, 16 B/param / dp over HBM): negligible past dp 8.
    weight sync trainer -> engine (colocated): 15.2 GB over 100 GB/s (NVLink resharding) = 0.15 s,
      + 5 ms per tree level of the broadcast to the rollout replicas, + 1 s engine resume
      (KV cache re-allocation, CUDA graph re-capture).
"""
from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

PROFILE_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class ModelShape:
    """Transformer shape, enough for bytes and FLOPs."""

    name: str
    params: float
    """All parameters."""
    embed_params: float
    """Input embedding parameters (a gather, no FLOPs)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    """Bytes per weight / KV element (bf16)."""

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def matmul_flops_per_row(self) -> float:
        return 2.0 * (self.params - self.embed_params)

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attn_flops_per_ctx(self) -> float:
        """FLOPs of one query row per context token it attends to (QK^T and AV, 2 each)."""
        return 4.0 * self.layers * self.heads * self.head_dim


QWEN25_7B = ModelShape("Qwen2.5-7B", params=7.62e9, embed_params=0.545e9, layers=28, hidden=3584, heads=28,
                       kv_heads=4, head_dim=128)


class Profile(ABC):
    """What the simulator asks of a device. Arrays in, arrays out (numpy broadcasting)."""

    name: str = "profile"
    cores: float | None = None
    """CPU cores shared by the processes of a run (None: every rank owns its device)."""

    @abstractmethod
    def decode_s(self, batch, rows, ctx):
        """One engine iteration: ``batch`` running requests, ``rows`` token rows, ``ctx`` KV positions."""

    @abstractmethod
    def prefill_s(self, tokens):
        """Caching ``tokens`` prompt tokens (one packed forward)."""

    @abstractmethod
    def train_s(self, seq_lens: np.ndarray, stream: bool) -> float:
        """Forward/backward of sequences of these lengths (prompt + response) on one rank:
        ``stream`` False is the plain step (old-logprob forward + training forward/backward),
        True one stream-training call (training forward/backward only)."""

    @abstractmethod
    def finish_s(self, dp: int) -> float:
        """Gradient reduction over ``dp`` ranks + optimizer step."""

    @abstractmethod
    def sync_s(self, replicas: int) -> float:
        """Weight sync trainer -> rollout engines."""

    def overhead_s(self, responses: int) -> float:
        """Per-step host work outside the phases above (exchanging the step's samples, logging)."""
        return 0.0

    def interference(self, kind: str) -> float:
        """Slowdown of the generating processes while bubble work of ``kind`` runs beside them
        (processes sharing cores only; a rank that owns its device is not slowed)."""
        return 1.0

    def spec_s(self, requests, draft_rows):
        """Work of one speculative engine iteration beyond its token rows' ``decode_s`` (drafting
        from the sources, verifying and accepting drafts) for ``requests`` running requests with
        ``draft_rows`` draft tokens in all."""
        return 0.0 * np.asarray(requests, dtype=np.float64)


@dataclass
class LinearProfile(Profile):
    """Costs fitted on this machine (``benchmarks/calibrate_sim.py``); every figure is seconds
    for ONE process running alone on one core (torchrun gives each worker one thread)."""

    name: str = "cpu"
    decode_a: float = 2.0e-3
    """Fixed cost of an engine iteration."""
    decode_b: float = 2.5e-5
    """Per token row (decode or verify row)."""
    spec_request: float = 0.0
    """Per running request per speculative iteration: drafting from the sources (calibrate_sim
    times real rollouts with and without speculation)."""
    spec_row: float = 0.0
    """Per draft token verified, on top of its row's ``decode_b``: the acceptance walk and its
    sampling (calibrate_sim: real rollouts whose bubble drafts were pre-generated, long drafts)."""
    decode_c: float = 0.0
    """Per KV position read (summed over the running requests)."""
    prefill_a: float = 1.0e-3
    """Fixed cost of a prompt-caching forward."""
    prefill_b: float = 2.5e-5
    """Per prompt token cached."""
    fwd_a: float = 2.0e-3
    """Trainer forward (old logprobs), per micro-batch."""
    fwd_b: float = 5.0e-6
    """Trainer forward, per padded token of a micro-batch."""
    fwd_c: float = 0.0
    """Trainer forward, per padded token per token of width (attention)."""
    fwdbwd_a: float = 6.0e-3
    """Trainer forward + backward, per micro-batch."""
    fwdbwd_b: float = 1.5e-5
    """Trainer forward + backward, per padded token."""
    fwdbwd_c: float = 0.0
    """Trainer forward + backward, per padded token per token of width."""
    micro_batch: int = 8
    """Rows per trainer micro-batch (trainer.micro_batch_size), padded to their longest row."""
    finish_a: float = 5.0e-3
    """Gradient all-reduce + optimizer step, fixed."""
    finish_b: float = 0.0
    """... per extra data-parallel rank."""
    sync: float = 0.015
    """Weight sync, seconds."""
    overhead_per_response: float = 0.0
    """Host work per response per step (exchange, pickling, rewards, logging)."""
    cores: float | None = 2.0
    """CPU cores the processes share."""
    slowdown: dict = field(default_factory=lambda: {"1": 1.0, "2": 1.0})
    """Measured time per unit of work with n processes computing at once, over one process
    alone and over time-sharing (``max(1, n / cores)``: megarl/sim/share.py divides each one's
    speed by that first). Up to ``cores`` it is shared caches and memory bandwidth; past it, also
    what time-sharing costs beyond the split itself (context switches, every switch refilling the
    caches: ~1.3x with 4 processes on 2 cores here). Counts between measured ones interpolate."""
    train_slowdown: dict | None = None
    """``slowdown`` for forward/backward passes (the trainers of a data-parallel step training at
    once); None: ``slowdown``. Measured apart because training contends more than decoding:
    ~1.2x for 2 processes on 2 cores where decoding is ~1.05x (calibrate_sim)."""
    bubble_interference: float | dict = 1.15
    """Slowdown of the generating processes while other processes do idle-priority bubble work,
    by kind of bubble work (``stream_train``, ``drafter_train``, ``pregen``; a number: every kind).
    ``benchmarks/calibrate_sim.py`` measures it: generating processes timed alone and beside
    idle-priority neighbours doing forward/backward passes (training) or decoding (pre-generation)."""
    meta: dict = field(default_factory=dict)
    """Where the figures come from (machine, load, date, fit residuals)."""

    def decode_s(self, batch, rows, ctx):
        return self.decode_a + self.decode_b * rows + self.decode_c * ctx

    def spec_s(self, requests, draft_rows):
        return self.spec_request * np.asarray(requests, dtype=np.float64) + self.spec_row * np.asarray(draft_rows)

    def prefill_s(self, tokens):
        return np.where(np.asarray(tokens) > 0, self.prefill_a + self.prefill_b * np.asarray(tokens), 0.0)

    def train_s(self, seq_lens: np.ndarray, stream: bool) -> float:
        lens = np.sort(np.asarray(seq_lens, dtype=np.float64))
        if lens.size == 0:
            return 0.0
        mb = self.micro_batch
        n_mb = math.ceil(lens.size / mb)
        # Micro-batches of length-sorted rows, each trimmed to its longest row (trainer.py).
        rows = np.array([min(mb, lens.size - i) for i in range(0, lens.size, mb)], dtype=np.float64)
        width = lens[np.minimum(np.arange(0, lens.size, mb) + mb, lens.size) - 1]
        padded, quad = float((rows * width).sum()), float((rows * width * width).sum())
        t = self.fwdbwd_a * n_mb + self.fwdbwd_b * padded + self.fwdbwd_c * quad
        if not stream:
            t += self.fwd_a * n_mb + self.fwd_b * padded + self.fwd_c * quad
        return t

    def finish_s(self, dp: int) -> float:
        return self.finish_a + self.finish_b * max(0, dp - 1)

    def sync_s(self, replicas: int) -> float:
        return self.sync

    def overhead_s(self, responses: int) -> float:
        return self.overhead_per_response * responses

    def speed_slowdown(self, n: int, work: str = "decode") -> float:
        """Measured slowdown of ``n`` processes computing at once (``slowdown``; ``work="train"``:
        ``train_slowdown``), linear between measured counts; past the largest one, the largest one."""
        table = self.train_slowdown if work == "train" and self.train_slowdown else self.slowdown
        keys = sorted(int(k) for k in table)
        vals = [float(table[str(k)]) for k in keys]
        return float(np.interp(n, keys, vals))

    def speed(self, n_busy: int, work: str = "decode") -> float:
        """Work per second of each of ``n_busy`` processes computing at once on ``cores`` cores."""
        if n_busy <= 0:
            return 1.0
        cores = self.cores or n_busy
        return min(1.0, cores / n_busy) / self.speed_slowdown(n_busy, work)

    def interference(self, kind: str) -> float:
        """Slowdown of the generating processes while bubble work of ``kind`` runs beside them."""
        bi = self.bubble_interference
        return float(bi) if not isinstance(bi, dict) else float(bi.get(kind, max(bi.values(), default=1.0)))

    TIME_FIELDS = ("decode_a", "decode_b", "spec_request", "spec_row", "decode_c", "prefill_a", "prefill_b",
                   "fwd_a", "fwd_b", "fwd_c", "fwdbwd_a", "fwdbwd_b", "fwdbwd_c", "finish_a", "finish_b", "sync",
                   "overhead_per_response")
    """The figures in seconds (the rest are counts and ratios)."""

    def at_speed(self, factor: float) -> LinearProfile:
        """This profile on the machine ``factor`` times slower than when it was calibrated (every
        time figure times ``factor``; contention and interference are ratios and stay): how
        benchmarks/validate_sim.py follows this machine's drift (megarl/sim/probe.py
        ``SpeedReference``)."""
        if not factor > 0:
            raise ValueError(f"profile speed factor {factor} is invalid; valid range: > 0")
        return replace(self, **{f: getattr(self, f) * factor for f in self.TIME_FIELDS})

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> LinearProfile:
        raw = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"cpu profile: unknown keys {unknown}; valid keys: {sorted(known)}")
        return cls(**raw)


@dataclass
class RooflineProfile(Profile):
    """One GPU per rollout rank (``tp`` of them per replica), costs from bytes and FLOPs (the
    arithmetic is in the module docstring)."""

    name: str = "h100"
    model: ModelShape = QWEN25_7B
    peak_flops: float = 989e12
    """Dense bf16 FLOP/s (H100 SXM)."""
    hbm_bw: float = 3.35e12
    """HBM bytes/s."""
    bw_eff: float = 0.8
    """Achieved share of HBM bandwidth in decode."""
    decode_mfu: float = 0.6
    """Achieved share of peak FLOP/s in decode/verify GEMMs when compute-bound."""
    prefill_mfu: float = 0.5
    """... in prefill."""
    train_mfu: float = 0.35
    """... in training (Megatron, long variable-length sequences)."""
    train_passes: float = 5.0
    """Forward-equivalents per token of the plain step (old logprobs 1, fwd+bwd 3, recompute 1)."""
    stream_passes: float = 4.0
    """... of stream training (its old logprobs are the training forward's)."""
    iter_overhead: float = 1.0e-3
    """Host + launch overhead per engine iteration (CUDA graphs, sampling, scheduling)."""
    tp: int = 1
    """GPUs per rollout replica (tensor parallel): weights, KV and FLOPs split over them."""
    tp_latency: float = 10e-6
    """Per all-reduce of a TP decode layer (2 per layer)."""
    grad_bw: float = 40e9
    """Bytes/s per GPU for the gradient all-reduce (400 Gb/s InfiniBand)."""
    sync_bw: float = 100e9
    """Bytes/s of the trainer -> engine weight resharding."""
    sync_latency: float = 5e-3
    """Per level of the weight broadcast tree over the replicas."""
    engine_resume: float = 1.0
    """Per step: KV cache re-allocation and CUDA-graph re-capture after training (colocated)."""
    cores = None

    def decode_s(self, batch, rows, ctx):
        m = self.model
        batch = np.maximum(batch, 1)
        mem = (m.weight_bytes + ctx * m.kv_bytes_per_token) / self.tp / (self.hbm_bw * self.bw_eff)
        flops = rows * m.matmul_flops_per_row + (rows / batch) * ctx * m.attn_flops_per_ctx
        comp = flops / self.tp / (self.peak_flops * self.decode_mfu)
        comm = 2 * m.layers * self.tp_latency if self.tp > 1 else 0.0
        return self.iter_overhead + np.maximum(mem, comp) + comm

    def prefill_s(self, tokens):
        tokens = np.asarray(tokens, dtype=np.float64)
        m = self.model
        t = self.iter_overhead + tokens * m.matmul_flops_per_row / self.tp / (self.peak_flops * self.prefill_mfu)
        return np.where(tokens > 0, t, 0.0)

    def train_s(self, seq_lens: np.ndarray, stream: bool) -> float:
        s = np.asarray(seq_lens, dtype=np.float64)
        m = self.model
        # Causal attention: a token at position i attends to i keys: sum over i = s^2 / 2.
        flops = s.sum() * m.matmul_flops_per_row + (s ** 2).sum() / 2 * m.attn_flops_per_ctx
        passes = self.stream_passes if stream else self.train_passes
        return float(passes * flops / (self.peak_flops * self.train_mfu))  # passes of one forward's FLOPs

    def finish_s(self, dp: int) -> float:
        m = self.model
        allreduce = 2 * m.weight_bytes * (dp - 1) / max(dp, 1) / self.grad_bw
        adam = 16 * m.params / max(dp, 1) / self.hbm_bw
        return allreduce + adam

    def sync_s(self, replicas: int) -> float:
        return (self.model.weight_bytes / self.sync_bw + self.sync_latency * math.ceil(math.log2(max(replicas, 1)))
                + self.engine_resume)


def h100(tp: int = 1) -> RooflineProfile:
    return RooflineProfile(tp=tp)


def load_profile(name: str, tp: int = 1) -> Profile:
    """``h100`` (first principles), or a calibrated JSON profile ``megarl/sim/profiles/<name>.json``
    (``cpu`` is the tiny model on this machine), or a path to such a JSON file."""
    if name == "h100":
        return h100(tp)
    path = Path(name) if name.endswith(".json") else PROFILE_DIR / f"{name}.json"
    if not path.is_file():
        choices = ["h100"] + sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
        raise ValueError(f"--profile={name!r} is invalid; valid choices: {choices} or a profile .json path")
    return LinearProfile.from_json(path.read_text())
