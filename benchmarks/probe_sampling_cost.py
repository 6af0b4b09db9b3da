"""Where megarl's engine spends a decode at T=0 and at T=1 (docs/benchmarks.md, "Decode tokens/s
per backend"): timers around the engine's forward, LM head, sampler and token statistics, over the
same random prompts as ``megarl bench engine --model`` (equal lengths), T=0 and T=1 alternated,
the first round a warm-up. ``--kernel-paths scalar,avx512`` runs each T=1 decode once per path of
the fused sampler (csrc/keyed_gumbel.cpp), alternated in the same process (same tokens on both).

    PYTHONPATH=. .venv/bin/python benchmarks/probe_sampling_cost.py --model ~/.cache/megarl/models/smollm2
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import os
import time

import torch

import megarl.engine.runner as runner_mod
from megarl.bench.engine_model import _prompts, _requests
from megarl.engine import Engine, sampler
from megarl.engine.requests import EngineConfig
from megarl.engine.runner import ModelRunner
from megarl.models.hf_io import load_hf_model

PHASES = collections.defaultdict(float)


def _timed(name: str, fn):
    def wrapped(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            PHASES[name] += time.perf_counter() - t0
    return wrapped


def _digest(results) -> str:
    """A short fingerprint of every response's tokens (equal runs print the same one)."""
    return hashlib.sha256(str([r.tokens for r in results]).encode()).hexdigest()[:12]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.expanduser("~/.cache/megarl/models/smollm2"))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="timed rounds after the warm-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernel-paths", default="default",
                   help="comma list of default, scalar, avx512: the fused sampler's path per T=1 run")
    a = p.parse_args(argv)
    paths = a.kernel_paths.split(",")
    if not set(paths) <= {"default", "scalar", "avx512"}:
        p.error(f"--kernel-paths={a.kernel_paths!r}: choose from default, scalar, avx512")
    if "avx512" in paths and not (sampler._native is not None and sampler._native.avx512):
        p.error("--kernel-paths avx512: the fused sampler is not built, or this CPU has no AVX-512")
    torch.set_num_threads(a.threads)
    runner_mod.sample_rows = _timed("sample", runner_mod.sample_rows)
    runner_mod.token_stats = _timed("token_stats", runner_mod.token_stats)
    ModelRunner.forward = _timed("forward", ModelRunner.forward)
    ModelRunner.head_logits = _timed("head", ModelRunner.head_logits)
    model = load_hf_model(a.model, getattr(torch, a.dtype)).eval()
    eng = Engine(model, EngineConfig(max_batch_size=a.batch, max_seq_len=a.prompt_len + a.new_tokens,
                                     dtype=a.dtype), seed=0)
    prompts = _prompts(model.args.vocab_size, a.batch, a.prompt_len)
    for rnd in range(a.rounds + 1):
        for temperature, path in [(0.0, "default")] + [(1.0, q) for q in paths]:
            sampler.NATIVE_VECTOR = path != "scalar"
            PHASES.clear()
            t0 = time.perf_counter()
            out = eng.generate(_requests(prompts, [a.new_tokens] * a.batch, temperature), step=rnd)
            total = time.perf_counter() - t0
            if rnd:
                parts = " ".join(f"{k} {v:.2f}s" for k, v in sorted(PHASES.items()))
                label = "" if path == "default" else f" ({path})"
                print(f"{a.dtype} batch {a.batch} T={temperature:g}{label} round {rnd}: total {total:.2f}s {parts} "
                      f"rest {total - sum(PHASES.values()):.2f}s tokens {_digest(out)}",
                      flush=True)
    sampler.NATIVE_VECTOR = True


if __name__ == "__main__":
    main()
