"""``megarl bench drafter``: the learned drafter, trained in bubbles, measured in one run.

1. The config's SFT warm-up, once, on one process (or ``--from-hf``).
2. RL runs of ``--steps`` steps on ``--nproc`` processes (``torchrun``, the config's layout)
   from that policy, identical but for ``drafter_train`` in ``schedule.bubble_work``: ``off``
   never trains the drafter, ``on`` trains it in its replicas' bubbles and exports it to
   ``hf/drafter``. Both capture hidden states and draft with the sources only
   (``spec.drafter.strategy=sources``), so they do the same rollout work and
   ``step_time_ratio`` (mean step time on / off) is the cost of bubble-time training alone. Each
   kind runs twice, in the order off, on, on, off (``ORDER``): the machine's drift cancels;
   ``train_time_ratio`` (the trainer's work is identical in all four) shows what is left of it, and
   ``step_time_ratio_drift_corrected`` (step over train ratio) divides that out.
3. In this process, on prompts never seen before (uids past the prompt set: neither SFT, RL,
   history nor bubble drafts have met them), with the ``on`` run's final policy, at the config's
   temperature: generation with speculation off (the reference), with an untrained drafter and
   with the bubble-trained one (drafter only, no cost rule: every row drafts ``spec.drafter.k``
   tokens), the trained one with the config's cost rule, combined with the group/prompt sources,
   and the bandit strategy. ``exact_match``: every variant gave the reference's tokens.

``forward_reduction_unseen`` = 1 - target forwards / tokens with the trained drafter;
``accept_len_*`` = tokens per forward that carried a draft (accepted drafts + the target's token).
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from megarl.bench.schedule import launch_train, _read_jsonl, warm_start_overrides
from megarl.config import RunConfig
from megarl.engine import Engine, Request, SamplingParams
from megarl.models.hf_io import load_hf_model
from megarl.setup_run import prepare_inputs
from megarl.spec.config import DrafterConfig
from megarl.spec.speculator import Speculator
from megarl.utils.fs import atomic_write_text

RUNS = {
    "off": ["schedule.bubble_work=[]", "spec.drafter.steps_after_rollout=0"],
    "on": ["schedule.bubble_work=[drafter_train]"],
}
COMMON = ["sft.steps=0", "checkpoint_every=0", "progress=false", "spec.enabled=true", "spec.bubble_pregen=false",
          "stream_train=false", "spec.drafter.enabled=true", "spec.drafter.strategy=sources"]
# off, on, on, off: this machine's speed drifts by several percent over minutes, and the mirrored
# order cancels a linear drift out of the on/off ratio (each kind's steps are averaged over its two runs).
ORDER = ("off", "on", "on2", "off2")
UNSEEN_UID0 = 1_000_000  # problem uids from here on are outside any prompt set of the default task


def _unseen_requests(cfg: RunConfig, inputs, n_prompts: int) -> list[Request]:
    if inputs.task is None:
        raise ValueError("bench drafter needs data.source=addition (it draws prompts never seen before from the task)")
    r = cfg.rollout
    params = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                            stop_token_ids=inputs.tokenizer.stop_ids)
    return [Request(u, i, inputs.tokenizer.encode_prompt(inputs.task.problem(u).prompt), params)
            for u in range(UNSEEN_UID0, UNSEEN_UID0 + n_prompts) for i in range(r.group_size)]


def _variant(model, cfg: RunConfig, reqs, ref, passes: int = 1, **drafter) -> dict:
    """Generate ``reqs`` (``passes`` times, at steps 0..passes-1) with one speculation setting."""
    spec_cfg = dataclasses.replace(cfg.spec, enabled=True, **drafter.pop("spec", {}))
    spec_cfg.drafter = DrafterConfig(**{**dataclasses.asdict(cfg.spec.drafter), "enabled": True, **drafter})
    spec = Speculator(spec_cfg)
    ecfg = cfg.rollout.engine_config(model.args.max_position_embeddings)
    eng = Engine(model, ecfg, seed=cfg.seed, spec=spec)
    tokens = forwards = 0
    exact = True
    t0 = time.perf_counter()
    for step in range(passes):
        res = eng.generate(reqs, step)
        exact &= [r.tokens for r in res] == ref[step]
        tokens += sum(len(r.tokens) for r in res)
        forwards += sum(r.n_forwards for r in res)
    m = spec.metrics()
    out = {"time_s": time.perf_counter() - t0, "tokens": tokens, "target_forwards": forwards,
           "forward_reduction": 1.0 - forwards / max(tokens, 1), "accept_len": m.get("spec/accept_len_mean", 0.0),
           "drafter_accept_len": m.get("spec/drafter/accept_len_mean", 0.0), "exact_match": exact}
    strat = {k.removeprefix("spec_strategy/"): v for k, v in m.items() if k.startswith("spec_strategy/")}
    if strat:
        out["bandit"] = strat
        buckets = sorted({int(k.split("/")[0]) for k in strat})
        out["bandit_most_chosen"] = {
            b: max((k.split("/")[1] for k in strat if k.startswith(f"{b}/") and not k.endswith("_reward")),
                   key=lambda a: strat[f"{b}/{a}"]) for b in buckets}
    return out


def bench_drafter(config: str | None, cfg: RunConfig, json_out: str, overrides: list[str], steps: int = 12,
                  nproc: int = 2, eval_prompts: int = 32, from_hf: str | None = None,
                  work_dir: str | None = None) -> dict:
    if nproc < 2:
        raise ValueError(f"--nproc={nproc} is invalid: bubbles need >= 2 rollout replicas (valid range: >= 2)")
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="megarl-bench-drafter-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"config": config, "nproc": nproc, "steps": steps, "work_dir": str(work),
                    "temperature": cfg.rollout.temperature, "eval_prompts": eval_prompts,
                    "group_size": cfg.rollout.group_size, "drafter": dataclasses.asdict(cfg.spec.drafter)}
    base = warm_start_overrides("bench drafter", config, cfg, overrides, work, from_hf, report, steps, COMMON)
    _train_runs(config, base, work, nproc, steps, report)
    report.update(_unseen_prompts(cfg, work, eval_prompts))
    atomic_write_text(json_out, json.dumps(report, indent=2))
    return report


def _train_runs(config: str | None, base: list[str], work: Path, nproc: int, steps: int, report: dict) -> None:
    """The RL runs with drafter training on and off (alternated, ``ORDER``), their figures in
    ``report``, and the step-time ratios on/off, paired step by step and corrected for drift."""
    for name in ORDER:
        kind = name.rstrip("2")
        print(f"bench drafter: RL run with drafter training {kind} ({nproc} processes, {steps} steps) -> {name}",
              flush=True)
        wall = launch_train(nproc, config, [*base, *RUNS[kind]], work / name, work / f"{name}.log")
        metrics = _read_jsonl(work / name / "metrics.jsonl")
        report[f"run_{name}"] = {"wall_s": wall, "step_time_s": float(np.mean([m["step_time_s"] for m in metrics])),
                                 "rollout_time_s": float(np.mean([m["rollout_time_s"] for m in metrics])),
                                 "train_time_s": float(np.mean([m["train_time_s"] for m in metrics])),
                                 "bubble_frac": float(np.mean([m["bubble_frac"] for m in metrics])),
                                 "drafter_train_steps": [m.get("drafter_train_steps", 0) for m in metrics],
                                 "drafter_loss": [m.get("drafter_loss") for m in metrics],
                                 "step_time_s_each": [m["step_time_s"] for m in metrics]}
    of_kind = {k: [n for n in ORDER if n.rstrip("2") == k] for k in RUNS}
    each = {k: np.array([report[f"run_{n}"]["step_time_s_each"] for n in names]).mean(axis=0)
            for k, names in of_kind.items()}
    report["step_time_ratio"] = float(each["on"].mean() / each["off"].mean())
    # The runs sample the same tokens step by step: per-step ratios pair equal work (robust to a slow step).
    report["step_time_ratio_median_paired"] = float(np.median(each["on"] / each["off"]))
    # The trainer's work is the same in every run (same samples): its on/off ratio is the machine's drift.
    train = {k: np.mean([report[f"run_{n}"]["train_time_s"] for n in names]) for k, names in of_kind.items()}
    report["train_time_ratio"] = float(train["on"] / train["off"])
    # Drafter training happens in the rollout phase's bubbles only (joined before the trainer runs), so
    # the trainer's ratio is the machine's speed between the runs; dividing it out leaves the training's cost.
    report["step_time_ratio_drift_corrected"] = report["step_time_ratio"] / report["train_time_ratio"]


def _unseen_prompts(cfg: RunConfig, work: Path, eval_prompts: int) -> dict:
    """Speculation off, with the untrained drafter and with the bubble-trained one (alone, under
    the cost rule, combined with other sources, under the bandit) on prompts the runs never saw."""
    print("bench drafter: unseen prompts, speculation off / untrained / bubble-trained drafter", flush=True)
    trained = work / "on" / "hf" / "drafter"
    if not trained.is_dir():
        raise RuntimeError(f"bench drafter: the 'on' run exported no drafter at {trained}")
    eval_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from_hf=str(work / "on" / "hf")))
    inputs = prepare_inputs(eval_cfg)
    dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[cfg.rollout.dtype]
    model = load_hf_model(work / "on" / "hf", dtype)
    reqs = _unseen_requests(cfg, inputs, eval_prompts)
    ref_eng = Engine(model, cfg.rollout.engine_config(model.args.max_position_embeddings), seed=cfg.seed)
    ref, t_off = [], []
    for step in range(3):
        t0 = time.perf_counter()
        ref.append([r.tokens for r in ref_eng.generate(reqs, step)])
        t_off.append(time.perf_counter() - t0)
    k = cfg.spec.drafter.k
    no_cost = {"spec": {"forward_cost_tokens": 0.0, "sources": ()}}
    v = {
        "untrained": _variant(model, cfg, reqs, ref, strategy="drafter", init_from=None, **no_cost),
        "trained": _variant(model, cfg, reqs, ref, strategy="drafter", init_from=str(trained), **no_cost),
        "trained_cost_rule": _variant(model, cfg, reqs, ref, strategy="drafter", init_from=str(trained),
                                      spec={"sources": ()}),
        "trained_combined": _variant(model, cfg, reqs, ref, strategy="combined", init_from=str(trained),
                                     spec={"sources": ("group", "prompt")}),
        "bandit": _variant(model, cfg, reqs, ref, passes=3, strategy="bandit", init_from=str(trained),
                           spec={"sources": ("group", "prompt")}),
    }
    return dict(
        forward_reduction_unseen=v["trained"]["forward_reduction"],
        accept_len_trained=v["trained"]["accept_len"],
        accept_len_untrained=v["untrained"]["accept_len"],
        forward_reduction_unseen_untrained=v["untrained"]["forward_reduction"],
        exact_match=all(x["exact_match"] for x in v.values()),
        draft_k=k, off_time_s=t_off[0], off_time_s_3_passes=sum(t_off), variants=v)
