"""Speculative decoding on the vLLM rollout backend (megarl/engine/vllm_spec.py): accepted tokens per
verify and rollout speed against the same backend without drafts, alternated A/B in one process.

    .venv/bin/python benchmarks/bench_vllm_spec.py --method sources --temperature 0
    .venv/bin/python benchmarks/bench_vllm_spec.py --method ngram --temperature 0

Each round generates one GRPO-shaped rollout (--prompts prompts x --group samples, SmolLM2 chat
prompts of reasoning-gym-like arithmetic) on both engines in turn, as successive RL steps (so the
``history`` source drafts from the previous round's responses, as it would from the last epoch).
Printed per round and engine: seconds, tokens, forwards per request summed (``n_forwards``),
tokens per forward (1.0 without drafts: the mean accepted length of a verify, the target's own
token included), and at T = 0 whether the responses equal the draft-free engine's.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from megarl.engine import EngineConfig, Request, SamplingParams
from megarl.engine.vllm_backend import VLLMEngine
from megarl.engine.vllm_spec import VLLMSpecConfig
from megarl.models.hf_io import load_hf_model
from megarl.rl.tokenizer import HFTokenizer
from megarl.spec.config import SpecConfig
from megarl.spec.speculator import Speculator

QUESTIONS = [f"What is {a} + {b}? Answer with the number only, after a short explanation."
             for a, b in ((17, 25), (103, 48), (9, 66), (250, 311), (42, 58), (7, 8), (120, 95), (33, 19))]


def _engine(model, max_batch: int, method: str, k: int) -> VLLMEngine:
    spec = vspec = None
    if method == "sources":
        spec = Speculator(SpecConfig(enabled=True, sources=("history", "group", "prompt"), k_max=k))
    elif method != "none":
        vspec = VLLMSpecConfig(method=method, num_tokens=k)
    engine = VLLMEngine(model.args, EngineConfig(max_batch_size=max_batch, max_seq_len=512), seed=1,
                        temperature=1.0, spec=spec, vllm_spec=vspec)
    engine.model.load_state_dict(model.state_dict())
    engine.push_weights()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/megarl/models/smollm2"))
    ap.add_argument("--method", choices=("ngram", "suffix", "sources"), required=True)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 only for now: the backend refuses drafts at T > 0 (docs/rollout_backends.md)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="most draft tokens per request and step")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model = load_hf_model(a.model, torch.float32)
    tok = HFTokenizer(a.model)
    prompts = [tok.encode_prompt(q) for q in QUESTIONS[:a.prompts]]
    batch = a.prompts * a.group
    engines = {"none": _engine(model, batch, "none", a.k), a.method: _engine(model, batch, a.method, a.k)}
    params = SamplingParams(temperature=a.temperature, max_new_tokens=a.new_tokens, stop_token_ids=tok.stop_ids)
    reqs = [Request(u, i, p, params) for u, p in enumerate(prompts) for i in range(a.group)]
    print(f"# {a.method} vs none, T={a.temperature}, {a.prompts}x{a.group} requests, <= {a.new_tokens} tokens, "
          f"k={a.k}, fp32, threads={torch.get_num_threads()} (machine shared: ratios only)")
    totals = {name: [0.0, 0, 0] for name in engines}
    for rnd in range(a.rounds):
        outs = {}
        for name, engine in engines.items():  # alternated: none, method, none, method, ...
            t0 = time.perf_counter()
            outs[name] = out = engine.generate(reqs, step=rnd)
            dt = time.perf_counter() - t0
            n_tok, n_fwd = sum(len(r.tokens) for r in out), sum(r.n_forwards for r in out)
            tot = totals[name]
            tot[0], tot[1], tot[2] = tot[0] + dt, tot[1] + n_tok, tot[2] + n_fwd
            print(f"round {rnd} {name:8s} {dt:7.2f} s  tokens {n_tok:5d}  forwards {n_fwd:5d}  "
                  f"tokens/forward {n_tok / n_fwd:.3f}  tok/s {n_tok / dt:.1f}", flush=True)
        if a.temperature == 0:
            same = sum(x.tokens == y.tokens for x, y in zip(outs["none"], outs[a.method]))
            print(f"round {rnd} identical responses: {same}/{len(reqs)}")
    (t_a, n_a, _), (t_b, n_b, f_b) = totals["none"], totals[a.method]
    print(f"# totals: none {n_a / t_a:.1f} tok/s, {a.method} {n_b / t_b:.1f} tok/s, speed ratio "
          f"{(n_b / t_b) / (n_a / t_a):.3f}, {a.method} tokens/forward {n_b / f_b:.3f}")
    if a.method == "sources":
        m = engines["sources"].spec.metrics()
        print("# sources: " + ", ".join(f"{k}={v:.3g}" for k, v in sorted(m.items())
                                         if k.count("/") == 2 and k.split("/")[2] in ("drafted", "accepted",
                                                                                     "accept_len_mean")))


if __name__ == "__main__":
    main()
