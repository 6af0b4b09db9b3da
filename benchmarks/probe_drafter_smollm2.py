"""Can the learned EAGLE drafter (megarl/spec/drafter.py) draft for a real model at T=1? A probe for
speculation at T=1 (docs/benchmarks.md, "Learned drafter on SmolLM2").

The policy is fixed (the config's initial weights): what is measured is how well a drafter trained
on that policy's own rollouts drafts for it on prompts it has not seen, and what that buys in
wall-clock. ``--collect`` batches of the config's prompts (its ``prompts_per_step`` x ``group_size``
requests each) are generated with hidden-state capture and the drafter takes ``--train-steps``
steps after each (what ``spec.drafter.steps_after_rollout`` does in a run). Then, on ``--eval``
batches of prompts none of the collect batches used, plain decoding (the reference, timed) is
compared with drafter-only speculation (every row drafts K, no cost rule) and with the cost rule:
forward reduction, accepted tokens per drafted forward, the engine's batched forwards (the
critical path), time ratio, exact match. Variants alternate per batch (plain, K=..., plain, ...).

    PYTHONPATH=. .venv/bin/python benchmarks/probe_drafter_smollm2.py --config configs/smollm2.yaml
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from megarl.config import load_config
from megarl.engine import Engine
from megarl.models.hf_io import load_hf_model
from megarl.sched.prompts import prompt_uids_for_step
from megarl.setup_run import prepare_inputs
from megarl.spec.config import DrafterConfig
from megarl.spec.drafter import save_drafter
from megarl.spec.speculator import Speculator
from megarl.rollout.stage import RolloutStage


def speculator(cfg, cost_rule: bool, **drafter) -> Speculator:
    spec = dataclasses.replace(cfg.spec, enabled=True, sources=(),
                               **({} if cost_rule else {"forward_cost_tokens": 0.0}))
    spec.drafter = DrafterConfig(**{**dataclasses.asdict(cfg.spec.drafter), "enabled": True, **drafter})
    return Speculator(spec)


def timed(engine: Engine, reqs, step: int) -> tuple[list, float, int]:
    engine.reset_stats()
    t0 = time.perf_counter()
    res = engine.generate(reqs, step)
    return res, time.perf_counter() - t0, engine.stats["forwards"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--collect", type=int, default=6, help="batches generated for drafter training")
    ap.add_argument("--train-steps", type=int, default=40, help="drafter steps after each collect batch")
    ap.add_argument("--eval", type=int, default=2, help="batches of unseen prompts measured")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--json", default=None)
    ap.add_argument("--save", default=None, metavar="DIR", help="write the trained drafter here")
    ap.add_argument("--load", default=None, metavar="DIR", help="skip collection: evaluate this drafter")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [f"rollout.dtype={args.dtype}", *args.set])
    inputs = prepare_inputs(cfg)
    model = load_hf_model(inputs.init_from_hf, getattr(torch, args.dtype))
    ecfg = cfg.rollout.engine_config(inputs.max_seq_len)
    n_prob, pps = len(inputs.problems), cfg.rollout.prompts_per_step

    # Collect with the drafter attached but not drafting (strategy "sources", no sources): the
    # engine captures hidden states; the drafter trains after each batch.
    collect_spec = speculator(cfg, cost_rule=False, strategy="sources", init_from=args.load)
    eng = Engine(model, ecfg, seed=cfg.seed, spec=collect_spec)
    collect_spec.attach(eng.draft_target())
    stage = RolloutStage(eng, inputs, cfg.rollout, cfg.reward)
    report = {"config": args.config, "dtype": args.dtype, "threads": args.threads, "collect": [], "eval": [],
              "drafter_from": args.load}
    t0 = time.perf_counter()
    for step in range(0 if args.load else args.collect):
        res = eng.generate(stage.requests(prompt_uids_for_step(step, pps, cfg.seed, n_prob)), step)
        tr = collect_spec.drafter.trainer.train(max_steps=args.train_steps)
        row = {"step": step, "tokens": sum(len(r.tokens) for r in res), "buffer": len(collect_spec.drafter.buffer),
               **tr, "elapsed_s": time.perf_counter() - t0}
        report["collect"].append(row)
        print(json.dumps(row), flush=True)
    state = {k: v.detach().clone() for k, v in collect_spec.drafter.model.state_dict().items()}
    if args.save:
        save_drafter(collect_spec.drafter.model, args.save)

    variants = {f"k{k}": dict(cost_rule=False, strategy="drafter", k=k) for k in args.k}
    variants["cost_rule"] = dict(cost_rule=True, strategy="drafter", k=max(args.k))
    specs = {}
    for name, v in variants.items():
        v = dict(v)
        s = speculator(cfg, v.pop("cost_rule"), **v)
        specs[name] = s
    plain = Engine(model, ecfg, seed=cfg.seed)
    for e in range(args.eval):
        # prompts after every collect batch's (the sequence of steps walks a permutation of the set)
        step = args.collect + e
        reqs = stage.requests(prompt_uids_for_step(step, pps, cfg.seed, n_prob))
        ref, t_ref, f_ref = timed(plain, reqs, step)
        tokens = sum(len(r.tokens) for r in ref)
        row = {"step": step, "tokens": tokens, "plain": {"time_s": t_ref, "batched_forwards": f_ref}}
        for name, s in specs.items():
            eng_v = Engine(model, ecfg, seed=cfg.seed, spec=s)
            s.attach(eng_v.draft_target())  # builds the drafter, then the trained weights go in
            s.drafter.model.load_state_dict(state)
            res, t, f = timed(eng_v, reqs, step)
            m = s.metrics()
            row[name] = {"time_s": t, "speedup": t_ref / t, "batched_forwards": f,
                         "forward_reduction": 1 - sum(r.n_forwards for r in res) / max(tokens, 1),
                         "accept_len": m.get("spec/accept_len_mean", 0.0),
                         "exact_match": [r.tokens for r in res] == [r.tokens for r in ref]}
            _, t2, _ = timed(plain, reqs, step)  # plain again between variants (drift)
            row[name]["speedup_vs_next_plain"] = t2 / t
        report["eval"].append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
