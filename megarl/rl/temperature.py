"""What a sampling temperature means where logprobs are scored (docs/design.md §1.3), decided once
for the engine's sampler and the trainer: a response sampled at T > 0 is scored under
``softmax(logits / T)``; a greedy one (T = 0, the raw argmax) under the raw ``softmax(logits)``."""
from __future__ import annotations

import torch


def scoring_temperature(temperature):
    """The temperature logprobs and entropies are taken at for sampling temperature ``temperature``
    (a float, or a tensor of per-row temperatures): itself, and 1 for greedy (0)."""
    if isinstance(temperature, torch.Tensor):
        return torch.where(temperature == 0, torch.ones_like(temperature), temperature)
    return 1.0 if temperature == 0.0 else float(temperature)
