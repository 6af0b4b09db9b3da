"""Fresh weights of a model that does not start from a HF checkpoint, independent of the layout.

Megatron-core initialises each TP/PP/EP piece from that rank's RNG stream, so a fresh model's
weights would depend on how it is split: a TP=2 run would not start where the single-process run
of the same seed starts. megarl draws the whole model instead, tensor by tensor under its HF name,
from a generator seeded by (seed, name), and every rank loads its piece of it. The distributions
are Megatron's defaults (``init_method_std=0.02``): weights N(0, 0.02), the output projections of
each residual branch (attention ``o_proj``, MLP / expert ``down_proj``) N(0, 0.02 / sqrt(2 L)),
norm weights 1, biases 0.
"""
from __future__ import annotations

import hashlib
import math

import torch

from megarl.models import mcore_mapping
from megarl.models.config import ModelArgs

INIT_STD = 0.02
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "w2.weight")


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"megarl-init-{seed}-{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2 ** 63 - 1))


def init_hf_state(args: ModelArgs, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF-named fresh weights of ``args`` (see the module docstring), on CPU in ``dtype``."""
    scaled = INIT_STD / math.sqrt(2.0 * args.num_hidden_layers)
    out = {}
    for name, shape in mcore_mapping.hf_shapes(args).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape, dtype=dtype)
        else:
            std = scaled if name.endswith(_RESIDUAL_OUTPUTS) else INIT_STD
            # Drawn in fp64 then cast: the same values whatever dtype a run trains in.
            w = torch.randn(shape, generator=_generator(seed, name), dtype=torch.float64) * std
            out[name] = w.to(dtype)
    return out
