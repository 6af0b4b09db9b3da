"""Peak resident memory and throughput of ``megarl convert`` on a synthetic ~2 GB checkpoint.

Writes a random Qwen2-architecture HF folder (fp32, ~2 GB by default, streamed so this script never
holds it), then runs hf -> mcore (TP=2, PP=2) and mcore -> hf, each in a fresh child process, and
prints each child's peak RSS (``VmHWM``) and MB/s. Not a test: a figure for the issue's note.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_convert.py [--layers 8] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megarl.checkpoint.safetensors_stream import StreamWriter
from megarl.models import mcore_mapping as mm
from megarl.models.config import ModelArgs

CHILD = """
import sys
from megarl.checkpoint import convert as cv
from megarl.checkpoint.convert_cli import main_convert
main_convert(sys.argv[1:] + ["--no-progress"])
# VmHWM: this process image's peak RSS (ru_maxrss would include the parent's, inherited over fork)
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print("PEAK_RSS_MB", int(hwm.split()[1]) / 1024)
"""


def write_synthetic(path: Path, layers: int) -> int:
    """A random Qwen2 HF folder: hidden 2048, GQA 16/4 heads, ffn 5632, vocab 32000 (~245 MB/layer-set)."""
    args = ModelArgs(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                     num_attention_heads=16, num_key_value_heads=4, model_type="qwen2")
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(args.to_hf_config("float32")))
    shapes = mm.hf_shapes(args)
    gen = torch.Generator().manual_seed(0)
    with StreamWriter(path / "model.safetensors", [(n, s, torch.float32) for n, s in shapes.items()]) as w:
        for name, shape in shapes.items():
            w.write(name, torch.randn(shape, generator=gen) * 0.02)
        return w.total_bytes


def run_child(argv: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, *argv], check=True, capture_output=True, text=True).stdout
    peak = float(next(line.split()[1] for line in out.splitlines() if line.startswith("PEAK_RSS_MB")))
    summary = next(line for line in out.splitlines() if line.startswith("converted"))
    return peak, f"{summary} (process wall {time.perf_counter() - t0:.1f} s)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="decoder layers (8: ~2.0 GB fp32)")
    p.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir, removed after)")
    a = p.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench_convert-"))
    try:
        size = write_synthetic(work / "hf", a.layers)
        print(f"synthetic checkpoint: {size / 1e9:.2f} GB fp32")
        for name, argv in [("hf -> mcore (tp=2, pp=2)", ["hf-to-mcore", "--hf", str(work / "hf"), "--out",
                                                          str(work / "mc"), "--tp", "2", "--pp", "2"]),
                           ("mcore -> hf", ["mcore-to-hf", "--ckpt", str(work / "mc"), "--out", str(work / "back")])]:
            peak, summary = run_child(argv)
            print(f"{name}: peak RSS {peak:.0f} MiB; {summary}")
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print("bench process peak RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, "MiB")


if __name__ == "__main__":
    main()
