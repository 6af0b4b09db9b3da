"""Parts of the GPU runbook that drive existing entry points (``runner.py`` starts each
in its own process); each appends its rows to its JSONL file as it goes (:mod:`benchmarks.gpu.runbook.rows`):

- ``pytest``: the ``gpu``-marked tests (every test file under tests/ that marks one), one pytest
  process per file, a row per file with each test's outcome from pytest's JUnit XML. Exits 1
  when a test fails (its rows are still written).
- ``engine``: ``megarl bench engine``'s measurements (:mod:`megarl.bench.engine`) at Qwen2.5-1.5B
  shapes, random weights, bf16: per batch a row for ``transformers`` ``generate`` and one per KV
  cache (decode tok/s plain and with speculation, fraction of the bandwidth bound at the
  device's datasheet GB/s), then verify K=4 at batch 16 against one decode step per KV cache.
- ``grpo`` / ``grpo_spec``: ``megarl train`` on one GPU (a process group of one, NCCL; trainer
  and engine colocated) at SmolLM2-135M's body shapes with random weights, rollouts in bf16,
  without and then with speculation and bubble drafts; a row per RL step as the run writes it
  (its metrics and phases), then rollout tok/s and weight sync GB/s; ``grpo_spec`` also compares
  its rollouts with ``grpo``'s (same work folder): rollout speedup and exactness (identical tokens
  and weight checksums per step). ``megarl train`` runs under :mod:`benchmarks.gpu.runbook.child` (peak
  GPU memory; ops without a deterministic kernel warn and are recorded instead of failing).

Shapes: the runbook's sections of :mod:`benchmarks.gpu.runbook.profiles` (``--shapes`` JSON).
Usage: ``python -m benchmarks.gpu.runbook.runs {pytest,engine,grpo,grpo_spec} --rows PATH --work-dir DIR
[--shapes JSON] [--dry-run]``.
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

from benchmarks.gpu.runbook.profiles import EngineShapes, GrpoShapes, PytestShapes
from benchmarks.gpu.runbook.rows import Rows
from megarl.utils.dataclass_config import from_dict

ROOT = Path(__file__).resolve().parents[3]


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


def pytest_part(work: Path, rows: Rows, shapes: PytestShapes, dry_run: bool) -> tuple[dict, bool]:
    """One pytest process per file, a row after each: a part cut at its time limit keeps the
    files already run."""
    files = list(shapes.files) or gpu_test_files()
    base = ["-m", "gpu", "-p", "no:cacheprovider", "-q"]
    try:  # a hanging test ends as a failure of that test, where the plugin is installed
        import pytest_timeout  # noqa: F401

        base += ["--timeout", str(shapes.test_timeout_s)]
    except ImportError:
        pass
    out: dict = {"command": "python -m pytest " + " ".join(base) + " FILE", "files": files, "runs": [], "tests": [],
                 "seconds": 0.0}
    for i, f in enumerate(files):
        xml, info = work / f"pytest-gpu-{i}.xml", work / f"pytest-gpu-{i}.child.json"
        xml.unlink(missing_ok=True)
        info.unlink(missing_ok=True)
        t0 = time.perf_counter()
        # under child.py --strict: the file's peak GPU memory, tests otherwise untouched
        proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.runbook.child", "--strict", str(info), "pytest",
                               *base, f"--junitxml={xml}", f], cwd=ROOT, env=_child_env(), capture_output=True,
                              text=True)
        dt = time.perf_counter() - t0
        out["seconds"] += dt
        peak = json.loads(info.read_text()).get("peak_gib") if info.is_file() else None
        run = {"file": f, "rc": proc.returncode, "seconds": dt, "peak_gib": peak,
               "output_tail": (proc.stdout + proc.stderr)[-1500:]}
        out["runs"].append(run)
        if xml.is_file():
            tests = _junit(xml)
        else:  # e.g. an import error before collection: the file counts as one error
            tests = [{"test": f, "outcome": "error", "seconds": dt,
                      "message": f"pytest wrote no report (exit status {proc.returncode}): "
                                 f"{(proc.stdout + proc.stderr)[-500:]}"}]
        out["tests"] += tests
        out["counts"] = {k: sum(t["outcome"] == k for t in out["tests"]) for k in ("passed", "failed", "error", "skipped")}
        rows.add(f"file {f}", **run, tests=tests)
    counts = out.get("counts", {"passed": 0, "failed": 0, "error": 0, "skipped": 0})
    out["counts"] = counts
    return out, counts["failed"] == 0 and counts["error"] == 0 and (dry_run or counts["passed"] > 0)


# ------------------------------------------------------------------ engine
def _engine_models(shape, device: str):
    """The ``transformers`` model (random weights, built on the device) and the engine's model of
    the same shapes; the engines load the former's weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.bench.engine import MODEL_SIZES
    from megarl.engine import EngineConfig
    from megarl.models.config import ModelArgs
    from megarl.models.llama import CausalLM

    if shape.model_size not in MODEL_SIZES:
        raise ValueError(f"engine.model_size={shape.model_size!r} is invalid; valid choices: {list(MODEL_SIZES)}")
    args = ModelArgs(**MODEL_SIZES[shape.model_size], model_type="qwen2")
    torch_dtype = EngineConfig(dtype=shape.dtype).torch_dtype
    hf_cfg = args.to_hf_config()
    hf_cfg.pop("architectures"), hf_cfg.pop("torch_dtype")
    torch.manual_seed(0)
    with torch.device(device):  # a 1.5B model initialised on the GPU: seconds, not a minute of CPU
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_cfg), dtype=torch_dtype,
                                              attn_implementation="sdpa").to(device).eval()
        model = CausalLM(args)
    return hf, model, {k: v.detach() for k, v in hf.state_dict().items()}, torch_dtype


def engine_part(rows: Rows, shapes: EngineShapes, dry_run: bool) -> dict:
    """``bench engine``'s measurements, a row per generate / KV cache / verify measurement."""
    import dataclasses

    import torch

    from megarl.bench.engine import MODEL_SIZES, BenchShape, _bench_engine, _bench_hf, _bound, _verify_cost
    from benchmarks.gpu.runbook.parts import SHAPES, datasheet_gbps

    if dry_run:
        # bench engine's own "tiny" (vocab 8192, width 384) takes a minute on a shared CPU; the dry
        # run only walks the code path, so this process adds the runbook's smaller CPU model.
        MODEL_SIZES.setdefault("gpu-dry", {k: v for k, v in SHAPES["tiny"].items() if k != "model_type"}
                               | {"tie_word_embeddings": True})
        device, dtype, gbps = "cpu", "float32", 3350.0
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("engine part: no CUDA device visible (use --dry-run on a CPU)")
        device, dtype = "cuda", "bfloat16"
        gbps = datasheet_gbps(torch.cuda.get_device_name(0)) or 3350.0
    shape = BenchShape(model_size=shapes.model_size, batch_sizes=list(shapes.batch_sizes), prompt_len=shapes.prompt_len,
                       new_tokens=shapes.new_tokens, dtype=dtype, device=device, kv_caches=list(shapes.kv_caches),
                       hbm_gbps=gbps, repeats=shapes.repeats)
    hf, model, sd, torch_dtype = _engine_models(shape, device)
    elsize = torch.finfo(torch_dtype).bits // 8
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "shape": dataclasses.asdict(shape), "model": MODEL_SIZES[shape.model_size],
                    "weights_bytes": sum(p.numel() for p in model.parameters()) * elsize, "rows": [],
                    "verify_k4_b16": {}}
    rows.add("models built", weights_bytes=report["weights_bytes"])
    for batch in shape.batch_sizes:  # the targets' batches (1, 64) first: a cut part keeps them
        row = {"batch": batch, "hf_tok_s": _bench_hf(hf, model.args, shape, batch),
               **_bound(model, shape, batch, elsize)}
        rows.add(f"batch {batch} generate", **row)
        for kv in shape.kv_caches:
            row[kv] = _bench_engine(model, sd, shape, kv, batch)
            row[kv]["speedup_vs_hf"] = row[kv]["engine_tok_s"] / row["hf_tok_s"]
            row[kv]["frac_of_bound"] = row[kv]["engine_tok_s"] / row["bound_tok_s"]
            rows.add(f"batch {batch} {kv}", batch=batch, kv=kv, **row[kv])
        report["rows"].append(row)
    if shapes.verify:
        for kv in shape.kv_caches:
            report["verify_k4_b16"][kv] = _verify_cost(model, sd, shape, kv)
            rows.add(f"verify k4 b16 {kv}", kv=kv, **report["verify_k4_b16"][kv])
    from megarl.engine import EngineConfig

    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    graph_fields = [f for f in fields if "graph" in f]
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
# SFT steps first (GrpoShapes.sft_steps, as configs/smoke.yaml) so that groups hold mixed rewards
# and GRPO really moves the policy (with all-zero rewards the weights never change and bubble
# drafts are exact copies: the speedup would be the ceiling; the report says which it was).
# sft.lr 1e-3 instead of smoke's 3e-3 for a 30-layer model: a guess, not measured.
GRPO_GPU = [*SMOLLM2_BODY, "rollout.device=cuda", "rollout.dtype=bfloat16", "checkpoint_every=0", "sft.lr=0.001",
            "rollout.max_batch_size=128", "rollout.dump=true", "progress=false", "schedule.bubble_priority=normal"]
GRPO_DRY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
            "model.num_attention_heads=2", "model.num_key_value_heads=1", "checkpoint_every=0", "sft.batch_size=4",
            "task.num_prompts=8", "rollout.max_batch_size=4", "rollout.dump=true", "progress=false",
            "trainer.micro_batch_size=4", "schedule.bubble_priority=normal"]
SPEC = ["spec.enabled=true", "spec.bubble_pregen=true"]
STEP_KEYS = ("grad_norm", "step_time_s", "rollout_time_s", "train_time_s", "weight_sync_s", "weight_sync_gbps", "weight_sync_bytes",
             "bubble_time_s", "rollout_tokens", "target_forwards", "forward_reduction", "reward_mean",
             "response_len_mean", "weight_checksum", "spec/accept_len_mean", "spec/bubble/coupled_accept_rate",
             "logprob_diff_max")


def _jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSONL file a running process may be appending to."""
    if not path.is_file():
        return []
    out = []
    for ln in path.read_text().splitlines():
        try:
            out.append(json.loads(ln))
        except ValueError:  # the line being written
            break
    return out


def grpo_overrides(spec: bool, dry_run: bool, shapes: GrpoShapes) -> list[str]:
    return [*(GRPO_DRY if dry_run else GRPO_GPU), *shapes.overrides(), *(SPEC if spec else [])]


def _phases(run_dir: Path) -> dict[int, dict[str, float]]:
    """Seconds per phase per step, summed over ranks' events (timeline.jsonl)."""
    phases = {}
    for line in _jsonl(run_dir / "timeline.jsonl"):
        acc: dict[str, float] = {}
        for rank in line["ranks"]:
            for ev in rank["events"]:
                acc[ev["phase"]] = acc.get(ev["phase"], 0.0) + ev["end"] - ev["start"]
        phases[line["step"]] = acc
    return phases


def _train(cmd: list[str], run_dir: Path, log_path: Path, rows: Rows) -> int:
    """``megarl train`` as a child process; a row per RL step as soon as metrics.jsonl has it."""
    done = 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=log, stderr=subprocess.STDOUT)
        while True:
            rc = proc.poll()
            steps = _jsonl(run_dir / "metrics.jsonl")
            phases = _phases(run_dir) if len(steps) > done else {}
            for st in steps[done:]:
                rows.add(f"step {st['step']}", step=st["step"], **{k: st[k] for k in STEP_KEYS if k in st},
                         phases_s=phases.get(st["step"]))
            done = len(steps)
            if rc is not None:
                return rc
            time.sleep(0.5)


def run_grpo(name: str, work: Path, spec: bool, dry_run: bool, shapes: GrpoShapes, rows: Rows) -> dict:
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a new run (megarl train refuses a used directory)
    overrides = grpo_overrides(spec, dry_run, shapes)
    info = work / f"{name}.child.json"
    info.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.gpu.runbook.child", str(info), "megarl.cli", "train", "--config",
           str(ROOT / "configs" / "smoke.yaml"), "--run-dir", str(run_dir),
           *[x for o in overrides for x in ("--set", o)]]
    t0 = time.perf_counter()
    log_path = work / f"{name}.train.log"
    rc = _train(cmd, run_dir, log_path, rows)
    wall = time.perf_counter() - t0
    log = log_path.read_text(errors="replace")
    if rc != 0:
        raise RuntimeError(f"megarl train exited {rc}: {log[-1500:]}")
    child = json.loads(info.read_text()) if info.is_file() else {}
    steps = _jsonl(run_dir / "metrics.jsonl")
    phases = [{"step": k, **v} for k, v in sorted(_phases(run_dir).items())]
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
            "nondeterministic_ops": child.get("nondeterministic_ops", []), "peak_gib": child.get("peak_gib"),
            "steps": [{k: s[k] for k in STEP_KEYS if k in s} | {"step": s["step"]} for s in steps],
            "phases_s": phases, "summary_after_step1": summary, "run_dir": str(run_dir)}


def _rollouts(run_dir: Path) -> dict[int, dict[tuple[int, int], list[int]]]:
    return {line["step"]: {(s["uid"], s["sample_idx"]): s["tokens"] for s in line["samples"]}
            for line in _jsonl(run_dir / "rollouts.jsonl")}


def compare_runs(plain: Path, spec: Path, plain_steps: list[dict], spec_steps: list[dict]) -> dict:
    """Exactness and rollout speedup of the spec run against the plain one, per step."""
    from benchmarks.gpu.runbook.identity import divergence

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


def grpo_part(spec: bool, work: Path, dry_run: bool, shapes: GrpoShapes, rows: Rows) -> dict:
    name = "grpo_spec" if spec else "grpo"
    out = run_grpo(name, work, spec, dry_run, shapes, rows)
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
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.runbook.runs", description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["pytest", "engine", "grpo", "grpo_spec"])
    p.add_argument("--rows", required=True, help="the part's JSONL file (rows as they finish, then the result)")
    p.add_argument("--shapes", default="{}", help="the part's section of the runbook's shapes, as JSON")
    p.add_argument("--work-dir", required=True, help="scratch folder (shared by the parts of one runbook run)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    a = p.parse_args(argv)
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    rows, shapes = Rows(a.rows), json.loads(a.shapes)
    ok = True
    if a.part == "pytest":
        figures, ok = pytest_part(work, rows, from_dict(PytestShapes, shapes), a.dry_run)
    elif a.part == "engine":
        figures = engine_part(rows, from_dict(EngineShapes, shapes), a.dry_run)
    else:
        figures = grpo_part(a.part == "grpo_spec", work, a.dry_run, from_dict(GrpoShapes, shapes), rows)
    rows.result({**figures, "dry_run": a.dry_run})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
