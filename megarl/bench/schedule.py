"""``megarl bench schedule``: the same RL run, plain synchronous vs. megarl's long-tail scheduling,
on N processes, side by side in one benchmark.

Both variants start from the same weights (the config's SFT warm-up, run once here, or
``--from-hf``) and run the same RL steps, each as its own ``torchrun`` launch of ``megarl
train`` with the config's layout on N processes:

- ``baseline``: veRL-like synchronous GRPO: no speculation, prompts dealt round robin to the
  rollout replicas, replicas that finish early wait, training after the rollout phase.
- ``megarl``: speculative rollouts with every draft source, length-aware placement, and bubble
  work in the replicas' idle time: stream training of finished groups and pre-generation of the
  next step's bubble drafts (``schedule.bubble_work``), which the next step's speculation uses.

From each run's ``metrics.jsonl`` (means over the steps): ``bubble_frac`` (idle rank-seconds
over rank-seconds of the rollout phase, megarl/sched/timeline.py), ``rollout_time_s``,
``step_time_s``; ``rollout_speedup`` = baseline / megarl rollout time. ``exact_match``: every
step sampled the very same tokens in both runs (``rollout.dump``), and the final weights agree
within ``weight_tol`` (stream training sums the same gradients in another order: equal up to
fp32 rounding, ``weights_max_abs_diff`` says how close). Each run's timeline is in
``<work dir>/<variant>/timeline.jsonl`` (``megarl report`` draws it).

With ``--tail``, a third run, ``tail``: megarl plus tail batching (megarl/sched/tail.py), with
``tail_rollout_speedup`` and ``tail_step_speedup`` against the baseline. Its steps train other
prompts than the baseline's (short rounds defer the slowest), so it is not in ``exact_match``;
its on-policy check is ``logprob_diff_max`` in its metrics.

With ``--ablations``, megarl once more per feature with that one feature off (``ABLATIONS``:
speculation, length-aware placement, stream training, bubble drafts), so that every feature is
measured on and off (the simulator's validation, benchmarks/validate_sim.py, replays them all);
each has ``rollout_time_s``/``step_time_s`` and ``step_speedup`` over the baseline, and must sample
the baseline's tokens (``samples_identical``: none of them changes what is sampled).

With ``--speed-ref N``, each run's ``speed_ref``: N timings of a fixed one-process decode probe
right before and N right after it (megarl/sim/probe.py ``SpeedReference``): how fast the machine
was, which benchmarks/validate_sim.py uses to follow the machine's drift between calibration
and runs.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

from megarl.config import RunConfig
from megarl.sim.probe import SpeedReference
from megarl.utils.fs import atomic_write_text

# Every variant: the same steps from the same weights, no checkpoints, samples dumped.
COMMON = ["sft.steps=0", "checkpoint_every=0", "progress=false", "rollout.dump=true"]
VARIANTS = {
    "baseline": ["spec.enabled=false", "spec.bubble_pregen=false", "rollout.placement=round_robin",
                 "stream_train=false", "schedule.bubble_work=[]"],
    "megarl": ["spec.enabled=true", "spec.bubble_pregen=true", "rollout.placement=length",
               "stream_train=true", "schedule.bubble_work=[stream_train,pregen]"],
}
# megarl with one feature off (--ablations): every feature is then measured on (megarl) and off.
ABLATIONS = {
    "no_spec": ["spec.enabled=false", "schedule.bubble_work=[stream_train]"],
    "no_placement": ["rollout.placement=round_robin"],
    "no_stream": ["stream_train=false", "schedule.bubble_work=[pregen]"],
    "no_bubble_drafts": ["spec.bubble_pregen=false", "schedule.bubble_work=[stream_train]"],
}
# megarl plus tail batching (opt-in; it changes which prompts each step trains, so it is reported apart and
# not part of exact_match): the short rounds' gain on rollout and step time.
TAIL = ["tail.enabled=true"]
KEYS = ("bubble_frac", "rollout_time_s", "step_time_s")


def warm_start_overrides(what: str, config, cfg: RunConfig, overrides: list[str], work: Path, from_hf: str | None,
                         report: dict, steps: int, common: list[str]) -> list[str]:
    """The overrides of every compared run (``common`` and ``steps`` RL steps) from the same weights (``from_hf``,
    the config's ``init_from_hf``, or the config's SFT warm-up, run here once on one process into
    ``work/sft``; its time goes into ``report["sft_time_s"]``)."""
    start = from_hf or cfg.model.init_from_hf
    if from_hf is None and cfg.sft.steps > 0:
        print(f"{what}: SFT warm-up ({cfg.sft.steps} steps) -> {work / 'sft'}", flush=True)
        report["sft_time_s"] = launch_train(1, config, [*overrides, "rl_steps=0", "checkpoint_every=0", "progress=false"],
                                       work / "sft", work / "sft.log")
        start = str(work / "sft" / "hf")
    return [*overrides, *common, f"rl_steps={steps}"] + ([f"model.init_from_hf={start}"] if start else [])


def _env() -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def launch_train(nproc: int, config: str | None, overrides: list[str], run_dir: Path, log: Path) -> float:
    """``megarl train`` on ``nproc`` local processes; returns its wall time. Its output goes to
    ``log``; a failed run raises with the log's tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "megarl.cli", "train", "--run-dir", str(run_dir)]
    if config:
        cmd += ["--config", config]
    for o in overrides:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=_env(), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"bench schedule: {' '.join(cmd)} exited {proc.returncode}; log {log}:\n{tail}")
    return time.perf_counter() - t0


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _summary(run_dir: Path) -> dict:
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    out = {k: float(np.mean([m[k] for m in metrics])) for k in KEYS}
    out["forward_reduction"] = float(np.mean([m["forward_reduction"] for m in metrics]))
    out["steps"] = [{k: m.get(k) for k in (*KEYS, "step", "train_time_s", "forward_reduction", "bubble_tokens",
                                             "bubble_groups", "replica_token_imbalance", "response_len_max",
                                             "reward_mean", "tail_long_round", "tail_deferred", "logprob_diff_max")}
                    for m in metrics]
    return out


def _same_samples(a: Path, b: Path) -> tuple[bool, int]:
    """Whether two runs' ``rollouts.jsonl`` hold the same tokens at every step; and the first
    step where they differ (0 if none)."""
    ra, rb = _read_jsonl(a / "rollouts.jsonl"), _read_jsonl(b / "rollouts.jsonl")
    if len(ra) != len(rb):
        return False, min(len(ra), len(rb)) + 1
    for x, y in zip(ra, rb):
        if [(s["uid"], s["sample_idx"], s["tokens"]) for s in x["samples"]] != \
                [(s["uid"], s["sample_idx"], s["tokens"]) for s in y["samples"]]:
            return False, x["step"]
    return True, 0


def _weights_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(a / "hf" / "model.safetensors"), load_file(b / "hf" / "model.safetensors")
    if wa.keys() != wb.keys():
        return float("inf")
    return max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)


def bench_schedule(config: str | None, cfg: RunConfig, nproc: int, json_out: str, steps: int,
                   overrides: list[str], from_hf: str | None = None, work_dir: str | None = None,
                   weight_tol: float = 1e-5, tail: bool = False, ablations: bool = False, speed_ref: int = 0) -> dict:
    if nproc < 1:
        raise ValueError(f"--nproc={nproc} is invalid; valid range: >= 1")
    if speed_ref < 0:
        raise ValueError(f"--speed-ref={speed_ref} is invalid; valid range: >= 0 (0: none)")
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="megarl-bench-schedule-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"config": config, "nproc": nproc, "steps": steps, "work_dir": str(work),
                    "cpu_count": os.cpu_count()}
    base = warm_start_overrides("bench schedule", config, cfg, overrides, work, from_hf, report, steps, COMMON)
    runs = [(name, f"{name} on {nproc} processes", extra) for name, extra in VARIANTS.items()]
    if tail:
        runs.append(("tail", f"megarl + tail batching on {nproc} processes", [*VARIANTS["megarl"], *TAIL]))
    runs += [(name, f"megarl with {name} on {nproc} processes", [*VARIANTS["megarl"], *extra])
             for name, extra in (ABLATIONS.items() if ablations else ())]
    # The machine's speed right before and after each run (megarl/sim/probe.py SpeedReference):
    # benchmarks/validate_sim.py scales the simulator's profile by it.
    with SpeedReference(speed_ref) if speed_ref else contextlib.nullcontext() as ref:
        for name, what, extra in runs:
            print(f"bench schedule: {what}, {steps} steps -> {work / name}", flush=True)
            before = ref.sample() if ref else None
            wall = launch_train(nproc, config, [*base, *extra], work / name, work / f"{name}.log")
            report[name] = {**_summary(work / name), "wall_s": wall}
            if ref:
                report[name]["speed_ref"] = ref.record(before, ref.sample())
    if tail:
        report["tail_rollout_speedup"] = report["baseline"]["rollout_time_s"] / report["tail"]["rollout_time_s"]
        report["tail_step_speedup"] = report["baseline"]["step_time_s"] / report["tail"]["step_time_s"]
    for name in (ABLATIONS if ablations else ()):
        report[name]["step_speedup"] = report["baseline"]["step_time_s"] / report[name]["step_time_s"]
        report[name]["samples_identical"] = _same_samples(work / "baseline", work / name)[0]
    same, first_diff = _same_samples(work / "baseline", work / "megarl")
    diff = _weights_diff(work / "baseline", work / "megarl")
    report.update(
        rollout_speedup=report["baseline"]["rollout_time_s"] / report["megarl"]["rollout_time_s"],
        step_speedup=report["baseline"]["step_time_s"] / report["megarl"]["step_time_s"],
        samples_identical=same, first_differing_step=first_diff, weights_max_abs_diff=diff, weight_tol=weight_tol,
        exact_match=bool(same and diff <= weight_tol))
    atomic_write_text(json_out, json.dumps(report, indent=2))
    return report
