"""Launch a worker script under torchrun on gloo for the multi-process tests."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(worker: Path, nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``worker`` on ``nproc`` local ranks; assert it exited 0 (its output in the message)."""
    # gloo on CPU even on a GPU machine: several ranks cannot share one GPU over NCCL.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(nproc), str(worker), *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
