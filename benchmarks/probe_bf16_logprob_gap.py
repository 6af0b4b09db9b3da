"""How far the bf16 engine and the bf16 trainer each are from the exact logprobs, on one HF
folder (docs/benchmarks.md, "The trainer at real size"): the on-policy check ``logprob_diff_max``
of a bf16 run is the gap between two independently rounded bf16 computations.

Samples ``--requests`` responses with the bf16 engine (T=1) from random prompts, then scores them
with megarl's CausalLM in fp64 (the exact value), the bf16 trainer with each ``trainer.attention``
of ``--attention`` and the fp32 trainer; prints the max and mean absolute difference of each to
the exact value and of the engine to each trainer, and the share of tokens where the engine and
a trainer agree bit for bit.

    PYTHONPATH=. .venv/bin/python benchmarks/probe_bf16_logprob_gap.py RUN_DIR/hf
"""
from __future__ import annotations

import argparse

import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.models.hf_io import load_hf_model, load_hf_state_dict
from megarl.parallel.dist import init_parallel, teardown
from megarl.trainer.trainer import Trainer, TrainerConfig


def sample(path: str, n: int, new_tokens: int, vocab: int):
    """Token ids [n, T], the response mask [n, T-1] and the engine's logprobs there."""
    eng = Engine(load_hf_model(path), EngineConfig(max_batch_size=n, max_seq_len=16 + new_tokens, dtype="bfloat16"),
                 seed=0)
    prompts = [torch.randint(3, vocab, (6,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(n)]
    reqs = [Request(uid=i, sample_idx=0, prompt_ids=p, params=SamplingParams(temperature=1.0, max_new_tokens=new_tokens))
            for i, p in enumerate(prompts)]
    outs = eng.generate(reqs, step=0)
    width = max(len(p) + len(o.tokens) for p, o in zip(prompts, outs))
    ids, mask = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width - 1)
    lp = torch.zeros(n, width - 1, dtype=torch.float64)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        seq = p + list(o.tokens)
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, len(p) - 1:len(seq) - 1] = 1
        lp[i, len(p) - 1:len(seq) - 1] = torch.tensor(o.logprobs, dtype=torch.float64)
    return ids, mask, lp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hf_dir")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--attention", default="sdpa,eager", help="bf16 trainer attentions to score with, comma-separated")
    a = ap.parse_args()
    dims = init_parallel()
    exact_model = load_hf_model(a.hf_dir, torch.float64)
    ids, mask, engine_lp = sample(a.hf_dir, a.requests, a.new_tokens, exact_model.args.vocab_size)
    with torch.no_grad():
        exact = torch.log_softmax(exact_model(ids), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    hf = load_hf_state_dict(a.hf_dir)
    scored = {"engine bf16": engine_lp}
    runs = [("bfloat16", att) for att in a.attention.split(",")] + [("float32", "sdpa")]
    for dtype, att in runs:
        tr = Trainer(exact_model.args, TrainerConfig(dtype=dtype, micro_batch_size=8, attention=att), dims,
                     hf_state={k: v.to(getattr(torch, dtype)) for k, v in hf.items()})
        scored[f"trainer {dtype} {att}"] = tr.masked_logprobs(ids, mask).double()
    m = mask.bool()
    print(f"{int(m.sum())} response tokens; weights {next(iter(hf.values())).dtype}")
    pairs = [(k, "exact", v, exact) for k, v in scored.items()]
    pairs += [("engine bf16", k, scored["engine bf16"], v) for k, v in scored.items() if k.startswith("trainer")]
    for x, y, u, v in pairs:
        d = (u - v)[m].abs()
        print(f"{x} vs {y}: max {d.max():.4f}, mean {d.mean():.5f}, equal {float((d == 0).float().mean()):.1%}")
    teardown(dims)


if __name__ == "__main__":
    main()
