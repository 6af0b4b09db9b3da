"""Launch settings for the engine's process (OpenMP wait policy, preloaded allocator / OpenMP runtime),
measured as processes alternated: these settings are read when a process starts, so they cannot
change inside one.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_launch_env.py --model ~/.cache/megarl/models/smollm2 \\
        [--variants default,passive,tcmalloc,tc_iomp,passive_tc,tc_iomp_bt0] [--cells float32:1:24,bfloat16:64:12] \\
        [--rounds 2]

Each child loads the model into an ``Engine`` and decodes ``n`` greedy tokens for ``batch`` random
prompts; it prints decode CPU and wall ms per token (t(n) - t(1)). Variants run in turn, the order
reversed every round. Preloads are looked up at their usual paths (Debian's libtcmalloc-minimal4,
the venv's libiomp5 from vLLM's intel-openmp); a variant whose library is missing is skipped.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
IOMP = str(Path(sys.prefix, "lib", "libiomp5.so"))
VARIANTS = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "tcmalloc": {"LD_PRELOAD": TCMALLOC},
    "tc_iomp": {"LD_PRELOAD": f"{TCMALLOC}:{IOMP}"},
    "passive_tc": {"OMP_WAIT_POLICY": "PASSIVE", "LD_PRELOAD": TCMALLOC},
    "tc_iomp_bt0": {"LD_PRELOAD": f"{TCMALLOC}:{IOMP}", "KMP_BLOCKTIME": "0"},
}


def child(model: str, dtype: str, batch: int, n: int) -> None:
    import torch

    from megarl.engine import Engine, EngineConfig, Request, SamplingParams
    from megarl.models.hf_io import load_hf_model

    torch.set_num_threads(2)
    cfg = EngineConfig(max_batch_size=batch, max_seq_len=40 + n, dtype=dtype)
    eng = Engine(load_hf_model(model, cfg.torch_dtype), cfg, seed=0)
    prompts = torch.randint(0, eng.vocab_size, (batch, 36), generator=torch.Generator().manual_seed(0)).tolist()

    def run(k):
        p = SamplingParams(temperature=0.0, max_new_tokens=k, stop_token_ids=())
        c, w = time.process_time(), time.perf_counter()
        eng.generate([Request(uid=i, sample_idx=0, prompt_ids=x, params=p) for i, x in enumerate(prompts)], step=0)
        return time.process_time() - c, time.perf_counter() - w

    run(2)
    (c1, w1), (cn, wn) = run(1), run(n)
    print(f"RESULT {1e3 * (cn - c1) / (batch * (n - 1)):.3f} {1e3 * (wn - w1) / (batch * (n - 1)):.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--variants", default="default,passive,tcmalloc,tc_iomp")
    ap.add_argument("--cells", default="float32:1:24,bfloat16:64:12")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=3, metavar=("DTYPE", "BATCH", "N"))
    a = ap.parse_args(argv)
    if a.child:
        child(a.model, a.child[0], int(a.child[1]), int(a.child[2]))
        return 0
    names = a.variants.split(",")
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        print(f"bench_launch_env: error: unknown variants {bad} (valid: {', '.join(VARIANTS)})", file=sys.stderr)
        return 2
    for r in range(a.rounds):
        for cell in a.cells.split(","):
            dtype, batch, n = cell.split(":")
            for v in names if r % 2 == 0 else names[::-1]:
                env = {k: x for k, x in os.environ.items() if k not in ("OMP_WAIT_POLICY", "LD_PRELOAD", "KMP_BLOCKTIME")}
                pre = VARIANTS[v].get("LD_PRELOAD", "")
                if any(not Path(lib).is_file() for lib in pre.split(":") if lib):
                    print(f"round {r + 1} {cell} {v}: skipped ({pre} missing)")
                    continue
                out = subprocess.run([sys.executable, __file__, "--model", a.model, "--child", dtype, batch, n],
                                     env={**env, **VARIANTS[v]}, capture_output=True, text=True)
                res = [ln.split()[1:] for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
                print(f"round {r + 1} {cell} {v}: " + (f"CPU {res[0][0]} ms/token, wall {res[0][1]} ms/token"
                                                        if res else f"failed: {out.stderr[-300:]}"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
