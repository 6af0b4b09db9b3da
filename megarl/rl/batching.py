"""Turning (prompt, response) token lists into trainer batches.

Convention shared with the trainer: ``input_ids[b, t]`` is the t-th token of row b (right
padded); ``loss_mask[b, t]`` (shape [B, T-1]) is 1 when the prediction made at t, i.e. of token
t+1, is a response token to train on.
"""
from __future__ import annotations

import torch


def make_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    t = max(lengths)
    input_ids = torch.full((len(prompts), t), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(prompts), t - 1), dtype=torch.float32)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        if not p:
            raise ValueError(f"row {b} has an empty prompt: the first response token needs a prefix")
        input_ids[b, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        loss_mask[b, len(p) - 1 : len(p) + len(r) - 1] = 1.0
    return {"input_ids": input_ids, "loss_mask": loss_mask}



def dp_rows(batch: dict, dp_rank: int, dp: int) -> dict:
    """Data-parallel rank ``dp_rank``'s share of ``batch``: rows ``dp_rank, dp_rank + dp, ...`` of
    every per-row tensor (first dim = batch size); everything else (0-d tensors, python values)
    unchanged. Strided rows spread long and short responses evenly over the ranks; the loss stays
    normalised by the whole step's count, so the summed DP gradients equal one rank's on all rows."""
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank={dp_rank} is outside data-parallel size {dp}")
    n = batch["input_ids"].shape[0]
    if n < dp:
        raise ValueError(f"a batch of {n} rows cannot give each of {dp} data-parallel ranks a row; "
                         f"use at least {dp} sequences per step")
    if dp == 1:
        return batch
    return {k: v[dp_rank::dp] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n else v
            for k, v in batch.items()}
