"""Weight sync from trainer to rollout engine, through HF names (DESIGN.md §3).

Single-process form: the trainer's shards are the whole model, so sync is a name-mapped copy.
Every sync is verified: a checksum over the engine's tensors must equal the checksum of the
trainer's tensors cast to the engine's dtype, or the run stops.
"""
from __future__ import annotations

import hashlib
import time

import torch


def tensor_checksum(named: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every tensor, in name order."""
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class WeightSyncError(RuntimeError):
    """Engine weights differ from the trainer's after a sync."""


def sync_weights(trainer, engine) -> dict[str, float | str]:
    """Copy the trainer's weights into the engine and prove they arrived intact."""
    t0 = time.perf_counter()
    hf = trainer.hf_state_dict()
    engine.load_weights(hf)
    dt = time.perf_counter() - t0
    engine_sd = engine.model.state_dict()
    dtype = next(iter(engine_sd.values())).dtype
    expected = tensor_checksum({k: v.to(dtype) for k, v in hf.items() if k in engine_sd})
    got = tensor_checksum(engine_sd)
    if expected != got or set(engine_sd) - set(hf):
        raise WeightSyncError(
            f"engine weights differ from trainer weights after sync (checksum {got[:12]} != {expected[:12]}; "
            f"names only in engine: {sorted(set(engine_sd) - set(hf))})"
        )
    nbytes = sum(t.numel() * t.element_size() for t in hf.values())
    return {"weight_sync_s": dt, "weight_sync_bytes": float(nbytes), "weight_checksum": got[:16],
            "weight_sync_gbps": nbytes / max(dt, 1e-9) / 1e9}
