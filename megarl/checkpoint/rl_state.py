"""Resumable RL checkpoints: trainer state (model + optimizer) and loop state, written atomically.

Layout: ``RUN_DIR/checkpoints/step_000010/{trainer.pt,state.json[,ref.pt]}``, with one
``trainer_tp<t>_pp<p>.pt`` per model-parallel piece instead of ``trainer.pt`` when TP or PP > 1, plus
files that single processes add (``rank_files``: the learned drafter's state per rollout replica,
``drafter_replica<r>.pt``, megarl/spec/drafter_state.py). A checkpoint directory
appears only when complete (temp dir + rename), so ``latest_checkpoint`` never sees half of one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

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


def trainer_file(tp_rank: int, pp_rank: int, tp: int, pp: int) -> str:
    """Trainer-state file of model-parallel rank (tp_rank, pp_rank) (one file when TP = PP = 1)."""
    return "trainer.pt" if tp == pp == 1 else f"trainer_tp{tp_rank}_pp{pp_rank}.pt"


def save_checkpoint(run_dir: str | Path, step: int, trainer_state: dict[str, Any], loop_state: dict[str, Any],
                    keep: int = 2, dims=None, ref_state: dict[str, Any] | None = None,
                    rank_files: dict[str, Any] | None = None) -> Path:
    """Write checkpoint ``step`` (the number of completed RL steps) and prune all but ``keep``.

    Every process calls it. The DP-rank-0 process of each (TP, PP) piece writes its trainer state
    (``trainer_state`` is that process's local Megatron state); rank 0 writes ``state.json`` (with
    the trainer layout, checked on resume), the reference policy ``ref.pt`` and renames the
    finished directory into place. ``rank_files`` ({file name: object}): what this process adds,
    written with ``torch.save`` into the same directory (names must differ between processes).
    ``dims=None`` means a single process."""
    final = checkpoint_dir(run_dir) / f"step_{step:06d}"
    tp, pp = (dims.tp, dims.pp) if dims is not None else (1, 1)
    meta = {"step": step, "trainer_tp": tp, "trainer_pp": pp, "trainer_vpp": dims.vpp if dims is not None else 1,
            **loop_state}
    if dims is None or dims.world_size == 1:
        with atomic_dir(final) as tmp:
            _write(tmp, trainer_file(0, 0, 1, 1), trainer_state, meta, ref_state)
            _write_rank_files(tmp, rank_files)
    else:
        # One shared temporary directory: rank 0 makes it, every piece writes into it, rank 0
        # renames it once all have written (barriers), so the checkpoint still appears whole.
        tmp = final.with_name(f".{final.name}.tmp")
        if dims.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        if dims.trains and dims.dp_rank == 0:  # (a generating-only process has no trainer state)
            torch.save(trainer_state, tmp / trainer_file(dims.tp_rank, dims.pp_rank, tp, pp))
        _write_rank_files(tmp, rank_files)
        dist.barrier()
        if dims.rank == 0:
            _write(tmp, None, None, meta, ref_state)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        dist.barrier()
    if dims is None or dims.rank == 0:
        for _, old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _write(tmp: Path, name: str | None, trainer_state, meta: dict, ref_state) -> None:
    if name is not None:
        torch.save(trainer_state, tmp / name)
    if ref_state is not None:
        torch.save(ref_state, tmp / "ref.pt")
    with open(tmp / "state.json", "w") as f:
        json.dump(meta, f, indent=2)


def _write_rank_files(tmp: Path, rank_files: dict[str, Any] | None) -> None:
    for name, obj in (rank_files or {}).items():
        torch.save(obj, tmp / name)


def load_checkpoint(path: str | Path, dims=None) -> tuple[dict[str, Any], dict[str, Any]]:
    """This process's trainer state (plus ``ref``: the reference policy, if saved) and the loop
    state. The checkpoint's trainer TP/PP must be this run's (``dims``; None = one process)."""
    path = Path(path)
    with open(path / "state.json") as f:
        loop_state = json.load(f)
    tp, pp = (dims.tp, dims.pp) if dims is not None else (1, 1)
    vpp = dims.vpp if dims is not None else 1
    saved = (loop_state.pop("trainer_tp", 1), loop_state.pop("trainer_pp", 1), loop_state.pop("trainer_vpp", 1))
    if saved != (tp, pp, vpp):
        raise ValueError(f"checkpoint {path} was written with trainer_tp={saved[0]}, trainer_pp={saved[1]}, "
                         f"trainer_vpp={saved[2]}; this run has trainer_tp={tp}, trainer_pp={pp}, trainer_vpp={vpp}: "
                         f"resume with the same parallel.trainer_tp/pp/vpp "
                         f"(resharding a checkpoint is not supported yet; the data-parallel size may change)")
    if dims is not None and not dims.trains:  # a generating-only process: the loop state is all it needs
        return {}, loop_state
    name = trainer_file(dims.tp_rank, dims.pp_rank, tp, pp) if dims is not None else trainer_file(0, 0, 1, 1)
    # Our own files, holding Megatron optimizer state (python objects): full unpickling is needed.
    trainer_state = torch.load(path / name, map_location="cpu", weights_only=False)
    if (path / "ref.pt").exists():
        trainer_state["ref"] = torch.load(path / "ref.pt", map_location="cpu", weights_only=True)
    return trainer_state, loop_state
