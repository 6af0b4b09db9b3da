"""GRPO step time per rollout backend: the same run (default configs/smollm2.yaml) with
``rollout.backend=megarl`` and ``=vllm``, a few RL steps each, the two alternated run by run
(megarl, vllm, megarl, vllm, ... for ``--rounds`` rounds) so that a drift of a shared machine's
speed reaches both alike. ``--variant NAME=KEY=VALUE,...`` (repeated) compares other variants the
same way instead, e.g. the fp32 and the bf16 trainer:

    PYTHONPATH=. .venv/bin/python benchmarks/bench_grpo_backends.py --steps 4 --rounds 2 \\
        --variant fp32=trainer.dtype=float32,rollout.dtype=float32 \\
        --variant bf16=trainer.dtype=bfloat16,rollout.dtype=bfloat16

Each run is ``megarl train`` in a fresh process (``--set rl_steps=--steps``, no checkpoints; the
final export is not timed), started with the same environment for both backends: by default vLLM's
recommended CPU set-up (tcmalloc and Intel OpenMP preloaded where installed, OMP_NUM_THREADS,
VLLM_ENABLE_V1_MULTIPROCESSING=0: megarl/bench/engine_vllm.py), or this process's own
(``--env as-is``). Each step's line of metrics.jsonl gives its times: ``rollout_time_s`` (generation
and rewards), ``train_time_s`` (the update), ``weight_sync_s`` (trainer -> engine's staging copy),
``vllm_load_s`` (then vLLM reloading those weights), ``step_time_s`` (all of it). Printed per
step as it is read, then per variant the median over the steps after the first (the first pays
warm-up) of each round's and the fastest round's, and each variant's over the first variant's
(vLLM's over megarl's). The two backends sample different tokens at T > 0
(docs/rollout_backends.md), so their responses' lengths, and so their rollout work, differ: the
mean response length is printed beside the times.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_grpo_backends.py --steps 4 --rounds 2 \\
        --json runs/bench_grpo_backends.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BACKENDS = {"megarl": ["rollout.backend=megarl"], "vllm": ["rollout.backend=vllm"]}
"""The default variants: name -> the overrides that make it."""
FIELDS = ("rollout_time_s", "train_time_s", "weight_sync_s", "vllm_load_s", "step_time_s")


def _env(mode: str, threads: int) -> dict:
    """The environment of every run: vLLM's CPU set-up (``recommended``) or this process's."""
    env = dict(os.environ)
    if mode == "recommended":
        from megarl.bench.engine_vllm import RERUN_MARK, cpu_setup, rerun_env

        env.pop(RERUN_MARK, None)
        env = rerun_env(cpu_setup(threads)) or env
        env.pop(RERUN_MARK, None)
        env["OMP_NUM_THREADS"] = str(threads)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def run_once(config: str, steps: int, run_dir: Path, overrides: list[str], env: dict) -> list[dict]:
    """One ``megarl train`` run with ``overrides`` (a variant's, then every run's); its steps' metrics."""
    sets = [f"rl_steps={steps}", "checkpoint_every=0", *overrides]
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", config, "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_grpo_backends: `{' '.join(cmd)}` failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_row(backend: str, rnd: int, m: dict) -> dict:
    """The figures of one step's metrics line."""
    row = {"backend": backend, "round": rnd, "step": m["step"], **{k: m.get(k) for k in FIELDS}}
    row.update(reward_mean=m.get("reward_mean"), logprob_diff_max=m.get("logprob_diff_max"),
               response_len_mean=m.get("response_len_mean"))
    return row


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def format_step(r: dict) -> str:
    return (f"{r['backend']:>7} {r['round']:>5} {r['step']:>4} {_fmt(r['rollout_time_s']):>9} "
            f"{_fmt(r['train_time_s']):>8} {_fmt(r['weight_sync_s']):>7} {_fmt(r['vllm_load_s']):>10} "
            f"{_fmt(r['step_time_s']):>8} {_fmt(r['response_len_mean'], '.1f'):>8} {_fmt(r['reward_mean'], '.3f'):>7} "
            f"{_fmt(r['logprob_diff_max'], '.2e'):>10}")


HEAD = (f"{'backend':>7} {'round':>5} {'step':>4} {'rollout_s':>9} {'train_s':>8} {'sync_s':>7} {'vllm_load_s':>10} "
        f"{'step_s':>8} {'resp_len':>8} {'reward':>7} {'lp_diff_max':>10}")


def summary(rows: list[dict]) -> dict:
    """Per variant (``backend`` column) and field: the median over steps >= 2 of each round, the
    fastest round's; and each later variant's over the first's of those (``vllm_over_megarl``)."""
    out = {}
    for backend in dict.fromkeys(r["backend"] for r in rows):
        per_round = {}
        for r in rows:
            if r["backend"] == backend and r["step"] >= 2:
                per_round.setdefault(r["round"], []).append(r)
        if not per_round:
            continue
        out[backend] = {}
        for f in (*FIELDS, "response_len_mean"):
            medians = [statistics.median(x[f] for x in rs) for rs in per_round.values()
                       if all(x[f] is not None for x in rs)]
            if medians:
                out[backend][f] = min(medians)
    names = list(out)
    for other in names[1:]:
        out[f"{other}_over_{names[0]}"] = {f: out[other][f] / out[names[0]][f] for f in FIELDS
                                          if f in out[other] and out[names[0]].get(f)}
    return out


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """``NAME=KEY=VALUE,KEY=VALUE`` each -> {NAME: [KEY=VALUE, ...]}; none given: the two backends."""
    if not specs:
        return BACKENDS
    out = {}
    for spec in specs:
        name, _, sets = spec.partition("=")
        pairs = [x for x in sets.split(",") if x]
        if not name or name in out or not pairs or not all("=" in x for x in pairs):
            raise ValueError(f"--variant {spec!r} is invalid; valid: a new NAME, '=', then KEY=VALUE pairs "
                             f"joined by commas, e.g. bf16=trainer.dtype=bfloat16,rollout.dtype=bfloat16")
        out[name] = pairs
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/smollm2.yaml")
    p.add_argument("--steps", type=int, default=4, help="RL steps per run (the first is warm-up; default 4)")
    p.add_argument("--rounds", type=int, default=2, help="runs per variant, alternated (default 2)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="more overrides of every run, e.g. --set rollout.prompts_per_step=4")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the runs (with --env recommended)")
    p.add_argument("--env", default="recommended", choices=["recommended", "as-is"])
    p.add_argument("--work-dir", help="where the runs go (default: a new temporary folder; kept)")
    p.add_argument("--json", help="write the step rows and the summary here (rewritten after each run)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                   help="a variant to compare (repeat; alternated in this order); default: rollout.backend megarl "
                        "and vllm")
    a = p.parse_args(argv)
    try:
        variants = parse_variants(a.variant)
    except ValueError as e:
        p.error(str(e))
    if a.steps < 2 or a.rounds < 1 or a.threads < 1 or not Path(a.config).is_file():
        p.error(f"--steps={a.steps} (valid: >= 2; the first is warm-up), --rounds={a.rounds} (>= 1), "
                f"--threads={a.threads} (>= 1), --config={a.config} (an existing file)")
    from megarl.engine.vllm_backend import INSTALL_HINT, vllm_missing

    missing = vllm_missing() if any("rollout.backend=vllm" in v for v in variants.values()) else None
    if missing:
        p.error(f"vLLM cannot be imported ({missing}); {INSTALL_HINT.split(', or')[0]}")
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="megarl-grpo-backends-"))
    env = _env(a.env, a.threads)
    print(f"runs in {work}; LD_PRELOAD={env.get('LD_PRELOAD', '')!r} OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')}",
          flush=True)
    print(HEAD, flush=True)
    rows = []
    for rnd in range(a.rounds):
        for backend, sets in variants.items():
            for m in run_once(a.config, a.steps, work / f"r{rnd}-{backend}", sets + a.overrides, env):
                rows.append(step_row(backend, rnd, m))
                print(format_step(rows[-1]), flush=True)
            if a.json:
                from megarl.utils.fs import atomic_write_text

                report = {"config": a.config, "steps": a.steps, "rounds": a.rounds, "overrides": a.overrides, "variants": variants,
                          "ld_preload": env.get("LD_PRELOAD", ""), "rows": rows, "summary": summary(rows)}
                atomic_write_text(a.json, json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary(rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
