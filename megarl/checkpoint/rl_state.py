"""Resumable RL checkpoints: trainer state (model + optimizer) and loop state, written atomically.

Layout: ``RUN_DIR/checkpoints/step_000010/{trainer/,state.json[,ref.pt]}``: ``trainer/`` is a
Megatron-core distributed checkpoint (``torch_dist``, megarl/trainer/dist_ckpt.py; state.json
says ``"trainer_format": "torch_dist"``), which resumes on another TP/PP/DP layout and which
Megatron-LM reads. Runs with virtual pipeline stages or processes that only generate, and
checkpoints of older megarl, have ``trainer.pt`` instead, or one ``trainer_tp<t>_pp<p>.pt`` per
model-parallel piece when TP or PP > 1 (they resume in the layout that wrote them), plus
files that single processes add (``rank_files``: the learned drafter's state per rollout replica,
``drafter_replica<r>.pt``, megarl/spec/drafter_state.py). A checkpoint directory
appears only when complete (temp dir + rename), so ``latest_checkpoint`` never sees half of one.

Checksums (docs/design.md §5): a file deleted, truncated or changed after it was written used to load as
whatever was there. ``state.json`` now records every other file's SHA-256 and size
(``"checksums": {"algorithm", "files": {name: {"sha256", "bytes"}}}``) and a checksum of its own
content (``"state_sha256"``). Each writer hashes the files it wrote (read back from the page
cache right after ``torch.save``); with several processes it leaves them in a sidecar that rank
0 folds into ``state.json``. ``latest_checkpoint`` checks the cheap part (``state.json``, every
file present with its recorded size) and ``load_checkpoint`` hashes the files this process reads
(its trainer file and ``ref.pt``; other loaders call ``verify_checkpoint(path, read=[name])``, as
the drafter's per-replica file should); a mismatch raises
``CheckpointCorrupted`` naming the file and the newest earlier checkpoint that passes the same
checks, to resume from instead. Checkpoints from before checksums load unchecked, with a warning.

Orphans: a write interrupted by a crash leaves ``.step_N.tmp-*`` (or ``.step_N.tmp``) folders
that nothing removes. ``remove_orphaned_temporaries`` deletes them at the next start; it needs
the run directory's lock (megarl/utils/run_lock.py): only then is no live writer using them.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.checkpoint import checksum
from megarl.utils.fs import atomic_dir, torch_save
from megarl.utils.run_lock import RunLock

_STEP_DIR = re.compile(r"^step_(\d{6})$")
_STATE = "state.json"
TRAINER_FORMAT = "torch_dist"   # state.json's trainer_format: the trainer is in TRAINER_DIR, reshardable
TRAINER_DIR = "trainer"
_SUM_SUFFIX = ".checksum.json"   # a writer's sidecar in a multi-process write, folded into state.json
# What atomic writes leave when interrupted: atomic_dir's ".NAME.tmp-XXXX" and ".NAME.old-PID",
# save_checkpoint's shared ".step_N.tmp", export's ".hf.pieces", atomic_write_*'s ".FILE.tmp-XXXX".
_TEMPORARY = re.compile(r"^\.(?P<final>.+)\.(?:tmp-[^/]+|tmp|old-(?P<pid>\d+)|pieces)$")
log = logging.getLogger(__name__)


class CheckpointCorrupted(ValueError):
    """A checkpoint's file is missing, truncated or changed since it was written (a user error:
    the message says which checkpoint to resume from instead)."""

    def __init__(self, message: str, path: Path, previous: Path | None):
        super().__init__(message)
        self.path = path
        self.previous = previous


def is_temporary(name: str) -> bool:
    """``name`` is what an interrupted atomic write leaves (``.NAME.tmp-XXXX``, ``.hf.pieces``, ...)."""
    return _TEMPORARY.match(name) is not None


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(run_dir: str | Path, skip_corrupted: bool = False) -> Path | None:
    """The newest checkpoint, after the cheap checks (``state.json`` readable and intact, every
    file present with its recorded size). A newest one that fails them raises
    ``CheckpointCorrupted`` naming it and the previous good one, unless ``skip_corrupted``: then
    the newest good one is returned (with a warning naming each one skipped)."""
    found = list_checkpoints(run_dir)
    for i in range(len(found) - 1, -1, -1):
        path = found[i][1]
        problem = _cheap_problem(path)
        if problem is None:
            return path
        if not skip_corrupted:
            raise _corrupted(path, problem)
        log.warning("skipping corrupted checkpoint %s: %s", path, problem)
    return None


def trainer_file(tp_rank: int, pp_rank: int, tp: int, pp: int) -> str:
    """Trainer-state file of model-parallel rank (tp_rank, pp_rank) (one file when TP = PP = 1)."""
    return "trainer.pt" if tp == pp == 1 else f"trainer_tp{tp_rank}_pp{pp_rank}.pt"


def optimizer_shard_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    """The distributed optimizer's shard of data-parallel rank ``dp_rank`` > 0 of model-parallel
    rank (tp_rank, pp_rank); DP rank 0's shard is in its trainer file."""
    return f"optimizer_tp{tp_rank}_pp{pp_rank}_dp{dp_rank}.pt"


def save_checkpoint(run_dir: str | Path, step: int, trainer_state: dict[str, Any], loop_state: dict[str, Any],
                    keep: int = 2, dims=None, ref_state: dict[str, Any] | None = None,
                    rank_files: dict[str, Any] | None = None) -> Path:
    """Write checkpoint ``step`` (the number of completed RL steps) and prune all but ``keep``.

    Every process calls it. The DP-rank-0 process of each (TP, PP) piece writes its trainer state
    (``trainer_state`` is that process's local Megatron state); with the distributed optimizer
    (``optimizer_shard`` in it) every other DP rank writes its shard of the optimizer state
    (:func:`optimizer_shard_file`); rank 0 writes ``state.json`` (with
    the trainer layout, checked on resume), the reference policy ``ref.pt`` and renames the
    finished directory into place. ``rank_files`` ({file name: object}): what this process adds,
    written with ``torch.save`` into the same directory (names must differ between processes).
    ``dims=None`` means a single process."""
    final = checkpoint_dir(run_dir) / f"step_{step:06d}"
    folder = getattr(trainer_state, "write_folder", None)  # the reshardable format (module docstring)
    meta = _meta(step, dims, trainer_state, loop_state)
    if dims is None or dims.world_size == 1:
        with atomic_dir(final) as tmp:
            _write_rank_files(tmp, rank_files)
            if folder is not None:
                (tmp / TRAINER_DIR).mkdir()
                folder(tmp / TRAINER_DIR)
            _write(tmp, trainer_file(0, 0, 1, 1) if folder is None else None, trainer_state, meta, ref_state)
    else:
        _save_in_pieces(final, dims, trainer_state, folder, meta, ref_state, rank_files)
    if dims is None or dims.rank == 0:
        for _, old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _meta(step: int, dims, trainer_state, loop_state: dict[str, Any]) -> dict[str, Any]:
    """``state.json``'s content: the step, the trainer layout and format a resume checks, the loop state."""
    tp, pp = (dims.tp, dims.pp) if dims is not None else (1, 1)
    meta = {"step": step, "trainer_tp": tp, "trainer_pp": pp, "trainer_vpp": dims.vpp if dims is not None else 1,
            **loop_state}
    if getattr(trainer_state, "write_folder", None) is not None:
        meta["trainer_format"] = TRAINER_FORMAT  # (the optimizer kind: checked on resume before the start)
        meta["trainer_distributed_optimizer"] = trainer_state.distributed_optimizer
    elif trainer_state and "optimizer_shard" in trainer_state:  # (rank 0 trains: its state tells)
        meta["trainer_optimizer_dp"] = trainer_state["optimizer_shard"]["dp"]  # the DP size a resume needs
    return meta


def _save_in_pieces(final: Path, dims, trainer_state, folder, meta: dict, ref_state, rank_files) -> None:
    """:func:`save_checkpoint` over several processes, each writing its pieces."""
    # One shared temporary directory: rank 0 makes it, every piece writes into it, rank 0
    # renames it once all have written (barriers), so the checkpoint still appears whole.
    tmp = final.with_name(f".{final.name}.tmp")
    if dims.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if folder is not None:
            (tmp / TRAINER_DIR).mkdir()
    dist.barrier()
    written = []
    if folder is not None:  # every process together (rank 0 hashes its files in _write)
        folder(tmp / TRAINER_DIR)
    elif dims.trains and dims.dp_rank == 0:  # (a generating-only process has no trainer state)
        name = trainer_file(dims.tp_rank, dims.pp_rank, dims.tp, dims.pp)
        torch_save(trainer_state, tmp / name)
        written.append(name)
    elif dims.trains and "optimizer_shard" in trainer_state:
        name = optimizer_shard_file(dims.tp_rank, dims.pp_rank, dims.dp_rank)
        torch_save({"optimizer_shard": trainer_state["optimizer_shard"]}, tmp / name)
        written.append(name)
    written += _write_rank_files(tmp, rank_files)
    _write_sidecar(tmp, written, dims.rank)
    dist.barrier()
    if dims.rank == 0:
        _write(tmp, None, None, meta, ref_state)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    dist.barrier()


def _write(tmp: Path, name: str | None, trainer_state, meta: dict, ref_state) -> None:
    """The files only one process writes, then ``state.json`` with the checksums of every file in
    ``tmp`` (the other processes' from their sidecars)."""
    if name is not None:
        torch_save(trainer_state, tmp / name)
    if ref_state is not None:
        torch_save(ref_state, tmp / "ref.pt")
    files = {}
    for sidecar in sorted(tmp.glob("*" + _SUM_SUFFIX)):
        files.update(json.loads(sidecar.read_text()))
        sidecar.unlink()
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        name = path.relative_to(tmp).as_posix()   # trainer/...: the distributed checkpoint's files
        if name not in files and name != _STATE:
            files[name] = _file_record(path)
    meta = {**meta, "checksums": {"algorithm": checksum.FILES, "files": files}}
    meta["state_sha256"] = _state_digest(meta)
    with open(tmp / _STATE, "w") as f:
        json.dump(meta, f, indent=2)


def _write_rank_files(tmp: Path, rank_files: dict[str, Any] | None) -> list[str]:
    for name, obj in (rank_files or {}).items():
        torch_save(obj, tmp / name)
    return list(rank_files or {})


def _write_sidecar(tmp: Path, names: list[str], rank: int) -> None:
    """This process's files' checksums, for rank 0 to fold into ``state.json`` (hashing spreads
    over the writers instead of rank 0 reading every file)."""
    if names:
        records = {name: _file_record(tmp / name) for name in names}
        (tmp / f"rank{rank}{_SUM_SUFFIX}").write_text(json.dumps(records))


def _file_record(path: Path) -> dict:
    digest, size = checksum.file_digest(path, checksum.FILES)
    return {checksum.FILES: digest, "bytes": size}


def _state_digest(meta: dict) -> str:
    """Checksum of ``state.json``'s content without its own checksum (canonical JSON)."""
    rest = {k: v for k, v in meta.items() if k != "state_sha256"}
    return checksum.digest(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode(), checksum.FILES)


def load_checkpoint(path: str | Path, dims=None) -> tuple[dict[str, Any], dict[str, Any]]:
    """This process's trainer state (plus ``ref``: the reference policy, if saved) and the loop
    state. The checkpoint's trainer TP/PP must be this run's (``dims``; None = one process).
    Checks the checkpoint first (module docstring): every listed file present with its size, and
    the checksums of the files this process reads; ``CheckpointCorrupted`` otherwise."""
    path = Path(path)
    loop_state = read_state(path)
    tp, pp = (dims.tp, dims.pp) if dims is not None else (1, 1)
    vpp = dims.vpp if dims is not None else 1
    saved = (loop_state.pop("trainer_tp", 1), loop_state.pop("trainer_pp", 1), loop_state.pop("trainer_vpp", 1))
    loop_state.pop("trainer_optimizer_dp", None)  # checked by the trainer (and train.py before the start)
    loop_state.pop("trainer_distributed_optimizer", None)
    if loop_state.pop("trainer_format", None) == TRAINER_FORMAT:
        return _load_folder(path, loop_state, dims, saved[2], vpp)
    if saved != (tp, pp, vpp):
        raise ValueError(f"checkpoint {path} was written with trainer_tp={saved[0]}, trainer_pp={saved[1]}, "
                         f"trainer_vpp={saved[2]}; this run has trainer_tp={tp}, trainer_pp={pp}, trainer_vpp={vpp}: "
                         f"resume with the same parallel.trainer_tp/pp/vpp "
                         f"(its trainer is in the per-piece format of older megarl or of a run with virtual pipeline "
                         f"stages, which does not reshard; the data-parallel size may change, except with "
                         f"trainer.distributed_optimizer)")
    if dims is not None and not dims.trains:  # a generating-only process: the loop state is all it needs
        verify_checkpoint(path)
        return {}, loop_state
    name = trainer_file(dims.tp_rank, dims.pp_rank, tp, pp) if dims is not None else trainer_file(0, 0, 1, 1)
    # this DP rank's optimizer shard (distributed optimizer; absent at another DP size, which the
    # trainer then refuses by name, seeing DP rank 0's shard)
    shard = optimizer_shard_file(dims.tp_rank, dims.pp_rank, dims.dp_rank) if dims is not None and dims.dp_rank else None
    shard = shard if shard is not None and (path / shard).exists() else None
    verify_checkpoint(path, read=[name, "ref.pt", *([shard] if shard else [])])   # what this process loads below
    # Our own files, holding Megatron optimizer state (python objects): full unpickling is needed.
    trainer_state = torch.load(path / name, map_location="cpu", weights_only=False)
    if shard is not None:
        trainer_state.update(torch.load(path / shard, map_location="cpu", weights_only=False))
    if (path / "ref.pt").exists():
        trainer_state["ref"] = torch.load(path / "ref.pt", map_location="cpu", weights_only=True)
    return trainer_state, loop_state


def _load_folder(path: Path, loop_state: dict, dims, saved_vpp: int, vpp: int) -> tuple[dict, dict]:
    """A checkpoint in the reshardable format: the trainer loads its ``trainer/`` folder in any
    TP/PP/DP layout (``dist_folder``, megarl/trainer/dist_ckpt.py); virtual pipeline stages
    write the per-piece format, so both sides have none."""
    if saved_vpp != vpp:
        raise ValueError(f"checkpoint {path} was written with trainer_vpp={saved_vpp}; this run has trainer_vpp={vpp}: "
                         f"resume with parallel.trainer_vpp={saved_vpp}")
    if dims is not None and not dims.trains:
        verify_checkpoint(path)
        return {}, loop_state
    # every trainer process reads the folder's files (each loads the parts its layout needs)
    names = [p.relative_to(path).as_posix() for p in sorted((path / TRAINER_DIR).rglob("*")) if p.is_file()]
    verify_checkpoint(path, read=[*names, "ref.pt"])
    trainer_state: dict[str, Any] = {"dist_folder": path / TRAINER_DIR}
    if (path / "ref.pt").exists():
        trainer_state["ref"] = torch.load(path / "ref.pt", map_location="cpu", weights_only=True)
    return trainer_state, loop_state


def read_state(path: str | Path) -> dict[str, Any]:
    """``state.json`` without its checksum fields; ``CheckpointCorrupted`` if it is missing,
    not JSON, or does not match its own checksum."""
    path = Path(path)
    state, problem = _read_state(path)
    if problem is not None:
        raise _corrupted(path, problem)
    state.pop("checksums", None)
    state.pop("state_sha256", None)
    return state


_warned_unchecked: set[str] = set()


def verify_checkpoint(path: str | Path, read: list[str] = ()) -> None:
    """Raise ``CheckpointCorrupted`` unless every file ``state.json`` lists is present with its
    recorded size and the files in ``read`` (the ones the caller is about to load; names not
    listed are ignored) hash to their recorded checksums. Hashing only what a process reads
    spreads the cost over the processes. A checkpoint without checksums (older megarl) passes,
    with one warning."""
    path = Path(path)
    problem = _cheap_problem(path)
    if problem is not None:
        raise _corrupted(path, problem)
    state, _ = _read_state(path)
    files = (state.get("checksums") or {}).get("files")
    if files is None:
        if str(path) not in _warned_unchecked:
            _warned_unchecked.add(str(path))
            log.warning("checkpoint %s has no checksums (written by an older megarl): loading it unverified", path)
        return
    for name in sorted(set(read) & set(files)):
        digest, _ = checksum.file_digest(path / name, checksum.FILES)
        if digest != files[name].get(checksum.FILES):
            raise _corrupted(path, f"{name} does not match the {checksum.FILES} checksum recorded when it "
                                   f"was written")


def _read_state(path: Path) -> tuple[dict, str | None]:
    """(state, None), or ({}, what is wrong with ``state.json``)."""
    try:
        with open(path / _STATE) as f:
            state = json.load(f)
    except FileNotFoundError:
        return {}, f"{_STATE} is missing"
    except (ValueError, UnicodeDecodeError) as exc:
        return {}, f"{_STATE} is not valid JSON ({exc})"
    if not isinstance(state, dict):
        return {}, f"{_STATE} is not a JSON object"
    if "state_sha256" in state and state["state_sha256"] != _state_digest(state):
        return {}, f"{_STATE} does not match its own checksum (state_sha256)"
    return state, None


def _cheap_problem(path: Path) -> str | None:
    """What is wrong with checkpoint ``path`` short of hashing its files, or None: ``state.json``
    intact, every file it lists present with its recorded size (without checksums: the trainer
    file present)."""
    state, problem = _read_state(path)
    if problem is not None:
        return problem
    sums = state.get("checksums")
    if sums is None:   # older megarl: at least every trainer file must be there
        tp, pp = state.get("trainer_tp", 1), state.get("trainer_pp", 1)
        missing = [n for n in (trainer_file(t, p, tp, pp) for t in range(tp) for p in range(pp))
                   if not (path / n).is_file()]
        return f"{missing[0]} is missing" if missing else None
    if not isinstance(sums, dict) or not isinstance(sums.get("files"), dict):
        return f"{_STATE}: field 'checksums' is not {{'algorithm', 'files': {{name: {{...}}}}}}"
    if sums.get("algorithm") != checksum.FILES:
        return f"{_STATE}: checksum algorithm {sums.get('algorithm')!r} is not supported (valid: {checksum.FILES!r})"
    for name, record in sorted(sums["files"].items()):
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != record.get("bytes"):
            return f"{name} has {size} bytes, {record.get('bytes')} when it was written (truncated or replaced)"
    return None


def _corrupted(path: Path, problem: str) -> CheckpointCorrupted:
    """The error for checkpoint ``path``, naming the newest earlier checkpoint that passes the
    cheap checks (the files' checksums are checked when it is loaded)."""
    step = _STEP_DIR.match(path.name)
    siblings = sorted((int(m.group(1)), p) for p in path.parent.iterdir()
                      if (m := _STEP_DIR.match(p.name)) and p.is_dir()) if path.parent.is_dir() else []
    earlier = [p for s, p in siblings if step and s < int(step.group(1))]
    previous = next((p for p in reversed(earlier) if _cheap_problem(p) is None), None)
    if previous is not None:
        hint = (f"the previous good checkpoint is {previous.name}: move {path.name} out of {path.parent} (or "
                f"delete it) and resume again to continue from {previous.name}")
    else:
        hint = "no earlier checkpoint is intact: start the run again in a new run directory"
    return CheckpointCorrupted(f"checkpoint {path} is corrupted: {problem}; {hint}", path, previous)


def remove_orphaned_temporaries(run_dir: str | Path, lock: RunLock) -> list[Path]:
    """Delete what interrupted atomic writes left in ``run_dir`` and its ``checkpoints/`` (names
    like ``.step_000010.tmp-ab12``, ``.step_000010.tmp``, ``.hf.pieces``, ``.config.yaml.tmp-x``);
    return what was removed. Call it at start, on rank 0, right after taking the run directory's
    ``lock`` (required: it guarantees no live writer still uses them). One exception: an
    ``.NAME.old-PID`` whose ``NAME`` is missing is a complete older copy that a crash caught between
    ``atomic_dir``'s two renames: it is renamed back to ``NAME`` instead."""
    run_dir = Path(run_dir)
    if not lock.held or lock.run_dir.resolve() != run_dir.resolve():
        raise ValueError(f"remove_orphaned_temporaries({run_dir}) needs that run directory's lock held "
                         f"(RunLock({run_dir}).acquire()): without it a live writer's files could be deleted")
    removed = []
    for folder in (run_dir, checkpoint_dir(run_dir)):
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            m = _TEMPORARY.match(entry.name)
            if m is None:
                continue
            final = folder / m.group("final")
            if m.group("pid") is not None and not final.exists():
                os.rename(entry, final)
                log.warning("restored %s from %s (a crash between replacing and removing it)", final, entry.name)
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
    if removed:
        log.info("removed %d orphaned temporary file(s) of interrupted writes: %s", len(removed),
                 ", ".join(str(p) for p in removed))
    return removed
