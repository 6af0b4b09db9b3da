"""One batch step's sampling set-up, request by request: the one bundle every sampling call of the
engine takes (verification, its Triton kernel, plain decoding, the fixed-shape step, the learned
drafter's chain), built by one constructor so that none of them can drift from the others.

Each field has one dtype: the temperature is in the sampling dtype (the logits', at least fp32:
``x / T`` is computed in it), top-p in float64 (``SamplingParams.top_p`` is a Python float, and
the nucleus criterion ``A_v < p * Z`` is evaluated in float64, megarl/engine/sampler.py), every
integer int64. What a temperature of 0 means (greedy: the raw argmax, no noise; logprobs and
entropy read it as 1) is decided by the sampler (``sampler.sample_keyed``, ``sampler.token_stats``)
and mirrored by the Triton kernel; nothing here rewrites it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megarl.engine.sampler import sample_keyed

_INT_FIELDS = ("top_k", "uid", "sample_idx", "position")
# A padded row (the fixed-shape step's rows past the batch): every filter off, key 0.
_PAD = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "uid": 0, "sample_idx": 0, "position": 0}


@dataclass(frozen=True)
class SamplingRows:
    """Per request b of a batch step: its sampling parameters and noise key. Request b's first
    sampled row has the key position ``position[b]``; its row j samples at ``position[b] + j``."""

    temperature: torch.Tensor
    """[B] floating, the sampling dtype; 0 = greedy."""
    top_k: torch.Tensor
    """[B] int64; 0 = off."""
    top_p: torch.Tensor
    """[B] float64; 1 = off."""
    uid: torch.Tensor
    """[B] int64: prompt uid (part of the noise key)."""
    sample_idx: torch.Tensor
    """[B] int64: sample index within the group (part of the noise key)."""
    position: torch.Tensor
    """[B] int64: response position of the request's first row (part of the noise key)."""
    seed: int
    """Run seed (part of the noise key)."""
    step: int
    """RL step whose noise is used (part of the noise key)."""

    def __post_init__(self) -> None:
        """Shapes, dtypes and devices (no device read: value ranges are ``verify``'s to check)."""
        for name in ("seed", "step"):
            if not isinstance(getattr(self, name), int):
                raise TypeError(f"SamplingRows: {name} must be an int, got {type(getattr(self, name)).__name__}")
        want = {"temperature": "floating", "top_p": torch.float64, **{f: torch.int64 for f in _INT_FIELDS}}
        b, dev = None, None
        for name, dtype in want.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise TypeError(f"SamplingRows: {name} must be a 1-d torch.Tensor [B], got "
                                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            ok = t.dtype.is_floating_point if dtype == "floating" else t.dtype == dtype
            if not ok:
                raise TypeError(f"SamplingRows: {name} has dtype {t.dtype}, expected {dtype}")
            b, dev = (t.numel(), t.device) if b is None else (b, dev)
            if t.numel() != b or t.device != dev:
                raise ValueError(f"SamplingRows: {name} is [{t.numel()}] on {t.device}; every field must be "
                                 f"[{b}] on {dev} (temperature's)")

    @classmethod
    def of(cls, reqs, positions: list[int], seed: int, step: int, dtype: torch.dtype, device,
           pad_to: int | None = None) -> "SamplingRows":
        """The rows of engine requests ``reqs`` (``uid``, ``sample_idx``, ``params``) whose first
        sampled token is at response position ``positions[b]``; ``dtype``: the sampling dtype.
        ``pad_to``: that many rows, those past ``reqs`` with every filter off and key 0."""
        pad = [_PAD] * ((pad_to if pad_to is not None else len(reqs)) - len(reqs))
        vals = [{"temperature": r.params.temperature, "top_p": r.params.top_p, "top_k": r.params.top_k,
                 "uid": r.uid, "sample_idx": r.sample_idx, "position": p} for r, p in zip(reqs, positions)] + pad
        ints = torch.tensor([[v[f] for f in _INT_FIELDS] for v in vals], dtype=torch.int64, device=device).T
        return cls(temperature=torch.tensor([v["temperature"] for v in vals], dtype=dtype, device=device),
                   top_p=torch.tensor([v["top_p"] for v in vals], dtype=torch.float64, device=device),
                   **dict(zip(_INT_FIELDS, ints)), seed=seed, step=step)

    def __len__(self) -> int:
        return self.temperature.numel()

    def take(self, index: torch.Tensor) -> "SamplingRows":
        """The rows ``index`` (e.g. the request of every verified row)."""
        return dataclasses.replace(self, **{f: getattr(self, f)[index] for f in ("temperature", "top_p",
                                                                                 *_INT_FIELDS)})

    def shifted(self, offset) -> "SamplingRows":
        """The same rows ``offset`` positions further (an int, or a tensor [B])."""
        return dataclasses.replace(self, position=self.position + offset)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Row b's token [B] from ``logits`` [B, V], with row b's noise (``sampler.sample_keyed``;
        the temperature taken in the logits' dtype)."""
        return sample_keyed(logits, self.temperature.to(logits.dtype), self.top_k, self.top_p, self.seed, self.step,
                            self.uid, self.sample_idx, self.position)

    def copy_(self, src: "SamplingRows") -> None:
        """Write ``src``'s tensors into this bundle's in place (fixed-shape buffers), same sizes."""
        for f in ("temperature", "top_p", *_INT_FIELDS):
            getattr(self, f).copy_(getattr(src, f), non_blocking=True)
