"""``megarl bench rollout``: the same RL rollouts with speculation off and on, side by side.

One process runs the real loop of a config (SFT warm-up, then GRPO steps that change the policy)
and, at every step, generates the step's samples with one engine several times: without
speculation (the reference) and with every draft source; on probe steps (the first step with
bubble drafts, the first and last with history) also with each source alone and with bubble
drafts made from unrelated noise (``bubble_uncoupled``: what coupling gains). Every variant must
give exactly the reference's tokens. Bubble drafts for step t+1 are pre-generated after step t's
rollouts with step t's weights; their time is reported apart (``bubble_time_s``): on a cluster it
fills idle ranks, so the rollout speedup does not include it.

``forward_reduction`` is ``1 - target_forwards / rollout_tokens``: without speculation every
token costs its request one target forward.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from megarl.config import RunConfig
from megarl.engine import Engine
from megarl.models.llama import CausalLM
from megarl.parallel.dist import init_distributed, shutdown_distributed
from megarl.parallel.weight_sync import WeightSync
from megarl.sched.prompts import prompt_uids_for_step
from megarl.rollout.stage import RolloutStage
from megarl.stages.sft import run_sft
from megarl.rl.grpo import UpdateSpec
from megarl.stages.update import grpo_update
from megarl.setup_run import prepare_inputs
from megarl.spec.speculator import Speculator
from megarl.trainer.trainer import Trainer
from megarl.train import set_deterministic
from megarl.utils.fs import atomic_write_text


def _variants(cfg: RunConfig) -> dict[str, Speculator]:
    spec = dataclasses.replace(cfg.spec, enabled=True)
    out = {"all": Speculator(spec)}
    for name in spec.sources:
        out[name] = Speculator(dataclasses.replace(spec, sources=(name,)))
    if "bubble" in spec.sources:
        out["bubble_uncoupled"] = Speculator(dataclasses.replace(spec, sources=("bubble",)))
    return out


TAIL_FRACTION = 0.1
"""The tail of a rollout: from the moment all but this fraction of its requests have finished."""


def _timed_generate(engine: Engine, reqs, step: int):
    """``engine.generate`` timed: (results, seconds, seconds of its tail, ``TAIL_FRACTION``)."""
    finished = []
    t0 = time.perf_counter()
    res = engine.generate(reqs, step, on_finish=lambda i, r: finished.append(time.perf_counter()))
    end = time.perf_counter()
    n_tail = max(1, round(TAIL_FRACTION * len(reqs)))
    tail_start = sorted(finished)[-n_tail - 1] if len(finished) > n_tail else t0
    return res, end - t0, end - tail_start


def _figures(results, engine: Engine, seconds: float, tail_s: float) -> dict:
    tokens = sum(len(r.tokens) for r in results)
    forwards = sum(r.n_forwards for r in results)
    longest = max(results, key=lambda r: len(r.tokens))
    m = engine.spec.metrics() if engine.spec is not None else {}
    return {"time_s": seconds, "tail_time_s": tail_s, "tokens": tokens, "target_forwards": forwards,
            "longest_tokens": len(longest.tokens), "longest_forwards": longest.n_forwards,
            "engine_forwards": engine.stats["forwards"], "forward_reduction": 1.0 - forwards / max(tokens, 1),
            "accept_len_mean": m.get("spec/accept_len_mean", 0.0),
            "drafted_forwards": m.get("spec/forwards", 0), "drafted_forward_tokens": m.get("spec/tokens", 0)}


def probe_steps(cfg: RunConfig, steps: int, n_prompts: int) -> set[int]:
    """Steps where every variant runs (the others run only "off" and "all", to keep the benchmark
    short): the first step with bubble drafts, and the first and last steps with history."""
    first_history = -(-n_prompts // cfg.rollout.prompts_per_step)
    return {s for s in (1, first_history, steps - 1) if 0 <= s < steps}


def bench_rollout(cfg: RunConfig, steps: int, out_json: str | Path, progress: bool = True) -> dict:
    """Run ``steps`` RL steps of ``cfg`` with the rollout variants; write and return the figures."""
    inputs = prepare_inputs(cfg)
    if cfg.deterministic:
        set_deterministic()
    dims = init_distributed()
    try:
        trainer = Trainer(inputs.args, cfg.trainer, dims, hf_dir=inputs.init_from_hf,
                          mcore_dir=inputs.init_from_mcore, seed=cfg.seed)
        if cfg.sft.steps > 0:
            run_sft(trainer, inputs, cfg.sft, cfg.seed, cfg.progress)
            trainer.reset_optimizer()
        trainer.set_lr(cfg.trainer.lr)
        engine = Engine(CausalLM(inputs.args), cfg.rollout.engine_config(inputs.max_seq_len),
                        seed=cfg.seed)
        weight_sync = WeightSync(trainer, engine)  # planned once, run after every update
        weight_sync()
        stage = RolloutStage(engine, inputs, cfg.rollout, cfg.reward)
        variants = _variants(cfg)
        probes = probe_steps(cfg, steps, len(inputs.problems))
        per_step = []
        for step in tqdm(range(steps), desc="bench rollout", disable=not progress):
            per_step.append(_bench_step(step, steps, cfg, inputs, engine, stage, variants, probes))
            groups = per_step[-1].pop("_groups")
            grpo_update(trainer, groups, UpdateSpec.of(cfg, inputs.tokenizer.pad_id))
            weight_sync()
    finally:
        shutdown_distributed()
    report = _summary(per_step, cfg)
    path = Path(out_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(report, indent=2) + "\n")
    return report


def _bench_step(step, steps, cfg, inputs, engine, stage, variants, probes) -> dict:
    uids = prompt_uids_for_step(step, cfg.rollout.prompts_per_step, cfg.seed, len(inputs.problems))
    reqs = stage.requests(uids)
    row = {"step": step}
    engine.spec = None
    engine.reset_stats()
    ref, seconds, tail_s = _timed_generate(engine, reqs, step)
    row["ar"] = _figures(ref, engine, seconds, tail_s)
    ref_tokens = [r.tokens for r in ref]
    row["entropy_mean"] = float(np.mean([e for r in ref for e in r.entropies]))
    row["has_bubble"] = variants["all"].bubble is not None and variants["all"].bubble.has_drafts(step)
    row["has_history"] = step * cfg.rollout.prompts_per_step >= len(inputs.problems)
    row["probe"] = step in probes
    exact = True
    for name, spec in variants.items():
        if name != "all" and step not in probes:
            spec.end(ref, step, "rollout")  # not measured this step, but history still grows
            continue
        engine.spec = spec
        engine.reset_stats()
        res, seconds, tail_s = _timed_generate(engine, reqs, step)
        row[name] = _figures(res, engine, seconds, tail_s)
        row[name]["exact_match"] = [r.tokens for r in res] == ref_tokens
        # Responses that left the reference's tokens (each counts once, at its first divergence).
        row[name]["mismatched"] = sum(r.tokens != t for r, t in zip(res, ref_tokens))
        row[name]["mismatches"] = [first_divergence(i, r.tokens, t) for i, (r, t) in enumerate(zip(res, ref_tokens))
                                   if r.tokens != t]
        exact &= row[name]["exact_match"]
    row["exact_match"] = exact
    if step + 1 < steps and "bubble_uncoupled" in variants:
        nxt = stage.requests(prompt_uids_for_step(step + 1, cfg.rollout.prompts_per_step, cfg.seed, len(inputs.problems)))
        engine.spec = variants["all"]
        t0 = time.perf_counter()
        pre = engine.pregenerate(nxt, step + 1)
        row["bubble_time_s"] = time.perf_counter() - t0
        if step + 1 in probes:
            variants["bubble"].bubble.store(step + 1, pre)
            engine.spec = variants["bubble_uncoupled"]
            engine.pregenerate(nxt, step + 1, coupled=False)
    engine.spec = None
    row["_groups"] = stage.groups(uids, ref)
    return row


def first_divergence(index: int, got: list[int], want: list[int]) -> dict:
    """Where response ``index`` first differs from the reference, and the two tokens there."""
    pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    at = lambda toks: toks[pos] if pos < len(toks) else None  # noqa: E731 - None: the response ended
    return {"request": index, "position": pos, "reference_token": at(want), "token": at(got)}


def _pooled(rows: list[dict], name: str) -> dict:
    """Figures of variant ``name`` pooled over the ``rows`` that ran it (sums of forwards and tokens)."""
    rows = [r for r in rows if name in r]
    if not rows:
        return {}
    tokens = sum(r[name]["tokens"] for r in rows)
    forwards = sum(r[name]["target_forwards"] for r in rows)
    drafted_fwd = sum(r[name]["drafted_forwards"] for r in rows)
    return {"forward_reduction": 1.0 - forwards / max(tokens, 1),
            "mismatch_per_10k_tokens": 1e4 * sum(r[name]["mismatched"] for r in rows) / max(tokens, 1),
            "accept_len_mean": sum(r[name]["drafted_forward_tokens"] for r in rows) / max(drafted_fwd, 1),
            "time_s": sum(r[name]["time_s"] for r in rows)}


def _summary(rows: list[dict], cfg: RunConfig) -> dict:
    names = sorted({k for r in rows for k in r if isinstance(r[k], dict) and k != "ar"})
    bubble_rows = [r for r in rows if r["has_bubble"]]
    hist_rows = [r for r in rows if r["has_history"]]
    allf = _pooled(rows, "all")
    out = {
        "exact_match": all(r["exact_match"] for r in rows),
        "forward_reduction": allf["forward_reduction"],
        "speedup": sum(r["ar"]["time_s"] for r in rows) / allf["time_s"],
        # The tail: the engine's batched forwards (a step's critical path: as many as its slowest
        # request needs), and the longest request's target forwards (without speculation: one per
        # token). Each step's tail time (after all but TAIL_FRACTION of its requests finished) is in
        # its row: it is 0 without speculation when more than that fraction run to max_new_tokens.
        "batched_forward_reduction": 1.0 - (sum(r["all"]["engine_forwards"] for r in rows)
                                            / max(sum(r["ar"]["engine_forwards"] for r in rows), 1)),
        "longest_forward_reduction": 1.0 - (sum(r["all"]["longest_forwards"] for r in rows)
                                            / max(sum(r["ar"]["longest_forwards"] for r in rows), 1)),
        "speedup_first_bubble_step": (bubble_rows[0]["ar"]["time_s"] / bubble_rows[0]["all"]["time_s"]
                                      if bubble_rows else None),
        "accept_len_mean": allf["accept_len_mean"],
        "entropy_mean": float(np.mean([r["entropy_mean"] for r in rows])),
        "forward_reduction_first_bubble_step": (bubble_rows[0]["all"]["forward_reduction"] if bubble_rows else None),
        "forward_reduction_with_history": _pooled(hist_rows, "all").get("forward_reduction"),
        # Each source alone, on the probe steps where it can draft (bubble: drafts were made;
        # history: the prompts came back).
        "by_source": {n: _pooled(bubble_rows if n == "bubble" else hist_rows if n == "history" else rows, n)
                      for n in names if n not in ("all", "bubble_uncoupled")},
        # The same probe steps' bubble drafts, made with this step's noise vs with unrelated noise.
        "bubble_uncoupled": _pooled(bubble_rows, "bubble_uncoupled"),
        # Speculated responses that differ from the plain ones, per 10k generated tokens (0 is the
        # contract; in bf16 it measures how batch-shape-invariant the logits are: docs/design.md §1.1).
        "mismatch_per_10k_tokens": {n: _pooled(rows, n)["mismatch_per_10k_tokens"] for n in names},
        "bubble_coupled": _pooled(bubble_rows, "bubble"),
        "ar_time_s": sum(r["ar"]["time_s"] for r in rows),
        "spec_time_s": allf["time_s"],
        "bubble_time_s": sum(r.get("bubble_time_s", 0.0) for r in rows),
        "steps": rows,
        "config": {"spec": dataclasses.asdict(cfg.spec), "temperature": cfg.rollout.temperature,
                   "top_p": cfg.rollout.top_p, "prompts_per_step": cfg.rollout.prompts_per_step,
                   "group_size": cfg.rollout.group_size},
    }
    return out
