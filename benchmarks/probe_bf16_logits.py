"""Where do speculative and plain decoding see different logits? A diagnostic for bf16 identity
(docs/benchmarks.md, "Token identity in bf16").

Generates one batch of a config's requests three times on one engine: bubble drafts from the
weights plus ``--noise`` relative noise (so drafts are partly accepted and verify rows of every
length occur), plain decoding, and speculative decoding. It records the logits of every (request,
position) in both runs, from the forward whose context was the accepted tokens (a row after a
rejected draft saw another context and is skipped), and prints how many positions differ, with
the draft length and the batch size of the speculative forward that computed each. 2026-11-25,
SmolLM2 bf16: 5 of 3,897 positions before the single-row twin (one request decoding alone), 0 after.

    PYTHONPATH=. .venv/bin/python benchmarks/probe_bf16_logits.py --config configs/smollm2.yaml
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from megarl.config import load_config
from megarl.engine import Engine
from megarl.models.hf_io import load_hf_model
from megarl.sched.prompts import prompt_uids_for_step
from megarl.setup_run import prepare_inputs
from megarl.spec.speculator import Speculator
from megarl.rollout.stage import RolloutStage


class RecordingEngine(Engine):
    """An engine that keeps the logits of every validly-conditioned verified row in ``seen``:
    (tag, uid, sample_idx, position) -> (logits, draft length, rows in the batch)."""

    tag = ""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen: dict = {}

    def run(self, batch, step):
        got, orig = [], self.model.logits
        self.model.logits = lambda h: (lambda out: (got.append(out.float().clone()), out)[1])(orig(h))
        try:
            res = super().run(batch, step)
        finally:
            del self.model.logits
        r = 0
        for b, (s, d) in enumerate(zip(batch.seqs, batch.drafts)):
            for j in range(len(d) + 1):
                if j <= res.n_accept[b]:
                    self.seen.setdefault((self.tag, s.req.uid, s.req.sample_idx, len(s.tokens) + j),
                                         (got[0][r], len(d), len(batch.seqs)))
                r += 1
        return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--noise", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [f"rollout.dtype={args.dtype}", *args.set])
    inputs = prepare_inputs(cfg)
    model = load_hf_model(inputs.init_from_hf, getattr(torch, args.dtype))
    spec = Speculator(dataclasses.replace(cfg.spec, enabled=True, sources=("bubble",), forward_cost_tokens=0.0,
                                          k_init=4, k_min=4, k_max=4))
    eng = RecordingEngine(model, cfg.rollout.engine_config(inputs.max_seq_len), seed=cfg.seed, spec=spec)
    stage = RolloutStage(eng, inputs, cfg.rollout, cfg.reward)
    reqs = stage.requests(prompt_uids_for_step(0, cfg.rollout.prompts_per_step, cfg.seed, len(inputs.problems)))
    exact = {k: v.clone() for k, v in eng.model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    eng.load_weights({k: v + args.noise * v.abs() * torch.randn(v.shape, generator=g).to(v.dtype)
                      for k, v in exact.items()})
    eng.tag = "drafts"
    eng.pregenerate(reqs, 0)
    eng.load_weights(exact)
    eng.spec, eng.tag = None, "plain"
    ref = eng.generate(reqs, 0)
    eng.spec, eng.tag = spec, "spec"
    out = eng.generate(reqs, 0)
    print("same tokens:", [a.tokens for a in ref] == [b.tokens for b in out])
    diff = []
    for key, (logits, _, _) in eng.seen.items():
        if key[0] == "plain" and ("spec", *key[1:]) in eng.seen:
            other, n_draft, rows = eng.seen[("spec", *key[1:])]
            d = (logits - other).abs().max().item()
            if d > 0:
                diff.append({"uid": key[1], "sample_idx": key[2], "position": key[3], "max_abs_diff": d,
                             "spec_draft_len": n_draft, "spec_batch_rows": rows})
    n = sum(1 for k in eng.seen if k[0] == "plain" and ("spec", *k[1:]) in eng.seen)
    print(f"positions compared {n}, logits differ at {len(diff)}")
    for x in diff[:20]:
        print(x)


if __name__ == "__main__":
    main()
