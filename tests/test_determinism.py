"""Two processes training the default model on the same data end with bit-identical weights
(`deterministic: true`, the default). Without it, CPU backward kernels accumulate in thread
order at this width and the checksums differ from the first step (seen on 2 cores)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checksum(deterministic: bool) -> str:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "determinism_worker.py"), str(int(deterministic))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [ln for ln in proc.stdout.splitlines() if ln.startswith("CHECKSUM")][0]


def test_training_is_bitwise_repeatable():
    assert checksum(True) == checksum(True)
