"""``megarl bench gpu`` (also ``python -m megarl.bench.gpu``): the GPU runbook of issue 25.

One command, prepared and dry-run on CPU beforehand, that spends a lent GPU's lease on the
measurements and checks the CPU cannot do. Each part runs in its own process with its own time
limit, so a crash, a hang or a CUDA error ends only that part (its error is recorded) and the
others still run. After every part the figures are written under ``--out``: one JSON per part
(``PART.json``, written by the part itself), ``summary.json`` (each part's status, time, error and
log tail, the budgets) and ``report.md`` (every figure next to the issue's target;
:mod:`megarl.bench.gpu_report`). A command killed from outside therefore still leaves everything
finished so far. That is at most 8 files, what the device tool brings back from ``$OUT``.

Parts (in run order; ``--parts`` picks some):
- ``env``: device, versions, the copy and bf16 matmul ceilings (:mod:`megarl.bench.gpu_parts`);
- ``pytest``: the ``gpu``-marked tests (:mod:`megarl.bench.gpu_runs`);
- ``engine``: ``bench engine`` at Qwen2.5-1.5B shapes, bf16 (:mod:`megarl.bench.gpu_runs`);
- ``identity``: bf16 token identity with speculation on vs off per draft source (gpu_parts);
- ``grpo``, ``grpo_spec``: one GRPO run on one GPU at SmolLM2 shapes, without and with
  speculation + bubble drafts (:mod:`megarl.bench.gpu_runs`).
``fail`` and ``hang`` are the runbook's self-test (never run unless named).

``--dry-run``: tiny shapes on CPU through every part's code path (tests/test_bench_gpu.py).
docs/gpu/README.md says how to run it with the device tool and how to read the report.
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

from megarl.utils.fs import atomic_write_text


@dataclass(frozen=True)
class Part:
    """One runbook part: the process that runs it and its time limits."""

    module: str
    """Module run as ``python -m MODULE ARG --json PATH [--dry-run]``."""
    arg: str
    """The part's name in that module's command line."""
    budget_s: float
    """Time limit on a GPU (the part's process is killed past it). The default parts' budgets sum
    to well under the issue's 25 minutes (printed at the start)."""
    dry_budget_s: float
    """Time limit of the CPU dry run (tiny shapes)."""
    what: str
    """One line for the report."""


PARTS = {
    "env": Part("megarl.bench.gpu_parts", "env", 60, 180, "device, versions, copy and bf16 matmul ceilings"),
    "pytest": Part("megarl.bench.gpu_runs", "pytest", 180, 180, "the gpu-marked tests"),
    "engine": Part("megarl.bench.gpu_runs", "engine", 330, 180,
                   "decode tok/s vs transformers generate, fraction of the bandwidth bound, verify cost"),
    "identity": Part("megarl.bench.gpu_parts", "identity", 180, 180,
                     "token identity, speculation on vs off, per draft source"),
    "grpo": Part("megarl.bench.gpu_runs", "grpo", 150, 180, "GRPO on one GPU: step phases, rollout tok/s, sync GB/s"),
    "grpo_spec": Part("megarl.bench.gpu_runs", "grpo_spec", 210, 180,
                      "the same run with speculation + bubble drafts: rollout speedup, exactness"),
    # self-test parts (tests/test_bench_gpu.py): a failing part and a hanging one
    "fail": Part("megarl.bench.gpu_parts", "fail", 60, 60, "self-test: raises"),
    "hang": Part("megarl.bench.gpu_parts", "hang", 60, 60, "self-test: sleeps past its limit"),
}
DEFAULT_PARTS = ("env", "pytest", "engine", "identity", "grpo", "grpo_spec")
DEFAULT_DEADLINE_S = 23 * 60  # the 25 minutes, less the interpreter start and the report
MIN_PART_S = 15.0  # a part is skipped (recorded) rather than started with less time than this left
LOG_TAIL = 4000  # characters of each part's output kept in summary.json


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


def run_part(name: str, out_dir: Path, work_dir: Path, dry_run: bool, timeout_s: float) -> dict:
    """Run one part in its own process (own session) for at most ``timeout_s``; its record."""
    part = PARTS[name]
    json_path = out_dir / f"{name}.json"
    json_path.unlink(missing_ok=True)  # a stale file must not pass for this run's figures
    log_path = work_dir / f"{name}.log"
    cmd = [sys.executable, "-m", part.module, part.arg, "--json", str(json_path), "--work-dir", str(work_dir)]
    if dry_run:
        cmd.append("--dry-run")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if dry_run:  # tiny shapes gain nothing from threads, and on shared cores OpenMP's spinning threads
        env["OMP_NUM_THREADS"] = "1"  # made the identity part 20x slower (measured: 177 s vs 7.5 s)
    root = str(Path(__file__).resolve().parents[2])  # this checkout's megarl, also in the part's children
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        # Its own process group (killed as one at the limit), not its own session: the device
        # tool ends a command's leftover processes except those in a new session, and a part
        # left running would share the GPU with the next call's parts.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0)
        try:
            rc = proc.wait(timeout=timeout_s)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, status = None, "timeout"
        except BaseException:  # the runbook itself stopped (SIGTERM, Ctrl-C): the part goes with it
            _kill_group(proc)
            raise
    seconds = time.perf_counter() - t0
    text = log_path.read_text(errors="replace")
    rec = {"part": name, "status": status, "rc": rc, "pid": proc.pid, "seconds": round(seconds, 2), "timeout_s": timeout_s,
           "json": json_path.name if json_path.exists() else None, "log_tail": text[-LOG_TAIL:]}
    if status == "ok" and not json_path.exists():
        rec["status"] = "failed"
        rec["error"] = f"exited 0 but wrote no {json_path.name}"
    elif status == "failed":
        rec["error"] = f"exit status {rc}: {_error_line(text)}"
    elif status == "timeout":
        rec["error"] = f"killed after its time limit of {timeout_s:.0f} s (ran {seconds:.0f} s)"
    return rec


def _write(out_dir: Path, summary: dict) -> None:
    from megarl.bench.gpu_report import render

    atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    try:
        text = render(summary, out_dir)
    except Exception as e:  # noqa: BLE001 - a report bug must not stop the parts still to run
        import traceback

        text = (f"# megarl GPU runbook report\n\nthe report could not be rendered ({type(e).__name__}: {e}); "
                f"the figures are in the JSON files beside it.\n\n```\n{traceback.format_exc()[-3000:]}```\n")
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


def run_runbook(out_dir: str | Path, parts: list[str], dry_run: bool = False, timeouts: dict | None = None,
                deadline_s: float = DEFAULT_DEADLINE_S, work_dir: str | Path | None = None,
                echo=print) -> dict:
    """Run ``parts`` in order, each in its own process; write the JSON and the report after each."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="megarl-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    budgets = {n: (timeouts or {}).get(n, PARTS[n].dry_budget_s if dry_run else PARTS[n].budget_s) for n in parts}
    summary = {"runbook": "megarl bench gpu (issue 25)", "dry_run": dry_run, "parts_requested": parts,
               "budgets_s": budgets, "deadline_s": deadline_s, "work_dir": str(work),
               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "parts": {}}
    echo(f"megarl bench gpu{' --dry-run' if dry_run else ''}: {len(parts)} parts, budgets (s): "
         + ", ".join(f"{n} {b:.0f}" for n, b in budgets.items())
         + f"; sum {sum(budgets.values()):.0f} s, deadline {deadline_s:.0f} s; out {out_dir}, work {work}")
    t0 = time.perf_counter()
    for name in parts:
        left = deadline_s - (time.perf_counter() - t0)
        if left < MIN_PART_S:
            rec = {"part": name, "status": "skipped", "seconds": 0.0,
                   "error": f"skipped: {max(left, 0):.0f} s left before the deadline of {deadline_s:.0f} s"}
        else:
            rec = run_part(name, out_dir, work, dry_run, min(budgets[name], left))
        summary["parts"][name] = rec
        summary["elapsed_s"] = round(time.perf_counter() - t0, 2)
        _write(out_dir, summary)
        echo(f"  {name:<10} {rec['status']:<8} {rec['seconds']:>7.1f} s"
             + (f"  {rec['error']}" if rec.get("error") else ""))
    summary["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    _write(out_dir, summary)
    ok = sum(r["status"] == "ok" for r in summary["parts"].values())
    echo(f"{ok}/{len(parts)} parts ok in {summary['elapsed_s']:.0f} s; report: {out_dir / 'report.md'}")
    return summary


def merge(out_dir: str | Path, sources: list[str | Path]) -> dict:
    """One report from several calls' folders (the device tool runs at most 10 minutes a command,
    so the runbook is run in groups of parts): their part JSONs copied into ``out_dir``, later
    folders winning per part, each call's env kept in ``calls``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    merged: dict = {"runbook": "megarl bench gpu (issue 25), merged", "parts": {}, "calls": []}
    for src in map(Path, sources):
        path = src / "summary.json"
        if not path.is_file():
            raise FileNotFoundError(f"--merge {src}: no summary.json there (a folder written by megarl bench gpu)")
        summary = json.loads(path.read_text())
        env = json.loads((src / "env.json").read_text()) if (src / "env.json").is_file() else {}
        merged["calls"].append({"dir": str(src), "parts": list(summary.get("parts", {})),
                                "device": env.get("device", {}).get("name"), "date_utc": env.get("date_utc")})
        merged["dry_run"] = merged.get("dry_run", False) or summary.get("dry_run", False)
        for name, rec in summary.get("parts", {}).items():
            if name == "env" and "env" in merged["parts"] and rec.get("status") != "ok":
                continue  # a failed env of a later call keeps the earlier one's figures
            merged["parts"][name] = rec
            if rec.get("json") and (src / rec["json"]).is_file() and src.resolve() != out_dir.resolve():
                shutil.copyfile(src / rec["json"], out_dir / rec["json"])
    _write(out_dir, merged)
    return merged


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="python -m megarl.bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for PART.json, summary.json and report.md")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: every part's code path, ~1 minute")
    p.add_argument("--parts", help=f"comma-separated, in this order (default: {','.join(DEFAULT_PARTS)}; "
                                   f"self-test: fail, hang)")
    p.add_argument("--timeout", action="append", default=[], metavar="PART=SECONDS",
                   help="override a part's time limit (repeatable)")
    p.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                   help=f"seconds for all parts together: a part gets at most what is left, and is skipped "
                        f"with less than {MIN_PART_S:.0f} s left (default {DEFAULT_DEADLINE_S})")
    p.add_argument("--work-dir", help="scratch folder (part logs, training runs; default: a new temporary folder)")
    p.add_argument("--merge", nargs="+", metavar="DIR",
                   help="write one report in --out from these folders of earlier calls (runs nothing)")
    return p


def main_args(a: argparse.Namespace) -> int:
    try:
        if a.merge:
            merge(a.out, a.merge)
            print(Path(a.out, "report.md").read_text())
            return 0
        parts, timeouts = parse_parts(a.parts), parse_timeouts(a.timeout)
        if a.deadline <= 0:
            raise ValueError(f"--deadline={a.deadline} is invalid; valid range: > 0 seconds")
    except (ValueError, FileNotFoundError) as e:
        print(f"megarl: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # ends the running part too (run_part)
    summary = run_runbook(a.out, parts, a.dry_run, timeouts, a.deadline, a.work_dir)
    print(Path(a.out, "report.md").read_text())
    return 0 if all(r["status"] == "ok" for r in summary["parts"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    return main_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
