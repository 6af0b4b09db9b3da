"""Resumable RL checkpoints: trainer state (model + optimizer) and loop state, written atomically.

Layout: ``RUN_DIR/checkpoints/step_000010/{trainer.pt,state.json}``. A checkpoint directory
appears only when complete (temp dir + rename), so ``latest_checkpoint`` never sees half of one.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from megarl.utils.fs import atomic_dir

_STEP_DIR = re.compile(r"^step_(\d{6})$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def save_checkpoint(run_dir: str | Path, step: int, trainer_state: dict[str, Any], loop_state: dict[str, Any],
                    keep: int = 2) -> Path:
    """Write checkpoint ``step`` (the number of completed RL steps) and prune all but ``keep``."""
    final = checkpoint_dir(run_dir) / f"step_{step:06d}"
    with atomic_dir(final) as tmp:
        torch.save(trainer_state, tmp / "trainer.pt")
        with open(tmp / "state.json", "w") as f:
            json.dump({"step": step, **loop_state}, f, indent=2)
    for _, old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    path = Path(path)
    with open(path / "state.json") as f:
        loop_state = json.load(f)
    # Our own file, holding Megatron optimizer state (python objects): full unpickling is needed.
    trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    return trainer_state, loop_state
