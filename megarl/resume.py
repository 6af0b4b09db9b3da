"""Resuming a run (docs/design.md §5): whether and from where it resumes (the run directory's
state), the checkpoint's fit to the run's config (trainer layout, optimizer kind, tail batching, KL
reference), the config fields a resume may change, what a checkpoint records for these checks, and
loading the checkpoint into the run. The checks read only; :func:`restore` alone writes (it cuts
the per-step logs back to the checkpoint's step)."""
from __future__ import annotations

import logging
from pathlib import Path

from megarl.checkpoint.rl_state import TRAINER_FORMAT, latest_checkpoint, load_checkpoint
from megarl.config import RunConfig
from megarl.run_dir import DATA_DIGEST, RunDirError, holds_finished_or_checkpointed_run, start_leftovers
from megarl.utils.dataclass_config import to_dict
from megarl.utils.jsonl import check_lines, truncate_to_step

log = logging.getLogger("megarl")


# Config fields a resumed run may change without changing its result (how long it runs, how often
# and how many checkpoints it keeps, where metrics go, failure detection, the rollouts dump, reward
# threads, the OS priority of bubble work, the chunking of weight transfers, the trainer's checkpoint
# format: either loads into the same trainer); a key ending in "."
# stands for its whole section. Everything else changes samples or updates (in fp32 even the
# batch shapes of speculation, placement or max_batch_size change rounding), so a change needs
# --allow-config-change. Listed in README.md ("Checkpoints, resume and preemption").
RECORD_CONFIG = "run_config"  # the run's config in every checkpoint's state.json (with the data's digest)
RESUME_MAY_CHANGE = ("rl_steps", "progress", "checkpoint_every", "keep_checkpoints", "logging.", "watchdog.",
                     "rollout.dump", "reward.workers", "schedule.bubble_priority", "parallel.weight_sync_bucket_mb",
                     "eval.every", "eval.samples", "eval.temperature", "eval.max_new_tokens", "eval.pass_threshold",
                     "eval.greedy", "trainer.checkpoint_format", "memory.")


def check_run_dir(run_dir: Path, resume: bool, cfg: RunConfig | None = None,
                  allow_config_change: bool = False) -> Path | None:
    """Decide where to start before touching anything; returns the checkpoint to resume from, or
    None to start from the beginning: in a new directory, or in one that holds only an interrupted
    start (megarl/run_dir.py), with or without ``resume``. With ``cfg`` (the CLI passes it), a
    resume also checks that the checkpoint fits ``cfg`` (trainer layout, tail batching, KL
    reference) and that ``cfg`` changes nothing but ``RESUME_MAY_CHANGE`` against
    ``RUN_DIR/config.yaml`` (:func:`check_resume_config`). Without ``cfg`` the run checks the fit
    itself (:func:`check_checkpoint_fits`) before it starts."""
    run_dir = Path(run_dir)
    done = holds_finished_or_checkpointed_run(run_dir)
    if resume:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None and not done and start_leftovers(run_dir):
            return None  # an interrupted start: started again (the run says so)
        if ckpt is None:
            what = "it holds the finished run's export (hf/) and" if done else "it holds no run:"
            raise RunDirError(f"--resume: {run_dir}: {what} no checkpoint under {run_dir / 'checkpoints'} to resume "
                              f"from; start the run without --resume" + (" in another --run-dir" if done else ""))
        if cfg is not None:
            check_resume_config(run_dir, cfg, allow_config_change, ckpt)
            check_checkpoint_fits(ckpt, cfg)
            for name in ("metrics.jsonl", "timeline.jsonl"):  # cut back at resume: a bad line fails now
                if (run_dir / name).is_file():
                    check_lines(run_dir / name)
        return ckpt
    if done:
        raise RunDirError(f"run dir {run_dir} already holds a run: pass --resume to continue it, "
                          f"or choose another --run-dir")
    return None


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resume_config(run_dir: Path, cfg: RunConfig, allow_change: bool = False,
                        ckpt: Path | None = None) -> list[str]:
    """Compare ``cfg`` with the config the run was started with (``RUN_DIR/config.yaml``, or when
    it is missing the one recorded in checkpoint ``ckpt``'s state.json). A changed field outside
    ``RESUME_MAY_CHANGE`` raises ``RunDirError`` naming every such field with its old and new
    value, unless ``allow_change`` (``--allow-config-change``): then they are logged and returned
    (``key: old -> new`` each). Reads only; writes nothing."""
    import yaml

    from megarl.checkpoint.rl_state import read_state
    from megarl.utils.dataclass_config import ConfigError, from_dict

    path, recorded = Path(run_dir) / "config.yaml", None
    if not path.is_file():  # deleting config.yaml must not turn the check off: the checkpoint holds it too
        recorded = read_state(ckpt).get(RECORD_CONFIG) if ckpt is not None else None
        if recorded is None and not allow_change:
            raise RunDirError(f"{path} is missing and {ckpt or 'no checkpoint'} records no config (written by an "
                              f"older megarl), so --resume cannot check that the config is the run's; restore "
                              f"config.yaml, or pass --allow-config-change to resume anyway")
        if recorded is None:
            log.warning("%s is missing: resuming without comparing configs (--allow-config-change)", path)
            return []
        path = ckpt / "state.json"
    try:
        saved = yaml.safe_load(path.read_text()) if path.name == "config.yaml" else recorded
        if not isinstance(saved, dict):
            raise ValueError(f"it holds a {type(saved).__name__}, not a mapping")
    except (OSError, ValueError, yaml.YAMLError) as e:
        if allow_change:
            log.warning("%s cannot be read (%s): resuming without comparing configs (--allow-config-change)", path, e)
            return []
        raise RunDirError(f"{path} cannot be read ({' '.join(str(e).split())}), so --resume cannot check that the "
                          f"config is the run's; pass --allow-config-change to resume anyway") from None
    try:  # typed and with today's defaults filled in, as the new config is
        old = _flat(to_dict(from_dict(RunConfig, saved)))
    except ConfigError:  # written by another megarl version: its keys over today's defaults
        old = {**_flat(to_dict(RunConfig())), **_flat(saved)}
    new = _flat(to_dict(cfg))
    missing = object()
    changed = [k for k in new if old.get(k, missing) != new[k]]
    refused = [k for k in changed if not any(k == f or (f.endswith(".") and k.startswith(f)) for f in RESUME_MAY_CHANGE)]
    lines = [f"{k}: {old.get(k, '(unset)')!r} -> {new[k]!r}" for k in refused]
    if refused and not allow_change:
        raise RunDirError(f"--resume with a config that changes the run's result: {'; '.join(lines)} (against "
                          f"{path}); resume with the run's settings, or pass --allow-config-change to continue "
                          f"with these (the resumed run then repeats no uninterrupted run); free to change: "
                          f"{', '.join(f.rstrip('.') + ('.*' if f.endswith('.') else '') for f in RESUME_MAY_CHANGE)}")
    if refused:
        log.warning("resuming %s with a changed config (--allow-config-change): %s", run_dir, "; ".join(lines))
    return lines


def check_checkpoint_fits(ckpt: Path, cfg: RunConfig) -> None:
    """What loading ``ckpt`` into a run of ``cfg`` would fail on (whatever --allow-config-change
    says), refused before the run builds anything: the one place each of these is checked."""
    from megarl.checkpoint.rl_state import read_state

    state = read_state(ckpt)
    p = cfg.parallel
    saved = tuple(state.get(f"trainer_{k}", 1) for k in ("tp", "pp", "vpp"))
    if state.get("trainer_format") == TRAINER_FORMAT:  # reshards over TP/PP/DP (megarl/trainer/dist_ckpt.py)
        _check_folder_fits(ckpt, saved[2], bool(state.get("trainer_distributed_optimizer")), cfg)
    elif saved != (p.trainer_tp, p.trainer_pp, p.trainer_vpp):
        raise RunDirError(f"checkpoint {ckpt} was written with parallel.trainer_tp/pp/vpp={'/'.join(map(str, saved))}; "
                          f"this run has {p.trainer_tp}/{p.trainer_pp}/{p.trainer_vpp}: resume with the checkpoint's "
                          f"(its trainer is in the per-piece format of older megarl or of a run with virtual "
                          f"pipeline stages, which does not reshard; the data-parallel size may change)")
    else:
        _check_optimizer_shards(ckpt, state.get("trainer_optimizer_dp", 0), cfg)
    if cfg.tail.enabled and "tail" not in state:
        raise RunDirError(f"checkpoint {ckpt} was written without tail batching: resume with tail.enabled=false, "
                          f"or start a new run")
    if cfg.grpo.kl_coef > 0 and state.get("step", 0) > 0 and not (ckpt / "ref.pt").exists():
        raise RunDirError(f"checkpoint {ckpt} holds no reference policy (it was written with grpo.kl_coef=0); "
                          f"resume with grpo.kl_coef=0")


def _check_folder_fits(ckpt: Path, saved_vpp: int, saved: bool, cfg: RunConfig) -> None:
    """A checkpoint whose trainer is a Megatron distributed checkpoint resumes on any TP/PP/DP
    layout, with its optimizer kind (``saved``: the distributed optimizer) and without virtual
    pipeline stages (which write per-piece files)."""
    if saved_vpp != cfg.parallel.trainer_vpp:
        raise RunDirError(f"checkpoint {ckpt} was written with parallel.trainer_vpp={saved_vpp}; this run has "
                          f"{cfg.parallel.trainer_vpp}: resume with the checkpoint's")
    if saved != cfg.trainer.distributed_optimizer:
        raise RunDirError(f"checkpoint {ckpt} was written with trainer.distributed_optimizer={saved}; this run has "
                          f"{cfg.trainer.distributed_optimizer}: resume with the checkpoint's")


def _check_optimizer_shards(ckpt: Path, saved_dp: int, cfg: RunConfig) -> None:
    """A checkpoint of the distributed optimizer (``saved_dp``: its data-parallel size, 0 without
    it) resumes only with it and at that DP size: each DP rank loads its own shard."""
    from megarl.parallel.launch_env import detect

    if bool(saved_dp) != cfg.trainer.distributed_optimizer:
        raise RunDirError(f"checkpoint {ckpt} was written with trainer.distributed_optimizer={bool(saved_dp)}; this "
                          f"run has {cfg.trainer.distributed_optimizer}: resume with the checkpoint's")
    if saved_dp:
        p, world = cfg.parallel, detect().world_size
        trainers = world - p.rollout_ranks if p.placement == "disaggregated" else world
        dp = trainers // (p.trainer_tp * p.trainer_pp)
        if dp != saved_dp:
            raise RunDirError(f"checkpoint {ckpt} holds the distributed optimizer's state in {saved_dp} data-parallel "
                              f"shards; this run's data-parallel size is {dp}: resume with {saved_dp} (the "
                              f"optimizer state is not resharded)")


def record(cfg: RunConfig, data_sha256: str) -> dict:
    """What a checkpoint records of the run for a resume to check: its config and data digest."""
    return {RECORD_CONFIG: to_dict(cfg), DATA_DIGEST: data_sha256}


def restore(ckpt: Path, dims, trainer, prompts, run_dir: Path) -> tuple[int, dict, dict]:
    """Load checkpoint ``ckpt`` (checked by :func:`check_checkpoint_fits`) into this process's
    ``trainer`` (None on a process that only generates) and the prompt schedule; rank 0 cuts the
    per-step logs back to its step (those steps run again). Returns the step to start from, this
    process's trainer state (with ``ref``, the KL reference, when saved) and the loop state."""
    trainer_state, loop_state = load_checkpoint(ckpt, dims)
    if trainer is not None:
        trainer.load_state_dict(trainer_state)
    start = loop_state["step"]
    prompts.load_state_dict(loop_state)
    if dims.rank == 0:
        for name in ("metrics.jsonl", "timeline.jsonl", "rollouts.jsonl"):
            truncate_to_step(run_dir / name, start)
    log.info("resumed from %s (step %d)", ckpt, start)
    return start, trainer_state, loop_state
