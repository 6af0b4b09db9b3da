"""A real two-process ``megarl train`` run, launched the way srun launches it (each process gets
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; no torchrun agent to kill the siblings): killing
one rank mid-run must end the other with a non-zero exit and a message naming the dead rank,
well within 60 s, instead of a hang in the next collective."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiproc
def test_killed_rank_ends_the_run(tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(ROOT / "configs" / "dp2.yaml"),
           "--run-dir", str(run_dir), "--set", "rl_steps=1000", "--set", "sft.steps=0", "--set", "checkpoint_every=0",
           "--set", "watchdog.interval_s=0.5", "--set", "watchdog.timeout_s=3"]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().strip()):  # RL steps are running
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                outs = [p.communicate()[1][-2000:] for p in procs]
                pytest.fail(f"the run ended or stalled before its first RL step: {outs}")
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
        waited = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert procs[0].returncode != 0
    assert waited < 60
    assert "megarl[rank 0]: rank 1 stopped heartbeating" in err, err[-3000:]
