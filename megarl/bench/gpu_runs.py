"""Parts of the GPU runbook that drive existing entry points (``megarl/bench/gpu.py`` starts each
in its own process):

- ``pytest``: the ``gpu``-marked tests (every test file under tests/ that marks one), results per
  test from pytest's JUnit XML. Exits 1 when a test fails (its figures are still written).
- ``engine``: :func:`megarl.bench.engine.bench_engine` at Qwen2.5-1.5B shapes, random weights,
  bf16: decode tok/s at batch 1/16/64/256 per KV cache vs ``transformers`` ``generate`` on the
  same weights, the bandwidth bound (datasheet GB/s of the device), verify K=4 at batch 16
  against one decode step. CUDA graphs: recorded as not built while the engine has none.
- ``grpo`` / ``grpo_spec``: ``megarl train`` on one GPU (a process group of one, NCCL; trainer
  and engine colocated) at SmolLM2-135M's body shapes with random weights, rollouts in bf16,
  without and then with speculation and bubble drafts; per step and per phase (timeline.jsonl),
  rollout tok/s, weight sync GB/s; ``grpo_spec`` also compares its rollouts with ``grpo``'s (same
  work folder): rollout speedup and exactness (identical tokens and weight checksums per step).

Usage: ``python -m megarl.bench.gpu_runs {pytest,engine,grpo,grpo_spec} --json PATH --work-dir DIR
[--dry-run]``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _child_env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


# ------------------------------------------------------------------ pytest
def gpu_test_files(tests: Path = ROOT / "tests") -> list[str]:
    """Test files that mark a test ``gpu`` (a text search: collecting the whole suite would import
    every test module)."""
    if not tests.is_dir():
        raise FileNotFoundError(f"pytest part: no tests folder at {tests} (run from a full checkout)")
    mark = re.compile(r"(pytest\.)?mark\.gpu\b")
    return sorted(str(p.relative_to(ROOT)) for p in tests.rglob("test_*.py") if mark.search(p.read_text()))


def _junit(xml: Path) -> list[dict]:
    tests = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or el.text or "")[:600]
                break
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "message": message})
    return tests


def pytest_part(work: Path, json_path: Path, dry_run: bool) -> tuple[dict, bool]:
    """One pytest process per file, the figures written after each: a part cut at its time limit
    keeps the files already run."""
    files = gpu_test_files()
    base = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    try:  # a hanging test ends as a failure of that test (on the GPU image, which has the plugin)
        import pytest_timeout  # noqa: F401

        base += ["--timeout", "150"]
    except ImportError:
        pass
    out: dict = {"command": " ".join(base) + " FILE", "files": files, "runs": [], "tests": [], "seconds": 0.0}
    for i, f in enumerate(files):
        xml = work / f"pytest-gpu-{i}.xml"
        xml.unlink(missing_ok=True)
        t0 = time.perf_counter()
        proc = subprocess.run([*base, f"--junitxml={xml}", f], cwd=ROOT, env=_child_env(), capture_output=True,
                              text=True)
        dt = time.perf_counter() - t0
        out["seconds"] += dt
        out["runs"].append({"file": f, "rc": proc.returncode, "seconds": dt,
                            "output_tail": (proc.stdout + proc.stderr)[-1500:]})
        if xml.is_file():
            out["tests"] += _junit(xml)
        else:  # e.g. an import error before collection: the file counts as one error
            out["tests"].append({"test": f, "outcome": "error", "seconds": dt,
                                 "message": f"pytest wrote no report (exit status {proc.returncode}): "
                                            f"{(proc.stdout + proc.stderr)[-500:]}"})
        out["counts"] = {k: sum(t["outcome"] == k for t in out["tests"]) for k in ("passed", "failed", "error", "skipped")}
        json_path.write_text(json.dumps(out | {"dry_run": dry_run}, indent=2) + "\n")
    counts = out["counts"]
    return out, counts["failed"] == 0 and counts["error"] == 0 and (dry_run or counts["passed"] > 0)


# ------------------------------------------------------------------ engine
def engine_part(json_path: Path, dry_run: bool) -> dict:
    import dataclasses

    import torch

    from megarl.bench.engine import MODEL_SIZES, BenchShape, bench_engine
    from megarl.bench.gpu_parts import SHAPES, datasheet_gbps
    from megarl.engine import EngineConfig

    if dry_run:
        # bench engine's own "tiny" (vocab 8192, width 384) takes a minute on a shared CPU; the dry
        # run only walks the code path, so this process adds the runbook's smaller CPU model.
        MODEL_SIZES.setdefault("gpu-dry", {k: v for k, v in SHAPES["tiny"].items() if k != "model_type"}
                               | {"tie_word_embeddings": True})
        shape = BenchShape(model_size="gpu-dry", batch_sizes=[1, 64, 2], prompt_len=8, new_tokens=6, dtype="float32",
                           device="cpu", kv_caches=["slots", "paged"], hbm_gbps=3350.0, repeats=1)
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("engine part: no CUDA device visible (use --dry-run on a CPU)")
        gbps = datasheet_gbps(torch.cuda.get_device_name(0))
        shape = BenchShape(model_size="1.5b", batch_sizes=[1, 64, 16, 256], prompt_len=128, new_tokens=128,
                           dtype="bfloat16", device="cuda", kv_caches=["slots", "paged"], hbm_gbps=gbps or 3350.0,
                           repeats=2)
    # The batches of the targets (1 and 64) first, then the others: the figures are written after
    # each group, so a part cut at its time limit keeps the targets' rows.
    report: dict = {}
    for group in (shape.batch_sizes[:2], shape.batch_sizes[2:]):
        if not group:
            continue
        part = bench_engine(dataclasses.replace(shape, batch_sizes=group), str(json_path))
        if not report:
            report = part  # (its verify_k4_b16 and bound settings; the next group's rows are added)
        else:
            report["rows"] = sorted(report["rows"] + part["rows"], key=lambda r: r["batch"])
        report["shape"] = dataclasses.asdict(shape) | {"batch_sizes_done": [r["batch"] for r in report["rows"]]}
        json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    graph_fields = [f for f in fields if "graph" in f]
    # Issue 25 item 3 (a CUDA graph pool) adds the option; until then only the eager engine exists.
    report["cuda_graphs"] = ({"status": "not built", "why": f"EngineConfig has no CUDA graph option (fields: "
                                                            f"{', '.join(fields)})"} if not graph_fields else
                             {"status": "option exists but the runbook does not drive it yet", "fields": graph_fields})
    return report


# ------------------------------------------------------------------ GRPO runs
# SmolLM2-135M's body (HuggingFaceTB/SmolLM2-135M config.json). The vocabulary is the task's
# character tokenizer's: the addition task's rewards decode sampled ids with it, which a
# 49152-token head would overrun (so the embedding and LM head are ~28M parameters smaller).
SMOLLM2_BODY = ["model.model_type=llama", "model.hidden_size=576", "model.intermediate_size=1536",
                "model.num_hidden_layers=30", "model.num_attention_heads=9", "model.num_key_value_heads=3",
                "model.rope_theta=100000", "model.tie_word_embeddings=true"]
# 60 SFT steps (as configs/smoke.yaml) so that groups hold mixed rewards and GRPO really moves the
# policy (with all-zero rewards the weights never change and bubble drafts are exact copies: the
# speedup would be the ceiling; the report says which it was). sft.lr 1e-3 instead of smoke's 3e-3
# for a 30-layer model: a guess, not measured.
GRPO_GPU = [*SMOLLM2_BODY, "rollout.device=cuda", "rollout.dtype=bfloat16", "rl_steps=6", "checkpoint_every=0",
            "sft.steps=60", "sft.lr=0.001", "rollout.prompts_per_step=16", "rollout.group_size=8", "rollout.max_batch_size=128",
            "rollout.dump=true", "progress=false", "schedule.bubble_priority=normal"]
GRPO_DRY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
            "model.num_attention_heads=2", "model.num_key_value_heads=1", "rl_steps=2", "checkpoint_every=0",
            "sft.steps=1", "sft.batch_size=4", "task.num_prompts=8", "rollout.prompts_per_step=2",
            "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.max_batch_size=4", "rollout.dump=true",
            "progress=false", "trainer.micro_batch_size=4", "schedule.bubble_priority=normal"]
SPEC = ["spec.enabled=true", "spec.bubble_pregen=true"]
STEP_KEYS = ("grad_norm", "step_time_s", "rollout_time_s", "train_time_s", "weight_sync_s", "weight_sync_gbps", "weight_sync_bytes",
             "bubble_time_s", "rollout_tokens", "target_forwards", "forward_reduction", "reward_mean",
             "response_len_mean", "weight_checksum", "spec/accept_len_mean", "spec/bubble/coupled_accept_rate")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []


def grpo_overrides(spec: bool, dry_run: bool) -> list[str]:
    return [*(GRPO_DRY if dry_run else GRPO_GPU), *(SPEC if spec else [])]


def run_grpo(name: str, work: Path, spec: bool, dry_run: bool) -> dict:
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a new run (megarl train refuses a used directory)
    overrides = grpo_overrides(spec, dry_run)
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(ROOT / "configs" / "smoke.yaml"),
           "--run-dir", str(run_dir)] + [x for o in overrides for x in ("--set", o)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(), capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    fallback = None
    if proc.returncode != 0 and "deterministic implementation" in log:
        # An op without a deterministic CUDA kernel under deterministic: true (the configs'
        # default) is a finding to record, not a reason to lose the lease's GRPO figures: run
        # again without it (the spec run does the same, so the two stay comparable).
        fallback = next((ln for ln in log.splitlines() if "deterministic implementation" in ln), "")[:600]
        shutil.rmtree(run_dir, ignore_errors=True)
        overrides.append("deterministic=false")
        cmd += ["--set", "deterministic=false"]
        proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(), capture_output=True, text=True)
        log += "\n--- again with deterministic=false ---\n" + proc.stdout + proc.stderr
    wall = time.perf_counter() - t0
    (work / f"{name}.train.log").write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(f"megarl train exited {proc.returncode}: {log[-1500:]}")
    steps = _jsonl(run_dir / "metrics.jsonl")
    phases = []
    for line in _jsonl(run_dir / "timeline.jsonl"):
        acc: dict[str, float] = {}
        for rank in line["ranks"]:
            for ev in rank["events"]:
                acc[ev["phase"]] = acc.get(ev["phase"], 0.0) + ev["end"] - ev["start"]
        phases.append({"step": line["step"], **acc})
    # "parallel init: backend=nccl world=1 ..." and "process layout: colocated: ..." (the log's own words)
    layout = "; ".join(ln.split(" INFO ", 1)[-1] for ln in log.splitlines()
                       if "parallel init: " in ln or "process layout: " in ln) or None
    later = steps[1:] or steps  # step 1 pays first-use costs (allocations, kernel compiles)
    summary = {"rollout_tok_s": sum(s["rollout_tokens"] for s in later) / max(sum(s["rollout_time_s"] for s in later), 1e-9)}
    for key in ("step_time_s", "rollout_time_s", "train_time_s", "weight_sync_s", "weight_sync_gbps", "bubble_time_s"):
        vals = [s[key] for s in later if key in s]
        summary[f"{key}_median"] = statistics.median(vals) if vals else None
    sft = json.loads((run_dir / "sft.json").read_text()) if (run_dir / "sft.json").is_file() else {}
    return {"overrides": overrides, "command": " ".join(cmd), "wall_s": wall, "layout": layout, "sft": sft,
            "deterministic_fallback": fallback,
            "steps": [{k: s[k] for k in STEP_KEYS if k in s} | {"step": s["step"]} for s in steps],
            "phases_s": phases, "summary_after_step1": summary, "run_dir": str(run_dir)}


def _rollouts(run_dir: Path) -> dict[int, dict[tuple[int, int], list[int]]]:
    return {line["step"]: {(s["uid"], s["sample_idx"]): s["tokens"] for s in line["samples"]}
            for line in _jsonl(run_dir / "rollouts.jsonl")}


def compare_runs(plain: Path, spec: Path, plain_steps: list[dict], spec_steps: list[dict]) -> dict:
    """Exactness and rollout speedup of the spec run against the plain one, per step."""
    from megarl.bench.gpu_parts import divergence

    a, b = _rollouts(plain), _rollouts(spec)
    per_step, first_diff = [], None
    for sa, sb in zip(plain_steps, spec_steps):
        step = sa["step"]
        ra, rb = a.get(step, {}), b.get(step, {})
        keys = sorted(set(ra) & set(rb))
        div = divergence([ra[k] for k in keys], [rb[k] for k in keys])
        same = keys == sorted(ra) == sorted(rb) and div["diverged"] == 0
        same_w = sa.get("weight_checksum") == sb.get("weight_checksum")
        if (not same or not same_w) and first_diff is None:
            first_diff = step
        per_step.append({"step": step, "tokens_identical": same, "weights_identical": same_w, **div,
                         "rollout_speedup": sa["rollout_time_s"] / max(sb["rollout_time_s"], 1e-9)})
    later = [(sa, sb) for sa, sb in zip(plain_steps, spec_steps) if sa["step"] >= 2]  # bubble drafts from step 2
    speedup = (sum(x["rollout_time_s"] for x, _ in later) / max(sum(y["rollout_time_s"] for _, y in later), 1e-9)
               if later else None)
    return {"exact": first_diff is None and bool(per_step), "first_step_with_difference": first_diff,
            "rollout_speedup_steps2plus": speedup, "steps_compared": len(per_step), "per_step": per_step}


def grpo_part(spec: bool, work: Path, dry_run: bool) -> dict:
    name = "grpo_spec" if spec else "grpo"
    out = run_grpo(name, work, spec, dry_run)
    if spec:
        plain_dir = work / "grpo"
        plain_steps = _jsonl(plain_dir / "metrics.jsonl")
        if not plain_steps:
            out["comparison"] = {"error": f"no plain run in {plain_dir}: run the grpo part first, with the same "
                                          f"--work-dir"}
        else:
            out["comparison"] = compare_runs(plain_dir, work / name, plain_steps, _jsonl(work / name / "metrics.jsonl"))
    return out


# ------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megarl.bench.gpu_runs", description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["pytest", "engine", "grpo", "grpo_spec"])
    p.add_argument("--json", required=True, help="where to write the part's figures")
    p.add_argument("--work-dir", required=True, help="scratch folder (shared by the parts of one runbook run)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    a = p.parse_args(argv)
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ok = True
    if a.part == "pytest":
        figures, ok = pytest_part(work, Path(a.json), a.dry_run)
    elif a.part == "engine":
        figures = engine_part(Path(a.json), a.dry_run)
    else:
        figures = grpo_part(a.part == "grpo_spec", work, a.dry_run)
    figures["dry_run"] = a.dry_run
    Path(a.json).write_text(json.dumps(figures, indent=2, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
