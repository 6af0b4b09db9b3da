"""Cost of a speculative verify step vs a plain decode step, by batch size: the measurement behind
``spec.forward_cost_tokens`` (and ``spec.max_batch``).

A verify step over K drafts per request yields on average ``accept_len`` tokens per request; it
pays off while ``verify_time(K) / decode_time < accept_len``. The script times the engine's own
``run`` (forward through the cache + sampling/verification) on the model of a config, with every
request holding ``--context`` cached tokens, and prints the ratio per batch size and K, side by
side in one process. It then fits ``time = a + c * B + b * B * (K + 1)`` (a: fixed cost of a
forward, c: per request, b: per token row) over the steps of at most ``--fit-max-rows`` token
rows (past the device's saturation time grows faster than linearly) and prints ``a / b``, the value
to give ``spec.forward_cost_tokens`` on this device.

    .venv/bin/python benchmarks/bench_verify_cost.py --config configs/tiny.yaml [--device cuda]
    .venv/bin/python benchmarks/bench_verify_cost.py --model ~/.cache/megarl/models/smollm2 --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megarl.config import load_config
from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.engine.engine import _Batch, _Seq
from megarl.models.hf_io import load_hf_model
from megarl.models.llama import CausalLM
from megarl.setup_run import prepare_inputs


def time_step(engine: Engine, batch_size: int, k: int, context: int, repeats: int) -> float:
    """Median seconds of one ``Engine.run`` over ``batch_size`` requests with ``k`` drafts each."""
    table = engine.cache.table
    seqs = []
    for i in range(batch_size):
        s = _Seq(i, Request(uid=i, sample_idx=0, prompt_ids=[2] * 4, params=SamplingParams()))
        s.slot, s.tokens = table.allocate(), [3] * (context - 4)
        seqs.append(s)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first is a warm-up
            for s in seqs:
                table.lengths[s.slot] = context - 1
            batch = _Batch(seqs, [[3] for _ in seqs], [[5] * k for _ in seqs])
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.run(batch, step=0)
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    for s in seqs:
        table.free(s.slot)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml", help="the model of this run config (random weights)")
    ap.add_argument("--model", metavar="HF_DIR", help="instead of --config: the weights of a HF folder (e.g. SmolLM2 "
                    "from `megarl fetch smollm2`)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", default="1,4,16,64,256")
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--context", type=int, default=128, help="cached tokens per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fit-max-rows", type=int, default=64,
                    help="fit the cost model on the steps of at most this many token rows (batch x (K+1))")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        model = load_hf_model(args.model)
    else:
        torch.manual_seed(0)
        model = CausalLM(prepare_inputs(load_config(args.config)).args)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    ks = [int(x) for x in args.ks.split(",")]
    engine = Engine(model, EngineConfig(max_batch_size=max(sizes), max_seq_len=args.context + max(ks) + 2,
                                                        dtype=args.dtype, device=args.device), seed=0)
    rows, points = [], []
    print(f"{'batch':>6} {'decode ms':>10} " + " ".join(f"{'K=' + str(k) + ' ratio':>11}" for k in ks))
    for b in sizes:
        base = time_step(engine, b, 0, args.context, args.repeats)
        points.append((b, 0, base))
        ratios = {}
        for k in ks:
            t = time_step(engine, b, k, args.context, args.repeats)
            points.append((b, k, t))
            ratios[k] = t / base
        rows.append({"batch": b, "decode_ms": base * 1e3, "verify_ratio": ratios})
        print(f"{b:>6} {base * 1e3:>10.2f} " + " ".join(f"{ratios[k]:>11.2f}" for k in ks))
    print("speculation pays off while the ratio stays below the mean tokens per verify forward "
          "(accept_len_mean of `megarl bench rollout`)")
    # Fit where the cost rule decides (a forward of few token rows): past the device's saturation
    # the time grows faster than linearly (a CPU at 64 x 9 rows; SmolLM2, 2026-11-25), and points
    # from there gave a negative fixed cost.
    used = [(b, k, t) for b, k, t in points if b * (k + 1) <= args.fit_max_rows]
    x = torch.tensor([[1.0, b, b * (k + 1)] for b, k, _ in used], dtype=torch.float64)
    y = torch.tensor([t for _, _, t in used], dtype=torch.float64)
    a, c, tok = torch.linalg.lstsq(x, y[:, None]).solution[:, 0].tolist() if len(used) >= 3 else (0.0, 0.0, 0.0)
    fit = {"forward_ms": a * 1e3, "per_request_ms": c * 1e3, "per_token_ms": tok * 1e3, "points": len(used),
           "forward_cost_tokens": a / tok if a > 0 and tok > 0 else None}
    if fit["forward_cost_tokens"] is None:
        print(f"fit over the {len(used)} steps of <= {args.fit_max_rows} token rows: no positive fixed and per-row "
              "cost (too few points, or the device is not linear there); set spec.forward_cost_tokens from the table")
    else:
        print(f"fit over the {len(used)} steps of <= {args.fit_max_rows} token rows: {fit['forward_ms']:.3f} ms per "
              f"forward + {fit['per_request_ms']:.4f} ms per request + {fit['per_token_ms']:.4f} ms per token row "
              f"-> spec.forward_cost_tokens ~ {fit['forward_cost_tokens']:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model or args.config, "threads": torch.get_num_threads(), "device": args.device, "dtype": args.dtype, "context": args.context, "rows": rows,
                       "fit": fit}, f, indent=2)


if __name__ == "__main__":
    main()
