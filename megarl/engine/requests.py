"""What the rollout engine is given and gives back: its configuration, requests and results."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.engine.sampler import SamplingParams

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
_KV_CACHES = ("slots", "paged")


@dataclass
class EngineConfig:
    """Shape of the rollout engine."""

    max_batch_size: int = 64
    """Most requests running at once (= KV-cache slots)."""
    max_seq_len: int = 2048
    """Longest prompt + response, in tokens (= KV-cache positions per slot)."""
    dtype: str = "float32"
    """Model and cache dtype: one of float32, float64, bfloat16."""
    device: str = "cpu"
    """Device of the model and cache: cpu or cuda (cuda:N also accepted)."""
    kv_cache: str = "slots"
    """KV-cache layout: ``slots`` (one max_seq_len row per running request, read in place; the
    fastest on CPU) or ``paged`` (blocks of ``kv_block_size`` positions per request, freed as
    requests finish; a GRPO group's samples share their prompt's blocks; Triton decode attention on
    CUDA). Both give the same tokens."""
    kv_block_size: int = 16
    """Positions per block of the paged cache (a power of two; >= 16 for the CUDA kernel)."""
    num_kv_blocks: int = 0
    """Blocks in the paged cache's pool; 0 = enough for max_batch_size requests of max_seq_len
    positions (the slot cache's memory). Fewer blocks admit fewer requests at once: a request is
    admitted only once the pool can hold its longest possible length."""
    cpu_packed_linears: bool = True
    """CPU, float32/bfloat16: run the model's linears through oneDNN on weights reordered once
    (megarl/models/packed_linear.py): 1.3-3x faster matmuls on this project's CPUs, a row's bits
    the same for any row count from 2 up, one more copy of the weights in memory. False: ``F.linear``."""
    static_shapes: bool = False
    """Run decode/verify steps over fixed shapes (rows and tokens padded to buckets; buffers made
    once per bucket, megarl/engine/static_step.py): the step a CUDA graph can capture. Needs
    ``kv_cache: paged``; not with a learned drafter yet. Same tokens as the default step."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size} is invalid; valid range: >= 1")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len} is invalid; valid range: >= 2")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid; valid choices: {sorted(_DTYPES)}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device={self.device!r} is invalid; valid choices: cpu, cuda")
        if self.kv_cache not in _KV_CACHES:
            raise ValueError(f"kv_cache={self.kv_cache!r} is invalid; valid choices: {', '.join(_KV_CACHES)}")
        if self.kv_block_size < 1 or self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(f"kv_block_size={self.kv_block_size} is invalid; valid: a power of two")
        if self.num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} is invalid; valid range: >= 0 (0 = automatic)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass
class Request:
    """One response to generate."""

    uid: int
    """Prompt uid (same for every sample of a GRPO group); part of the noise key."""
    sample_idx: int
    """Index of this sample within its prompt's group; part of the noise key."""
    prompt_ids: list[int]
    """Prompt token ids."""
    params: SamplingParams = field(default_factory=SamplingParams)
    """How to sample."""


@dataclass
class Result:
    """One finished response."""

    uid: int
    """Prompt uid of the request."""
    sample_idx: int
    """Sample index of the request."""
    prompt_ids: list[int]
    """Prompt token ids of the request."""
    tokens: list[int]
    """Generated token ids (a final stop token included)."""
    logprobs: list[float]
    """log p(token) under softmax(logits / T), unfiltered (T=1 for greedy)."""
    entropies: list[float]
    """Entropy of softmax(logits / T) at each generated position (T=1 for greedy)."""
    finish_reason: str
    """"stop" (a stop token was sampled), "length" (max_new_tokens or max_seq_len) or "aborted"
    (``generate``'s ``should_stop`` ended it early: bubble work only)."""
    n_forwards: int
    """Target forward passes this request took part in, prefill included."""
    temperature: float
    """Temperature the response was sampled at (0: greedy); ``logprobs`` are at it (T=1 for
    greedy). The trainer checks it scores at the same one (megarl/rl/grpo.py ``grpo_batch``,
    docs/design.md §1.3)."""
