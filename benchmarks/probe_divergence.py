"""How far would branch drafts go? A probe (docs/benchmarks.md, "Divergences of
a response from the previous policy").

A bubble draft of step t is the response the previous policy (step t-1's weights) samples under
step t's noise. It stays useful until the response first differs from it; a branch draft would
supply the previous policy's continuation after that point, and so on. The best any such scheme
can do is bounded by this: teacher-force each of step t's responses through the previous policy,
take its coupled token at every position (the previous policy's Gumbel-argmax under the same noise,
given the response's own prefix), and count the positions where it differs from the response.
Each is a divergence that a draft chain conditioned on the true prefix would still hit; a response
with d of them needs at least d + 1 drafted forwards (plus one per draft-length limit). The probe
also ranks each divergence by the previous policy's margin there (best minus second-best perturbed
score), to see whether the lowest-margin positions hold them, as branch drafts assume.

Runs the real loop of a config (GRPO updates between steps, one process), like ``bench rollout``.

    PYTHONPATH=. .venv/bin/python benchmarks/probe_divergence.py --config configs/smollm2.yaml --steps 4
"""
from __future__ import annotations

import argparse
import copy
import json

import numpy as np
import torch

from megarl.config import load_config
from megarl.engine import Engine
from megarl.engine.sampler import filter_logits, gumbel_noise, sample_keyed
from megarl.models.llama import CausalLM
from megarl.parallel.dist import init_distributed, shutdown_distributed
from megarl.parallel.weight_sync import WeightSync
from megarl.rl.grpo import UpdateSpec
from megarl.sched.prompts import prompt_uids_for_step
from megarl.setup_run import prepare_inputs
from megarl.rollout.stage import RolloutStage
from megarl.stages.update import grpo_update
from megarl.trainer.trainer import Trainer
from megarl.train import set_deterministic


@torch.inference_mode()
def divergences(model: CausalLM, res, step: int, seed: int, temperature: float) -> dict:
    """The previous policy ``model`` teacher-forced over one response: positions where its coupled
    token differs from the response's, and each one's margin rank (0 = the lowest margin)."""
    ids = torch.tensor([res.prompt_ids + res.tokens])
    n, p = len(res.tokens), len(res.prompt_ids)
    logits = model.logits(model.hidden_states(ids)[0, p - 1:p - 1 + n]).float()
    key = [torch.full((n,), res.uid), torch.full((n,), res.sample_idx), torch.arange(n)]
    toks = sample_keyed(logits, temperature, 0, 1.0, seed, step, *key)
    diff = (toks != torch.tensor(res.tokens)).nonzero()[:, 0].tolist()
    scores = filter_logits(logits, temperature, 0, 1.0) + gumbel_noise(seed, step, *key, logits.shape[1], torch.float32)
    top2 = scores.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).numpy()
    rank = np.argsort(np.argsort(margin, kind="stable"), kind="stable")
    return {"length": n, "finish": res.finish_reason, "divergences": diff, "ranks": [int(rank[i]) for i in diff]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    args = ap.parse_args()
    cfg = load_config(args.config, args.set)
    inputs = prepare_inputs(cfg)
    if cfg.deterministic:
        set_deterministic()
    dims = init_distributed()
    rows = []
    try:
        trainer = Trainer(inputs.args, cfg.trainer, dims, hf_dir=inputs.init_from_hf,
                          mcore_dir=inputs.init_from_mcore, seed=cfg.seed)
        trainer.set_lr(cfg.trainer.lr)
        engine = Engine(CausalLM(inputs.args), cfg.rollout.engine_config(inputs.max_seq_len), seed=cfg.seed)
        sync = WeightSync(trainer, engine)
        sync()
        stage = RolloutStage(engine, inputs, cfg.rollout, cfg.reward)
        previous = None
        for step in range(args.steps):
            uids = prompt_uids_for_step(step, cfg.rollout.prompts_per_step, cfg.seed, len(inputs.problems))
            res = engine.generate(stage.requests(uids), step)
            if previous is not None:
                for r in res:
                    rows.append({"step": step, **divergences(previous, r, step, cfg.seed, cfg.rollout.temperature)})
                capped = [x for x in rows if x["step"] == step and x["finish"] == "length"]
                print(f"step {step}: {len(res)} responses, {len(capped)} capped, divergences per capped response "
                      f"{[len(x['divergences']) for x in capped]}", flush=True)
            previous = copy.deepcopy(engine.model)  # this step's weights: the next step's "previous policy"
            grpo_update(trainer, stage.groups(uids, res), UpdateSpec.of(cfg, inputs.tokenizer.pad_id))
            sync()
    finally:
        shutdown_distributed()
    capped = [x for x in rows if x["finish"] == "length"]
    every = [r for x in rows for r in x["ranks"]]
    summary = {
        "responses": len(rows), "capped": len(capped),
        "divergences_per_response_mean": float(np.mean([len(x["divergences"]) for x in rows])),
        "divergences_per_capped_response": sorted(len(x["divergences"]) for x in capped),
        "tokens_per_divergence_free_run_capped": float(np.mean([x["length"] / (len(x["divergences"]) + 1) for x in capped]))
        if capped else None,
        "fraction_of_divergences_at_margin_rank_lt_4": float(np.mean([r < 4 for r in every])) if every else None,
        "first_divergence_margin_rank_lt_4": float(np.mean([x["ranks"][0] < 4 for x in rows if x["ranks"]]))
        if any(x["ranks"] for x in rows) else None,
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
