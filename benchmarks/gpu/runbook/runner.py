"""``python -m benchmarks.gpu.runbook`` (from the repository root): the GPU runbook.

One command, prepared and dry-run on CPU beforehand, that spends a short time on a machine with
one NVIDIA GPU on the measurements and checks the CPU cannot do. Each part runs in its own
process group with its own time limit, so a crash, a hang or a CUDA error ends only that part
(its error is recorded) and the others still run. Each part appends its figures to
``PART.jsonl`` under ``--out`` as it measures them (:mod:`benchmarks.gpu.runbook.rows`: a row per
engine batch, per KV cache step, per GRPO step, per test file), and the runner rewrites ``summary.json``
(each part's status, time, rows, peak GPU memory, error and log tail) and ``report.md``
(:mod:`benchmarks.gpu.runbook.report`) whenever a part's rows grow. A command killed at any moment
therefore leaves every row finished so far, and a report that names the part that was cut and
its last row. Six parts, the summary and the report: 8 files.

Parts (run order of both profiles, :mod:`benchmarks.gpu.runbook.profiles`; ``--parts`` picks some):
- ``env``: device, versions, a one-rank all-reduce, the copy and bf16 matmul ceilings (``parts``);
- ``pytest``: the ``gpu``-marked tests (:mod:`benchmarks.gpu.runbook.runs`);
- ``engine``: ``bench engine``'s measurements at Qwen2.5-1.5B shapes, bf16 (``runs``);
- ``grpo``, ``grpo_spec``: one GRPO run on one GPU at SmolLM2 shapes, without and with
  speculation + bubble drafts (``runs``);
- ``identity``: bf16 token identity with speculation on vs off per draft source (``identity``).
``fail``, ``hang`` and ``rows`` are the runbook's self-test (never run unless named).

``--profile quick`` fits one command of 420 s; ``--rerun-failed DIR`` runs again only what did
not finish in an earlier run's folder; ``--set PART.FIELD=VALUE`` sets any part's shapes.
``--dry-run``: tiny shapes on CPU through every part's code path (tests/test_bench_gpu.py).
docs/gpu/README.md says what travels, the command, and how to read and commit the report.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu.runbook.profiles import BUDGETS_S, DEADLINE_S, DRY_BUDGET_S, ORDER, build_shapes, shapes_json
from benchmarks.gpu.runbook.rows import read_rows, rows_peak_gib
from megarl.utils.fs import atomic_write_text


@dataclass(frozen=True)
class Part:
    """One runbook part: the process that runs it (its limits come from the profile)."""

    module: str
    """Module run as ``python -m MODULE ARG --rows PATH --shapes JSON [--dry-run]``."""
    arg: str
    """The part's name in that module's command line."""
    what: str
    """One line for the report."""


PARTS = {
    "env": Part("benchmarks.gpu.runbook.parts", "env",
                "device, versions, 1-rank all-reduce, copy and bf16 matmul ceilings"),
    "pytest": Part("benchmarks.gpu.runbook.runs", "pytest", "the gpu-marked tests"),
    "engine": Part("benchmarks.gpu.runbook.runs", "engine",
                   "decode tok/s vs transformers generate, fraction of the bandwidth bound, verify cost"),
    "grpo": Part("benchmarks.gpu.runbook.runs", "grpo", "GRPO on one GPU: step phases, rollout tok/s, sync GB/s"),
    "grpo_spec": Part("benchmarks.gpu.runbook.runs", "grpo_spec",
                      "the same run with speculation + bubble drafts: rollout speedup, exactness"),
    "identity": Part("benchmarks.gpu.runbook.identity", "identity",
                     "token identity, speculation on vs off, per draft source"),
    # self-test parts (tests/test_bench_gpu.py): a failing part, a hanging one, one writing rows forever
    "fail": Part("benchmarks.gpu.runbook.parts", "fail", "self-test: raises"),
    "hang": Part("benchmarks.gpu.runbook.parts", "hang", "self-test: sleeps past its limit"),
    "rows": Part("benchmarks.gpu.runbook.parts", "rows", "self-test: a row every 0.2 s until killed"),
}
DEFAULT_PARTS = ORDER
SELF_TEST_BUDGET_S = 60.0
MIN_PART_S = 15.0  # a part is skipped (recorded) rather than started with less time than this left
LOG_TAIL = 4000  # characters of each part's output kept in summary.json
POLL_S = 1.0  # how often a running part's new rows are put into summary.json and report.md


def budget_s(name: str, profile: str, dry_run: bool) -> float:
    if name not in BUDGETS_S[profile]:
        return SELF_TEST_BUDGET_S
    return DRY_BUDGET_S if dry_run else float(BUDGETS_S[profile][name])


def _error_line(text: str) -> str:
    """The exception line of a traceback (the last line that looks like ``Name: message``), else
    the last non-empty line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if ":" in ln and head.replace(".", "").replace("_", "").isalnum() and head[:1].isupper():
            return ln[:500]
    return lines[-1][:500] if lines else ""


def _kill_group(proc: subprocess.Popen) -> None:
    """The part and every process it started (torchrun, pytest's workers): its process group."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def part_env(dry_run: bool) -> dict:
    """The environment of a part's process."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Megatron's bias/activation fusions are torch.compile'd (megatron.core.jit.jit_fuser) and
    # turned on under CUDA: a cold compile in every trainer process, on a path no CPU test takes.
    # Off unless the caller sets it (TORCHDYNAMO_DISABLE=0 measures them); the env part records it.
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    if dry_run:  # tiny shapes gain nothing from threads, and on shared cores OpenMP's spinning threads
        env["OMP_NUM_THREADS"] = "1"  # made the identity part 20x slower (measured: 177 s vs 7.5 s)
    # the repository root: this checkout's megarl and benchmarks, also in the part's children
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return env


def _progress(rows_path: Path) -> dict:
    rows, result = read_rows(rows_path)
    out = {"rows": len(rows), "last_row": rows[-1]["row"] if rows else None, "finished": result is not None}
    peak = rows_peak_gib(rows, result)
    if peak is not None:
        out["peak_gib"] = peak
    return out


def run_part(name: str, out_dir: Path, work_dir: Path, dry_run: bool, timeout_s: float, shapes: dict | None = None,
             on_rows=None) -> dict:
    """Run one part in its own process group for at most ``timeout_s``; its record. While it runs,
    ``on_rows(record)`` is called each time its JSONL file grows (the report follows the rows)."""
    part = PARTS[name]
    rows_path = out_dir / f"{name}.jsonl"
    rows_path.unlink(missing_ok=True)  # a stale file must not pass for this run's figures
    log_path = work_dir / f"{name}.log"
    cmd = [sys.executable, "-m", part.module, part.arg, "--rows", str(rows_path), "--work-dir", str(work_dir),
           "--shapes", json.dumps(shapes or {})]
    if dry_run:
        cmd.append("--dry-run")
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        # Its own process group (killed as one at the limit), not a new POSIX session (setsid):
        # the machine ends a command's leftover processes unless they left its session, and a
        # part left running would share the GPU with the next command's parts.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=part_env(dry_run), process_group=0)
        size, rc, status = None, None, "timeout"  # (None: "running" is recorded at the first poll)
        try:
            while (left := timeout_s - (time.perf_counter() - t0)) > 0:
                try:
                    rc = proc.wait(timeout=min(POLL_S, left))
                    status = "ok" if rc == 0 else "failed"
                    break
                except subprocess.TimeoutExpired:
                    pass
                new_size = rows_path.stat().st_size if rows_path.exists() else -1
                if on_rows is not None and new_size != size:
                    size = new_size
                    on_rows({"part": name, "status": "running", "pid": proc.pid, "timeout_s": timeout_s,
                             "seconds": round(time.perf_counter() - t0, 2), **_progress(rows_path)})
            else:
                _kill_group(proc)
        except BaseException:  # the runbook itself stopped (SIGTERM, Ctrl-C): the part goes with it
            _kill_group(proc)
            raise
    seconds = time.perf_counter() - t0
    text = log_path.read_text(errors="replace")
    progress = _progress(rows_path)
    rec = {"part": name, "status": status, "rc": rc, "pid": proc.pid, "seconds": round(seconds, 2),
           "timeout_s": timeout_s, "jsonl": rows_path.name if rows_path.exists() else None, **progress,
           "log_tail": text[-LOG_TAIL:]}
    if status == "ok" and not progress["finished"]:
        rec["status"] = "failed"
        rec["error"] = f"exited 0 but wrote no result line to {rows_path.name}"
    elif status == "failed":
        how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
        rec["error"] = f"{how}: {_error_line(text)}"
    elif status == "timeout":
        rec["error"] = f"killed after its time limit of {timeout_s:.0f} s (ran {seconds:.0f} s)"
    return rec


def _write(out_dir: Path, summary: dict) -> None:
    from benchmarks.gpu.runbook.report import render

    atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    try:
        text = render(summary, out_dir)
    except Exception as e:  # noqa: BLE001 - a report bug must not stop the parts still to run
        import traceback

        text = (f"# megarl GPU runbook report\n\nthe report could not be rendered ({type(e).__name__}: {e}); "
                f"the figures are in the JSONL files beside it.\n\n```\n{traceback.format_exc()[-3000:]}```\n")
    atomic_write_text(out_dir / "report.md", text)


def parse_parts(text: str | None) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()] if text else list(DEFAULT_PARTS)
    bad = [n for n in names if n not in PARTS]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"--parts={text!r} is invalid; valid: distinct comma-separated names from {list(PARTS)}")
    return names


def parse_timeouts(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if name not in PARTS or seconds <= 0:
            raise ValueError(f"--timeout {item!r} is invalid; valid: PART=SECONDS with PART one of {list(PARTS)} "
                             f"and SECONDS > 0")
        out[name] = seconds
    return out


def failed_parts(prev_dir: str | Path, work_dir: str | Path | None) -> list[str]:
    """The parts of an earlier run (its ``summary.json``) that did not finish ok, in run order;
    ``grpo`` too when ``grpo_spec`` is among them and no finished ``grpo`` run is in the work
    folder (the spec run is compared with it)."""
    path = Path(prev_dir) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"--rerun-failed {prev_dir}: no summary.json there (a folder written by megarl bench "
                                f"gpu, e.g. the first command's files copied into the checkout)")
    summary = json.loads(path.read_text())
    done = summary.get("parts", {})
    requested = summary.get("parts_requested") or list(done)
    names = [n for n in requested if n in PARTS and done.get(n, {}).get("status") != "ok"]
    plain = Path(work_dir or "") / "grpo" / "metrics.jsonl"
    if "grpo_spec" in names and "grpo" not in names and not (work_dir and plain.is_file()):
        names.insert(names.index("grpo_spec"), "grpo")
    return names


def run_runbook(out_dir: str | Path, parts: list[str], dry_run: bool = False, timeouts: dict | None = None,
                deadline_s: float | None = None, work_dir: str | Path | None = None, echo=print,
                profile: str = "full", sets: list[str] | tuple[str, ...] = ()) -> dict:
    """Run ``parts`` in order, each in its own process; the summary and the report follow every
    part's rows as they are written."""
    shapes = build_shapes(profile, dry_run, list(sets))  # (bad --set: an error before anything is written)
    if deadline_s is None:  # a CPU dry run on shared cores is slower than its GPU profile
        deadline_s = DRY_BUDGET_S * len(parts) if dry_run else DEADLINE_S[profile]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="megarl-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    budgets = {n: (timeouts or {}).get(n, budget_s(n, profile, dry_run)) for n in parts}
    summary = {"runbook": "python -m benchmarks.gpu.runbook", "profile": profile, "dry_run": dry_run,
               "parts_requested": parts, "sets": list(sets), "budgets_s": budgets, "deadline_s": deadline_s,
               "work_dir": str(work),
               "torchdynamo_disable": part_env(dry_run).get("TORCHDYNAMO_DISABLE"),
               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "parts": {}}
    echo(f"GPU runbook --profile {profile}{' --dry-run' if dry_run else ''}: {len(parts)} parts, budgets (s): "
         + ", ".join(f"{n} {b:.0f}" for n, b in budgets.items())
         + f"; sum {sum(budgets.values()):.0f} s, deadline {deadline_s:.0f} s; out {out_dir}, work {work}")
    t0 = time.perf_counter()

    def running(rec: dict) -> None:
        summary["parts"][rec["part"]] = rec
        summary["elapsed_s"] = round(time.perf_counter() - t0, 2)
        _write(out_dir, summary)

    for name in parts:
        left = deadline_s - (time.perf_counter() - t0)
        if left < MIN_PART_S:
            rec = {"part": name, "status": "skipped", "seconds": 0.0,
                   "error": f"skipped: {max(left, 0):.0f} s left before the deadline of {deadline_s:.0f} s"}
        else:
            rec = run_part(name, out_dir, work, dry_run, min(budgets[name], left), shapes_json(shapes, name), running)
        running(rec)
        echo(f"  {name:<10} {rec['status']:<8} {rec['seconds']:>7.1f} s  rows {rec.get('rows', 0)}"
             + (f"  {rec['error']}" if rec.get("error") else ""))
    summary["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    _write(out_dir, summary)
    ok = sum(r["status"] == "ok" for r in summary["parts"].values())
    echo(f"{ok}/{len(parts)} parts ok in {summary['elapsed_s']:.0f} s; report: {out_dir / 'report.md'}")
    return summary


def merge(out_dir: str | Path, sources: list[str | Path]) -> dict:
    """One report from several commands' folders (a first run and a rerun of what failed): their
    part files copied into ``out_dir``, later folders winning per part unless their part did not
    finish ok where an earlier one did; each command's env kept in ``commands``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    merged: dict = {"runbook": "python -m benchmarks.gpu.runbook, merged", "parts": {}, "commands": []}
    for src in map(Path, sources):
        path = src / "summary.json"
        if not path.is_file():
            raise FileNotFoundError(f"--merge {src}: no summary.json there (a folder written by the GPU runbook)")
        summary = json.loads(path.read_text())
        _, env = read_rows(src / "env.jsonl")
        merged["commands"].append({"dir": str(src), "parts": list(summary.get("parts", {})),
                                "device": (env or {}).get("device", {}).get("name"),
                                "date_utc": (env or {}).get("date_utc")})
        merged["dry_run"] = merged.get("dry_run", False) or summary.get("dry_run", False)
        for key in ("profile", "parts_requested"):
            merged.setdefault(key, summary.get(key))
        for name, rec in summary.get("parts", {}).items():
            if rec.get("status") != "ok" and merged["parts"].get(name, {}).get("status") == "ok":
                continue  # a part that failed again keeps the earlier command's figures
            merged["parts"][name] = rec
            if rec.get("jsonl") and (src / rec["jsonl"]).is_file() and src.resolve() != out_dir.resolve():
                shutil.copyfile(src / rec["jsonl"], out_dir / rec["jsonl"])
    _write(out_dir, merged)
    return merged


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="python -m benchmarks.gpu.runbook", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for PART.jsonl, summary.json and report.md")
    p.add_argument("--profile", default="full", choices=list(BUDGETS_S),
                   help="quick: every part at smaller shapes, one command of <= 420 s; full: the targets' shapes")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: every part's code path")
    p.add_argument("--parts", help=f"comma-separated, run in the order given (default: {','.join(DEFAULT_PARTS)}; "
                                   f"self-test: fail, hang, rows)")
    p.add_argument("--rerun-failed", metavar="DIR",
                   help="run only the parts that did not finish ok in DIR/summary.json (an earlier run's out folder)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="PART.FIELD=VALUE",
                   help="a part's shape (repeatable; e.g. engine.batch_sizes=[1,64], grpo.rl_steps=4); "
                        "docs/gpu/README.md lists the fields")
    p.add_argument("--timeout", action="append", default=[], metavar="PART=SECONDS",
                   help="override a part's time limit (repeatable)")
    p.add_argument("--deadline", type=float,
                   help=f"seconds for all parts together: a part gets at most what is left, and is skipped "
                        f"with less than {MIN_PART_S:.0f} s left (default per profile: {DEADLINE_S})")
    p.add_argument("--work-dir", help="scratch folder (part logs, training runs; default: a new temporary folder)")
    p.add_argument("--merge", nargs="+", metavar="DIR",
                   help="write one report in --out from these folders of earlier commands (runs nothing)")
    return p


def main_args(a: argparse.Namespace) -> int:
    try:
        if a.merge:
            merge(a.out, a.merge)
            print(Path(a.out, "report.md").read_text())
            return 0
        if a.rerun_failed and a.parts:
            raise ValueError("--rerun-failed and --parts both pick the parts; give one of them")
        parts = failed_parts(a.rerun_failed, a.work_dir) if a.rerun_failed else parse_parts(a.parts)
        timeouts = parse_timeouts(a.timeout)
        if a.deadline is not None and a.deadline <= 0:
            raise ValueError(f"--deadline={a.deadline} is invalid; valid range: > 0 seconds")
        build_shapes(a.profile, a.dry_run, a.sets)
    except (ValueError, FileNotFoundError) as e:  # (ConfigError is a ValueError)
        print(f"megarl: error: {e}", file=sys.stderr)
        return 2
    if not parts:
        print(f"GPU runbook: every part in {a.rerun_failed}/summary.json finished ok; nothing to rerun")
        return 0
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # ends the running part too (run_part)
    try:
        summary = run_runbook(a.out, parts, a.dry_run, timeouts, a.deadline, a.work_dir, profile=a.profile,
                              sets=a.sets)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(Path(a.out, "report.md").read_text())
    return 0 if all(r["status"] == "ok" for r in summary["parts"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    return main_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
