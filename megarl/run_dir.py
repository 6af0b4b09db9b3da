"""What a run directory holds when ``megarl train`` starts in it: nothing yet, a run to resume from
its latest checkpoint, a finished run, or only what a start left that ended before its first
checkpoint (docs/design.md §5).

Why the last case is its own: a run killed during SFT, inside the post-SFT checkpoint's write,
before the first ``checkpoint_every`` steps were done (``sft.steps=0``), or stopped by a full disk
at its first checkpoint, leaves ``config.yaml``, perhaps ``sft.json``, the metrics of the steps it
ran, an empty ``checkpoints/`` and the temporaries of interrupted writes. None of it can be resumed
from, and none of it is needed: the data order and the sampling noise are functions of (seed,
step), so starting again from the beginning repeats those steps exactly. Such a directory is
therefore started again, with or without ``--resume``, and the run says so.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

from megarl.checkpoint.rl_state import checkpoint_dir, is_temporary, list_checkpoints, read_state
from megarl.parallel.preempt import RECORD_NAME
from megarl.utils.metrics_log import TENSORBOARD_DIR

log = logging.getLogger("megarl")
DATA_DIGEST = "data_sha256"  # the prompt set's digest in every checkpoint's state.json (megarl/setup_run.py)
# What a start writes before its first checkpoint. config.yaml is not removed on a restart: it is
# rewritten (atomically) at once, and a directory that holds it reads as a start to every process.
START_FILES = ("sft.json", "metrics.jsonl", "timeline.jsonl", "rollouts.jsonl", RECORD_NAME, TENSORBOARD_DIR, "wandb")
# Everything else a run directory may hold: the export, megarl report's figures, Slurm's per-rank
# logs (megarl_job.sh makes logs/ before the run starts), the lock.
RUN_NAMES = (*START_FILES, "config.yaml", "checkpoints", "hf", "report", "logs", ".lock")


class RunDirError(ValueError):
    """The run directory does not fit the request (exists without --resume, nothing to resume)."""


def check_run_dir_path(run_dir: str) -> None:
    """Refuse a ``--run-dir`` that would make the run write among other files: an empty path (the
    current directory) or a symbolic link to a non-empty folder holding things no run writes (a
    link to a run directory, or to an empty folder, is fine). Reads only."""
    if not run_dir.strip():
        raise ValueError(f"--run-dir {run_dir!r} is empty: it would write into the current directory, among its "
                         f"files; give the run a folder of its own, e.g. --run-dir runs/my_run")
    path = Path(run_dir)
    if not path.is_symlink() or not path.is_dir():
        return
    foreign = sorted(p.name for p in path.iterdir() if p.name not in RUN_NAMES and not is_temporary(p.name))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"--run-dir {run_dir} is a symbolic link to {path.resolve()}, a folder that holds other "
                         f"files ({shown}), not a megarl run: the run would write among them; link to an empty "
                         f"folder, or give --run-dir a new folder")


def holds_finished_or_checkpointed_run(run_dir: Path) -> bool:
    """A checkpoint folder (intact or not: checking it is the resume's job) or the final export."""
    return bool(list_checkpoints(run_dir)) or (Path(run_dir) / "hf").exists()


def start_leftovers(run_dir: Path) -> list[Path]:
    """What an interrupted start left in ``run_dir`` (empty for a new or empty directory): its files
    (``START_FILES``, ``config.yaml``), ``checkpoints/`` (no checkpoint in it) and interrupted
    writes' temporaries. Only meaningful when :func:`holds_finished_or_checkpointed_run` is
    False. Files of the user's (or Slurm's ``logs/``) are never counted."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for name in (*START_FILES, "config.yaml", checkpoint_dir(run_dir).name):
        path = run_dir / name
        if path.exists() or path.is_symlink():
            found.append(path)
    try:
        found += [p for p in run_dir.iterdir() if is_temporary(p.name)]
    except FileNotFoundError:  # removed meanwhile (another process's restart): nothing left of it
        pass
    return sorted(found)


def clear_start(run_dir: Path) -> list[str]:
    """Remove an interrupted start's leftovers but ``config.yaml`` (the caller rewrites it) and
    return their names. Rank 0 only, holding the run directory's lock."""
    removed = []
    for path in start_leftovers(run_dir):
        if path.name == "config.yaml":
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path.name + ("/" if path.name in (TENSORBOARD_DIR, "wandb", "checkpoints") else ""))
    return removed


def restart_line(run_dir: Path, removed: list[str], resume: bool) -> str:
    """What the run says when it starts an interrupted start again."""
    what = ", ".join(removed) if removed else "config.yaml only"
    how = "--resume has nothing to resume" if resume else "a new start"
    return (f"{run_dir} holds an interrupted start and no checkpoint ({what}): {how}, so the run starts again from "
            f"the beginning (the steps it had run repeat exactly); removed what the interrupted start wrote")


def check_resume_data(ckpt: Path, data_sha256: str, source: str, allow_change: bool = False) -> None:
    """Refuse to resume from ``ckpt`` on a prompt set other than the one it was trained on (its
    recorded digest; checkpoints from before it was recorded are not checked). ``source``: where
    the data comes from, for the message. ``allow_change`` (``--allow-config-change``): a warning."""
    recorded = read_state(ckpt).get(DATA_DIGEST)
    if recorded is None or recorded == data_sha256:
        return
    what = (f"the prompt set ({source}) is not the one {ckpt} was trained on (sha256 {recorded[:12]}... then, "
            f"{data_sha256[:12]}... now)")
    if not allow_change:
        raise RunDirError(f"--resume: {what}; resume with the run's data, or pass --allow-config-change to continue "
                          f"on this data (the resumed run then repeats no uninterrupted run)")
    log.warning("resuming on changed data (--allow-config-change): %s", what)
