"""Replaying a measured megarl run through the simulator, to validate it against measured runs
(benchmarks/validate_sim.py, benchmarks/calibrate_sim.py; a developer tool, not in the installed package).

Given a run directory written by ``megarl train`` (as ``megarl bench schedule`` leaves them:
``config.yaml``, ``metrics.jsonl``, ``rollouts.jsonl``), every step is simulated on the run's
process count with the ``cpu`` profile, from what the run really generated:

- the response lengths of each step, by prompt uid, and the prompt lengths (the task's prompts
  tokenized as the run did; a constant if the task cannot be rebuilt);
- placement: round robin, or LPT on the run's own length history (last group mean per uid,
  megarl/sched/placement.py's LengthHistory);
- speculation: each response's measured tokens per target forward (``rollouts.jsonl``'s
  ``forwards``; older dumps: the step's ``rollout_tokens / target_forwards`` for all) and the
  step's draft rows per forward (rank 0's ``drafted_tokens`` over its share of the target
  forwards): the acceptance is an input here, what is predicted is the time. Per response
  matters: bubble drafts cover some responses whole (7 tokens a forward) and others not at all,
  and a step mean would speed up the slowest responses, the critical path, as much as the rest;
- bubble work (stream training of finished groups, bubble-draft pre-generation at idle
  priority, or pre-generation after the rollout phase when it is not bubble work), stream
  training and tail batching as the config has them. Tail batching: each
  round's started prompts, in the order the run admitted them, are rebuilt with the run's own
  ``PromptSchedule`` (megarl/sched/prompts.py) fed the prompts each step completed; a short round's
  deferred prompts hold batch rows from the start of the round until its stop: their samples are
  replayed as ``rollouts.jsonl``'s ``deferred`` entries left them (a finished sample with its
  length, one still running at the stop with the length cap: it must not finish before the stop,
  and past it its length makes no difference). Runs dumped before those entries existed fall
  back to the lengths a later long round gave the prompt (else the step's slowest); that
  under-predicts short rounds badly (-28% step time), since a regenerated response is often
  shorter than the one the stop cut.

What is compared: mean ``step_time_s`` over the steps after the first (whose figures include
one-off warm-up), predicted vs measured, and the same for ``rollout_time_s``.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import yaml

from megarl.sim.hardware import Profile
from megarl.sim.lengths import StepLengths
from megarl.sim.spec import SpecModel
from megarl.sim.step import CarryOver, StepKnobs, simulate_step


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _prompt_lengths(run_dir: Path) -> dict[int, int] | None:
    """Prompt tokens by uid, from the run's own task (None if it cannot be rebuilt)."""
    try:
        from megarl.config import load_config
        from megarl.setup_run import prepare_inputs

        inputs = prepare_inputs(load_config(str(run_dir / "config.yaml"), []))
        return {u: len(ids) for u, ids in enumerate(inputs.prompt_ids)}
    except Exception:  # noqa: BLE001 - a replay without the task falls back to a constant
        return None


def pregen_where(cfg: dict, nproc: int) -> str | None:
    """Where a run's config makes bubble drafts (megarl/sched/policy.py ``BubblePolicy``): ``"bubble"`` (in the
    replicas' idle time), ``"after"`` (after the rollout phase: one replica, or ``pregen`` not in
    ``schedule.bubble_work``), or None (none made)."""
    if not (cfg["spec"].get("enabled") and cfg["spec"].get("bubble_pregen")):
        return None
    work = cfg.get("schedule", {}).get("bubble_work", []) if nproc > 1 else []
    return "bubble" if "pregen" in work else "after"


def features_of(cfg: dict, nproc: int) -> frozenset:
    """The simulator features a run's config turns on."""
    f = set()
    if cfg["rollout"].get("placement") == "length":
        f.add("placement")
    if cfg.get("stream_train"):
        f.add("stream")
    if pregen_where(cfg, nproc) == "bubble":
        f.add("bubble")
    if cfg.get("tail", {}).get("enabled"):
        f.add("tail")
    return frozenset(f)


def _tail_rounds(run_dir: Path, steps: list[tuple], metrics: dict[int, dict], n_prompts: int | None
                 ) -> dict[int, tuple[list[int], bool]]:
    """Tail batching's rounds as the run played them: step -> (started prompts in admission
    order, long round?), from the run's config and the prompts each step completed."""
    from megarl.config import load_config
    from megarl.sched.prompts import PromptSchedule

    cfg = load_config(str(run_dir / "config.yaml"), [])
    sched = PromptSchedule(cfg.rollout.prompts_per_step, cfg.seed, cfg.rl_steps, cfg.tail,
                           n_prompts or cfg.task.num_prompts)
    out = {}
    for step, uids, _ in steps:
        rnd = sched.round(step - 1)
        if rnd.long != bool(metrics[step].get("tail_long_round")) or not set(uids) <= set(rnd.uids):
            raise ValueError(f"{run_dir}: step {step} does not replay as the run played it (long round "
                             f"{rnd.long}, the run's {metrics[step].get('tail_long_round')}): was the run resumed "
                             f"with another config, or are rollouts.jsonl and metrics.jsonl from different runs?")
        out[step] = (list(rnd.uids), rnd.long)
        sched.commit(rnd, uids)
    return out


def replay_run(run_dir: str | Path, nproc: int, profile: Profile, prompt_len: int = 12) -> dict:
    """Per-step predicted vs measured figures of one run, and their means (module docstring)."""
    run_dir = Path(run_dir)
    for name in ("config.yaml", "metrics.jsonl", "rollouts.jsonl"):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir / name} is missing (run with rollout.dump: true, as bench schedule does)")
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    metrics = {m["step"]: m for m in _jsonl(run_dir / "metrics.jsonl")}
    timeline = {t["step"]: t for t in _jsonl(run_dir / "timeline.jsonl")} if (run_dir / "timeline.jsonl").is_file() \
        else {}
    rollouts = _jsonl(run_dir / "rollouts.jsonl")
    G = cfg["rollout"]["group_size"]
    P = cfg["rollout"]["prompts_per_step"]
    plens = _prompt_lengths(run_dir)
    features = frozenset(features_of(cfg, nproc) | ({"spec"} if cfg["spec"].get("enabled") else set()))
    steps = []
    cap = cfg["rollout"]["max_new_tokens"]
    aborted: dict[int, dict[int, list[int]]] = {}  # step -> deferred uid -> its samples' lengths for the replay
    fwd: dict[int, dict[int, list[int]]] = {}  # step -> uid -> its samples' target forwards (if dumped)
    for row in rollouts:
        by_uid: dict[int, list[int]] = defaultdict(list)
        fwd[row["step"]] = defaultdict(list)
        for s in row["samples"]:
            by_uid[s["uid"]].append(len(s["tokens"]))
            if "forwards" in s:
                fwd[row["step"]][s["uid"]].append(s["forwards"])
        steps.append((row["step"], list(by_uid), by_uid))
        # A sample still running at the stop gets the length cap: past the stop, its length is
        # unknown and makes no difference (the round ends first); a finished one keeps its own.
        aborted[row["step"]] = {d["uid"]: [cap if why == "aborted" else n
                                           for n, why in zip(d["lengths"], d["finish_reasons"])]
                                for d in row.get("deferred", [])}
    rounds = _tail_rounds(run_dir, steps, metrics, len(plens) if plens else None) \
        if cfg.get("tail", {}).get("enabled") else None
    knobs = StepKnobs(group=G, max_batch=cfg["rollout"]["max_batch_size"],
                      pregen_after=pregen_where(cfg, nproc) == "after")
    history: dict[int, float] = {}
    carry, out = CarryOver(), []
    rng = np.random.default_rng(0)
    for step, uids, by_uid in steps:
        m = metrics[step]
        keep = None
        lens = [by_uid[u] for u in uids]
        if rounds is not None:
            started, long_round = rounds[step]
            keep = None if long_round else P
            slowest = sorted(lens, key=max, reverse=True)
            later = [by for st, _, by in steps if st > step]
            lens, uids, k = [], list(started), 0
            for u in started:
                if u in by_uid:
                    lens.append(by_uid[u])
                elif u in aborted[step]:  # deferred, as the stop left it (runs from before this was dumped: below)
                    lens.append(aborted[step][u])
                else:  # deferred: its lengths when a later long round ran it
                    lens.append(next((by[u] for by in later if u in by), slowest[min(k, len(slowest) - 1)]))
                    k += 1
        lens_a = np.asarray([(list(x) + [1] * G)[:G] for x in lens], dtype=np.int64)
        pl = np.asarray([plens.get(u, prompt_len) if plens else prompt_len for u in uids], dtype=np.int64)
        sl = StepLengths(lens_a, pl, lens_a.mean(axis=1))
        mean_seen = np.mean(list(history.values())) if history else 1.0
        pred = np.asarray([history.get(u, mean_seen) for u in uids], dtype=np.float64)
        tau = draft = None
        if "spec" in features and m.get("target_forwards"):
            tau = m["rollout_tokens"] / m["target_forwards"]
            draft = m.get("drafted_tokens", 0) * nproc / m["target_forwards"]
            if fwd[step]:  # each response's own tokens per forward (bubble drafts cover some, not others)
                own = [[n / max(1, f) for n, f in zip(by_uid[u], fwd[step][u])] if u in fwd[step] else []
                       for u in uids]  # (deferred prompts of a short round: the step's mean)
                tau = np.asarray([(x + [tau] * G)[:G] for x in own], dtype=np.float64)
        res, carry = simulate_step(sl, features - {"spec"}, profile, knobs, SpecModel(), nproc, carry, rng,
                                   pred=pred, keep=keep, fixed_tau=tau, fixed_draft=draft)
        for u, x in zip(uids, lens):
            if u >= 0 and u in by_uid:
                history[u] = float(np.mean(x))
        gen = [sum(e["end"] - e["start"] for e in r["events"] if e["phase"] == "generate")
               for r in timeline.get(step, {}).get("ranks", [])]
        out.append({"step": step, "pred_step_s": res.step_time_s, "meas_step_s": m["step_time_s"],
                    "pred_gen_s": float(res.extra["gen_end"].max()), "meas_gen_s": float(max(gen)) if gen else np.nan,
                    "pred_train_s": res.train_s, "meas_train_s": m["train_time_s"],
                    "pred_rollout_s": res.rollout_s, "meas_rollout_s": m["rollout_time_s"],
                    "pred_bubble_frac": res.bubble_frac, "meas_bubble_frac": m.get("bubble_frac")})
    body = out[1:] if len(out) > 1 else out
    mean = lambda k: float(np.mean([r[k] for r in body]))
    summary = {k: mean(k) for k in ("pred_step_s", "meas_step_s", "pred_rollout_s", "meas_rollout_s", "pred_gen_s",
                                    "meas_gen_s", "pred_train_s", "meas_train_s",
                                    "pred_bubble_frac", "meas_bubble_frac")}
    summary["step_rel_err"] = summary["pred_step_s"] / summary["meas_step_s"] - 1.0
    summary["rollout_rel_err"] = summary["pred_rollout_s"] / summary["meas_rollout_s"] - 1.0
    return {"features": sorted(features), "summary": summary, "steps": out}
