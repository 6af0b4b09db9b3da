"""GPU check of the trainer's real-size options (skipped without CUDA; the worker also runs on
CPU, which is how it is kept working between leases): bf16 mixed precision with the distributed
optimizer and full recompute moves the fp32 master weights like fp32 training within bf16
rounding on CUDA, and a Qwen3-MoE model trains on a GPU without Transformer Engine."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "gpu_real_size_worker.py"


def run_worker(out: Path, cuda: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def check(res: dict) -> None:
    assert res["dtypes"] == ["torch.bfloat16"] and res["grad_dtypes"] == ["torch.float32"]
    for l32, l16 in res["losses"]:
        assert abs(l16 - l32) < 2e-3 * abs(l32)
    err = math.sqrt(sum(((res["masters"][n] - w) ** 2).sum().item() for n, w in res["fp32"].items()))
    size = math.sqrt(sum(((w - res["before"][n]) ** 2).sum().item() for n, w in res["fp32"].items()))
    assert err < 0.05 * size, (err, size)
    assert math.isfinite(res["moe_loss"])


def test_worker_on_cpu(tmp_path):
    res = run_worker(tmp_path / "cpu.pt", cuda=False)
    assert res["device"] == "cpu"
    check(res)


@pytest.mark.gpu
def test_real_size_options_on_cuda(tmp_path):
    res = run_worker(tmp_path / "cuda.pt", cuda=True)
    assert res["device"].startswith("cuda")
    check(res)
