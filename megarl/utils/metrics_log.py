"""Per-step metrics: ``RUN_DIR/metrics.jsonl`` always, TensorBoard and Weights & Biases on request.

``metrics.jsonl`` stays the record a run resumes from and ``megarl report`` reads; TensorBoard
(``RUN_DIR/tensorboard/``) and W&B (``RUN_DIR/wandb/``) are views of the same numbers for the
tools RL users watch runs with (verl, TRL and OpenRLHF all log to both).

Scalar names. Every numeric value of a step's metrics becomes a scalar at global step ``step``
(the 1-based RL step of ``metrics.jsonl``); strings and other non-numbers (e.g.
``weight_checksum``) go to ``metrics.jsonl`` only. TensorBoard and W&B lay out panels by the tag's
first ``/`` component, and megarl's keys are flat (``reward_mean``, ``rollout_time_s``), so a
flat key gets a group prefix, keeping the key itself whole so the tag still reads as the
``metrics.jsonl`` key: ``rollout/reward_mean``, ``time/rollout_time_s``, ``train/grad_norm``
(:func:`scalar_tag`, rules in :data:`GROUPS`; unlisted keys go to ``misc/``). Keys that already
hold a ``/`` (``spec/group/accept_rate``) are used as they are.

Resume. A resumed run re-runs the steps after its checkpoint. TensorBoard: the writer starts
with ``purge_step = resume_step + 1``, which hides the first attempt's points from that step on,
so no step shows two points. W&B: the run id is kept in ``RUN_DIR/wandb/megarl_run_id`` and the
run resumed under it; W&B refuses steps below its last one, so re-run steps that W&B already
holds are not sent again (online; an offline run's resumed part is a separate offline folder).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megarl.utils.fs import atomic_write_text
from megarl.utils.jsonl import append_line

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "megarl_run_id"
WANDB_MODES = ("online", "offline")

GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("rollout", ("reward", "entropy", "response_len", "truncated", "zero_var", "rollout_", "target_forwards",
                 "engine_forwards", "forward_reduction", "replica_")),
    ("train", ("loss", "pg_loss", "kl", "clip_frac", "ratio", "grad_norm", "update_ok", "adv_", "logprob_", "lr")),
    ("sync", ("weight_sync",)),
    ("sched", ("bubble", "drafter", "prompts", "deferred", "long_")),
)
"""Group of a flat key by its prefix (first match); before these, every key ending in ``_s``
(seconds: the step-time split, ``rollout_time_s``, ``train_time_s``, ...) goes to ``time/``."""


def scalar_tag(key: str) -> str:
    """The TensorBoard / W&B name of ``metrics.jsonl`` key ``key`` (see the module docstring)."""
    if "/" in key:
        return key
    if key.endswith("_s"):
        return f"time/{key}"
    for group, prefixes in GROUPS:
        if key.startswith(prefixes):
            return f"{group}/{key}"
    return f"misc/{key}"


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float))  # (bools too: 0/1)


@dataclass
class LoggingConfig:
    """Where per-step metrics go besides ``RUN_DIR/metrics.jsonl`` (always written)."""

    tensorboard: bool | None = None
    """Write TensorBoard event files to ``RUN_DIR/tensorboard/`` (``tensorboard --logdir
    RUN_DIR/tensorboard``). None: on when the ``tensorboard`` package is installed (it is in
    requirements.txt); true without it stops the run naming ``pip install tensorboard``."""
    wandb_project: str | None = None
    """Weights & Biases project to log to; None: no W&B. Needs ``pip install wandb``."""
    wandb_entity: str | None = None
    """W&B entity (user or team) owning the project; None: the logged-in user's default."""
    wandb_mode: Literal["online", "offline"] | None = None
    """``online``: stream to the W&B server (needs network and ``wandb login``); ``offline``: write
    the run under ``RUN_DIR/wandb/`` only, upload later with ``wandb sync``. None: what W&B
    decides, as in verl and TRL: ``$WANDB_MODE``, else ``wandb offline``'s setting, else online."""
    run_name: str | None = None
    """Display name of the run in W&B; None: the run directory's name."""

    def __post_init__(self) -> None:
        if self.tensorboard is not None and not isinstance(self.tensorboard, bool):
            raise ValueError(f"logging.tensorboard={self.tensorboard!r} is invalid; valid: true, false or null (auto)")
        for name in ("wandb_project", "wandb_entity", "run_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"logging.{name}={value!r} is invalid; valid: a non-empty string or null")
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise ValueError(f"logging.wandb_mode={self.wandb_mode!r} is invalid; valid choices: "
                             f"{list(WANDB_MODES)} or null (W&B's own default)")
        if self.wandb_project is None and (self.wandb_entity is not None or self.wandb_mode is not None):
            raise ValueError("logging.wandb_entity / logging.wandb_mode are set but logging.wandb_project is not; "
                             "set logging.wandb_project to log to W&B")

    @property
    def use_tensorboard(self) -> bool:
        """Whether TensorBoard files are written (``tensorboard``, resolved)."""
        return self.tensorboard if self.tensorboard is not None else _installed("tensorboard")

    def check_packages(self) -> None:
        """Raise ``ValueError`` naming the ``pip install`` if a requested backend's package is missing
        (call it with the other input checks, before a run writes anything)."""
        if self.tensorboard and not _installed("tensorboard"):
            raise ValueError("logging.tensorboard=true needs the tensorboard package: pip install tensorboard "
                             "(or set logging.tensorboard=false)")
        if self.wandb_project is not None and not _installed("wandb"):
            raise ValueError(f"logging.wandb_project={self.wandb_project!r} needs the wandb package: pip install wandb "
                             f"(or leave logging.wandb_project unset)")


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


class MetricsLogger:
    """Writes each step's metrics to ``metrics.jsonl``, TensorBoard and W&B (module docstring).

    ``enabled=False`` (every process but rank 0) makes every method a no-op. ``config_dict``: the
    resolved run config, stored as the W&B run config and as TensorBoard text. ``resume_step``:
    the checkpoint's step when resuming (0: a fresh run).
    """

    def __init__(self, run_dir: str | os.PathLike, cfg: LoggingConfig, enabled: bool = True,
                 config_dict: dict | None = None, resume_step: int = 0):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.enabled = enabled
        self._tb = self._wandb = None
        self._wandb_from = 0  # W&B drops steps below the run's current one: those are not sent
        if not enabled:
            return
        cfg.check_packages()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        where = [str(self.path)]
        if cfg.use_tensorboard:
            self._tb = _tensorboard_writer(self.run_dir / TENSORBOARD_DIR, resume_step, config_dict)
            where.append(f"TensorBoard {self.run_dir / TENSORBOARD_DIR}")
        if cfg.wandb_project is not None:
            self._wandb = _wandb_run(self.run_dir, cfg, config_dict, resume_step)
            self._wandb_from = self._wandb.step
            where.append(f"W&B offline {Path(self._wandb.dir).parent} (upload: wandb sync)" if self._wandb.offline
                         else f"W&B {self._wandb.url}")
        log.info("metrics: %s", ", ".join(where))

    def log(self, step: int, metrics: dict) -> None:
        """Record step ``step``'s ``metrics`` (a ``"step"`` key in it must equal ``step``)."""
        if not self.enabled:
            return
        if metrics.get("step", step) != step:
            raise ValueError(f"metrics['step']={metrics['step']!r} differs from step={step}")
        record = {"step": step, **{k: v for k, v in metrics.items() if k != "step"}}
        append_line(self.path, record)  # first: the record resume and reports rely on
        scalars = {scalar_tag(k): float(v) for k, v in record.items() if k != "step" and _is_scalar(v)}
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, global_step=step)
            self._tb.flush()  # a crash must not lose steps that metrics.jsonl (and a checkpoint) have
        if self._wandb is not None and step >= self._wandb_from:
            self._wandb.log(scalars, step=step)

    def close(self, failed: bool = False) -> None:
        """Flush and close the backends (idempotent); ``failed`` marks the W&B run as crashed."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish(exit_code=1 if failed else 0)
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)


_EVENT_TIME = re.compile(r"^events\.out\.tfevents\.(\d+)\.")


def _tensorboard_writer(log_dir: Path, resume_step: int, config_dict: dict | None):
    from torch.utils.tensorboard import SummaryWriter

    # TensorBoard reads a run's event files in name order, and names start with the second they
    # were opened in: the resumed file must sort after the old ones for its purge to apply to them.
    newest = max((int(m.group(1)) for p in (log_dir.iterdir() if log_dir.is_dir() else ())
                  if (m := _EVENT_TIME.match(p.name))), default=0)
    if newest >= int(time.time()):
        time.sleep(newest + 1 - time.time())
    writer = SummaryWriter(log_dir=str(log_dir), purge_step=resume_step + 1 if resume_step > 0 else None)
    if config_dict is not None and resume_step == 0:
        # Indented four spaces: TensorBoard's text plugin renders markdown, this keeps it verbatim.
        text = "\n".join("    " + ln for ln in json.dumps(config_dict, indent=2, default=str).splitlines())
        writer.add_text("config", text, global_step=0)
    return writer


def _wandb_run(run_dir: Path, cfg: LoggingConfig, config_dict: dict | None, resume_step: int):
    import wandb

    id_file = run_dir / "wandb" / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if resume_step > 0 and id_file.is_file() else None
    run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, name=cfg.run_name or run_dir.resolve().name,
                     dir=str(run_dir), mode=cfg.wandb_mode, config=config_dict, id=run_id,
                     resume="allow" if run_id else None,
                     # W&B's banner would add lines before the progress bar; the URL is logged instead.
                     settings=wandb.Settings(silent=True))
    atomic_write_text(id_file, run.id + "\n")
    return run

