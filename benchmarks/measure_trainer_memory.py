"""Peak memory per rank of the Megatron trainer on CPU, next to the memory plan's prediction.

Each layout runs as its own ``torchrun`` of N processes (gloo). Every process builds the trainer
for a small random model, trains one step (Adam's moments exist from then on), then measures the
second step: the kernel's peak-RSS counter (``VmHWM``) is reset just before it (``echo 5 >
/proc/self/clear_refs``) and read after it, and the process's RSS from before the trainer was
built (imports, process groups) is subtracted. So the figure is what the trainer holds at its
step's peak: weights, gradients, optimizer state, activations and the step's temporaries.

For RSS to follow live tensors, glibc is told to serve every allocation from 64 KiB up with its
own ``mmap`` and to return it on free (``M_MMAP_THRESHOLD`` fixed, ``M_TRIM_THRESHOLD`` 0): freed
tensors (the fresh init's whole-model copy, the first step's activations) leave the RSS.

The prediction is ``megarl.plan.memory``'s trainer terms for the same model and layout (the
engine is not built here, so its terms are not counted), with no runtime reserve.

    PYTHONPATH=. .venv/bin/python benchmarks/measure_trainer_memory.py --json /tmp/mem.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import warnings

LAYOUTS = {  # name: (processes, trainer tp, pp, dtype, distributed optimizer, recompute)
    "1proc-fp32-none": (1, 1, 1, "float32", False, "none"),
    "1proc-fp32-full": (1, 1, 1, "float32", False, "full"),
    "dp2-bf16-distopt-selective": (2, 1, 1, "bfloat16", True, "selective"),
    "tp2-fp32-none": (2, 2, 1, "float32", False, "none"),
    "pp2-fp32-none": (2, 1, 2, "float32", False, "none"),
}
MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, model_type="qwen2", max_position_embeddings=1024)
ROWS, SEQ, RESPONSE = 2, 512, 256  # one micro-batch of ROWS rows of SEQ tokens, RESPONSE scored


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _free_to_os() -> None:
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 0)


def worker(out: str, tp: int, pp: int, dtype: str, dist_opt: bool, recompute: str) -> None:
    _free_to_os()
    warnings.simplefilter("ignore")
    import gc

    import torch

    from megarl.models.config import ModelArgs
    from megarl.parallel.dist import init_parallel
    from megarl.trainer.trainer import Trainer, TrainerConfig

    torch.set_num_threads(1)
    dims = init_parallel(tp=tp, pp=pp)
    args = ModelArgs(**MODEL)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (ROWS, SEQ), generator=g)
    mask = torch.zeros(ROWS, SEQ - 1)
    mask[:, SEQ - 1 - RESPONSE:] = 1
    batch = {"input_ids": ids, "loss_mask": mask, "num_tokens": mask.sum() * dims.dp}

    def loss_fn(lp, mb):
        return -(lp * mb["loss_mask"].to(lp.dtype)).sum() / mb["num_tokens"], {}

    gc.collect()
    base = _rss_kib("VmRSS")
    tr = Trainer(args, TrainerConfig(micro_batch_size=ROWS, dtype=dtype, distributed_optimizer=dist_opt,
                                     recompute=recompute, lr=1e-4), dims, seed=1)
    tr.train_step(batch, loss_fn)
    gc.collect()
    static = _rss_kib("VmRSS") - base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    tr.train_step(batch, loss_fn)
    peak = _rss_kib("VmHWM") - base
    with open(f"{out}.{dims.rank}", "w") as f:
        json.dump({"rank": dims.rank, "peak_bytes": peak * 1024, "static_bytes": static * 1024}, f)


def predict(tp: int, pp: int, dp: int, dtype: str, dist_opt: bool, recompute: str) -> dict:
    from megarl.models.config import ModelArgs
    from megarl.plan.memory import PlanSpec, trainer_terms

    s = PlanSpec(args=ModelArgs(**MODEL), gpus=tp * pp * dp, tp=tp, pp=pp, trainer_dtype=dtype,
                 distributed_optimizer=dist_opt, recompute=recompute, micro_batch_size=ROWS, seq_len=SEQ,
                 response_len=RESPONSE, rows_per_dp_rank=ROWS, device="cpu")
    terms = trainer_terms(s, {})
    return {"total_bytes": sum(t.bytes for t in terms), "terms": {t.name: t.bytes for t in terms}}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(name: str, work: str) -> dict:
    nproc, tp, pp, dtype, dist_opt, recompute = LAYOUTS[name]
    out = os.path.join(work, name)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_free_port()}",
           __file__, "--worker", out, str(tp), str(pp), dtype, str(int(dist_opt)), recompute]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ranks = [json.load(open(f"{out}.{r}")) for r in range(nproc)]
    pred = predict(tp, pp, nproc // (tp * pp), dtype, dist_opt, recompute)
    peak = max(r["peak_bytes"] for r in ranks)
    return {"layout": name, "measured_peak_bytes": peak, "per_rank_peak_bytes": [r["peak_bytes"] for r in ranks],
            "per_rank_static_bytes": [r["static_bytes"] for r in ranks], "predicted_bytes": pred["total_bytes"],
            "predicted_terms": pred["terms"], "error_pct": 100 * (pred["total_bytes"] - peak) / peak}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        out, tp, pp, dtype, dist_opt, recompute = sys.argv[2:8]
        worker(out, int(tp), int(pp), dtype, bool(int(dist_opt)), recompute)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--layouts", help="comma-separated names (default: all)")
    a = ap.parse_args()
    names = a.layouts.split(",") if a.layouts else list(LAYOUTS)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name in names:
            rows.append(run_layout(name, work))
            r = rows[-1]
            print(f"{name:<48} predicted {r['predicted_bytes'] / 2**20:8.1f} MiB  measured "
                  f"{r['measured_peak_bytes'] / 2**20:8.1f} MiB  error {r['error_pct']:+.1f}%", flush=True)
    from megarl.utils.fs import atomic_write_text

    atomic_write_text(a.json, json.dumps({"model": MODEL, "rows": ROWS, "seq": SEQ, "response": RESPONSE,
                                          "layouts": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
