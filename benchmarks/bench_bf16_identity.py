"""Token identity of speculative vs plain decoding in bf16 on the real model:
mismatched responses per 10k tokens, and where each one diverges.

For each of ``--steps`` batches of a config's prompts (its chat template, task, group size,
temperature), one process, the config's engine in bf16:
- ``plain``: the batch generated without speculation (the reference);
- ``spec``: the same batch with every draft source of the config. Bubble drafts come from the
  same weights with 1% relative noise added (what an RL update does to the next step's drafts:
  they are mostly right, then diverge), so verify rows of every draft length appear.
A ``spec`` response that differs from ``plain`` is a mismatch (each response counts once; its
step, request, first differing position and the two tokens there are listed).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_bf16_identity.py --config configs/smollm2.yaml --steps 20
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from megarl.config import load_config
from megarl.bench.rollout import first_divergence
from megarl.engine import Engine
from megarl.models.hf_io import load_hf_model
from megarl.sched.prompts import prompt_uids_for_step
from megarl.setup_run import prepare_inputs
from megarl.spec.speculator import Speculator
from megarl.rollout.stage import RolloutStage


def _perturbed(state: dict[str, torch.Tensor], scale: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.abs() * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in state.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--steps", type=int, default=20, help="batches of prompts (prompts_per_step x group_size each)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--noise", type=float, default=0.01, help="relative weight noise of the bubble drafts' model")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, ["rollout.dtype=bfloat16"])
    inputs = prepare_inputs(cfg)
    model = load_hf_model(inputs.init_from_hf, torch.bfloat16)
    exact = {k: v.clone() for k, v in model.state_dict().items()}
    spec = Speculator(dataclasses.replace(cfg.spec, enabled=True))
    engine = Engine(model, cfg.rollout.engine_config(inputs.max_seq_len), seed=cfg.seed, spec=spec)
    stage = RolloutStage(engine, inputs, cfg.rollout, cfg.reward)
    f = {"tokens": 0, "mismatched": 0, "responses": 0, "plain_s": 0.0, "spec_s": 0.0, "mismatches": []}
    for step in range(args.steps):
        reqs = stage.requests(prompt_uids_for_step(step, cfg.rollout.prompts_per_step, cfg.seed, len(inputs.problems)))
        engine.load_weights(_perturbed(exact, args.noise, step))
        engine.pregenerate(reqs, step)  # the drafts of a slightly different policy
        engine.load_weights(exact)
        engine.spec = None
        t0 = time.perf_counter()
        ref = engine.generate(reqs, step)
        f["plain_s"] += time.perf_counter() - t0
        engine.spec = spec
        t0 = time.perf_counter()
        out = engine.generate(reqs, step)
        f["spec_s"] += time.perf_counter() - t0
        f["tokens"] += sum(len(r.tokens) for r in ref)
        f["responses"] += len(ref)
        for i, (a, b) in enumerate(zip(out, ref)):
            if a.tokens != b.tokens:
                f["mismatched"] += 1
                f["mismatches"].append({"step": step, **first_divergence(i, a.tokens, b.tokens)})
        print(f"step {step}: {f['mismatched']} mismatched of {f['responses']} responses, {f['tokens']} tokens",
              flush=True)
    report = {"config": args.config, "steps": args.steps, "threads": args.threads, "noise": args.noise, **f,
              "mismatch_per_10k_tokens": 1e4 * f["mismatched"] / max(f["tokens"], 1)}
    print(json.dumps(report, indent=2))
    if args.json:
        from megarl.utils.fs import atomic_write_text

        atomic_write_text(args.json, json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
