"""Per-program overhead of ``megarl.rl.sandbox.run_python``: N runs of a trivial program.

Rewards that execute code call it once per response, so its fixed cost (interpreter start-up,
namespaces, mounts) multiplies by the rollout batch. Prints mean / median / p95 wall time per run
for each containment mode this machine can run (``bwrap``: bubblewrap's namespaces; ``netns``:
network namespace only; ``audit-hook``), and for a bare ``python -I -S -B -c pass`` as the floor.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_sandbox.py [--runs 50]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from megarl.rl import sandbox


def _summary(name: str, seconds: list[float]) -> str:
    ms = sorted(s * 1000 for s in seconds)
    p95 = ms[max(0, -(-95 * len(ms) // 100) - 1)]
    return f"{name}: mean {statistics.mean(ms):.1f} ms, median {statistics.median(ms):.1f} ms, p95 {p95:.1f} ms"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=50)
    a = p.parse_args()
    print("containment used by run_python:", sandbox.sandbox_containment())
    bare = []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", "-B", "-c", "pass"], check=True)
        bare.append(time.perf_counter() - t0)
    print(_summary("bare interpreter", bare))
    modes = ["bwrap"] if sandbox.sandbox_containment() == "bwrap" else []
    modes += ["netns"] if sandbox._legacy_isolation() == "netns" else []
    for mode in modes + ["audit-hook"]:
        runs = []
        for _ in range(a.runs):
            t0 = time.perf_counter()
            res = sandbox._run("print(sum(range(10)))", "", sandbox.SandboxLimits(), mode=mode)
            runs.append(time.perf_counter() - t0)
            assert res.ok and res.stdout == "45\n", res
        print(_summary(f"run_python, {mode}", runs))


if __name__ == "__main__":
    main()
