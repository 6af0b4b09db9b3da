"""torch's ``F.linear`` vs oneDNN packed linears (megarl/models/packed_linear.py) on SmolLM2-135M's
linear shapes, weights out of cache (30 layers' worth, random), and the row-count invariance of both.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_packed_linear.py [--threads 2]

Prints, per dtype and row count M, the time of one pass over every linear of the model (what a
decode step's matmuls cost), the two alternated (A/B/A/B, fastest of --repeats); then, per dtype,
for which row counts in 1..16 some row of an M-row matmul differs from the same row among 64.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from megarl.models import packed_linear

# SmolLM2-135M: fused q/k/v, o_proj, fused gate/up, down_proj per layer (30 layers); the tied LM head.
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS, HEAD = 30, (49152, 576)


def _pass_time(fn, weights, xs) -> float:
    t0 = time.perf_counter()
    for w in weights:
        fn(xs[w.shape[1]], w)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not packed_linear.available():
        raise SystemExit("this torch build has no oneDNN linear ops")
    packs = packed_linear.PackedLinears(torch.nn.Module())
    g = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}; one pass = {LAYERS} layers x {len(LAYER)} linears + LM head {HEAD}")
    for dtype in (torch.float32, torch.bfloat16):
        weights = [(torch.randn(n, k, generator=g) * 0.02).to(dtype) for n, k in LAYER * LAYERS + [HEAD]]
        with packs.active():
            for w in weights:
                packs.packed(w)  # reorder once, untimed
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in (576, 1536)}
            plain, packed = [], []
            for _ in range(args.repeats):
                plain.append(_pass_time(F.linear, weights, xs))
                with packs.active():
                    packed.append(_pass_time(packed_linear.linear, weights, xs))
            print(f"{str(dtype):>15} rows {m:3d}  F.linear {min(plain) * 1e3:7.1f} ms  packed {min(packed) * 1e3:7.1f} ms"
                  f"  speedup {min(plain) / min(packed):4.2f}x", flush=True)
        for name, fn in (("F.linear", F.linear), ("packed", packed_linear.linear)):
            varies = set()
            for n, k in LAYER + [(8192, 576)]:
                w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
                x = torch.randn(64, k, generator=g).to(dtype)
                with packs.active():
                    full = fn(x, w)
                    varies |= {m for m in range(1, 17) if not torch.equal(fn(x[:m], w), full[:m])}
            print(f"{str(dtype):>15} {name:>8}: row counts 1..16 whose rows differ from the same rows among 64: "
                  f"{sorted(varies) or 'none'}")
        del weights


if __name__ == "__main__":
    main()
