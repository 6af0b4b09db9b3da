"""megarl's engine against vLLM-CPU: decode tokens/s on a real model, both in one process, alternated.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_engine_vllm.py --model ~/.cache/megarl/models/smollm2 \
        [--batch-sizes 1,8,32,64] [--dtypes float32,bfloat16] [--temperatures 0,1] [--rounds 3] \
        [--new-tokens 64] [--threads 2] [--sides megarl,vllm] [--profile]

Each cell (dtype, temperature, batch B): B chat prompts (distinct questions, the model's chat
template; ~35 tokens each), ``--new-tokens`` tokens each, no stop token (EOS ignored). A round
runs each side twice, for 1 token and for N, and decode tokens/s is B * (N - 1) / (t(N) - t(1)):
prefill and first token drop out. The sides alternate within a round, and the order flips every
round (A B, B A, A B, ...), so a steady drift of a shared machine hits both alike; the printed
figures are medians over rounds (tok/s of each side, and the median of the per-round ratios).
CPU time is the process's (all threads) over the same decode tokens, in ms per token.

- megarl: ``Engine.generate`` (slot KV cache, packed linears: the defaults), logprob and entropy of
  every token.
- vLLM: an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager, threads not bound,
  prefix caching off), ``logprobs=0`` (the sampled token's logprob, raw logprobs), one seed per
  request. Torch's thread count is set before vLLM starts (its CPU worker turns
  ``torch.set_num_threads`` into a no-op afterwards), so both run on the same ``--threads``.

Greedy tokens of the two are compared row by row (``same``). The allocator, OpenMP runtime and
OpenMP wait policy are the process's, shared by both sides: set them in the environment that starts
this script (``OMP_WAIT_POLICY=PASSIVE`` as ``megarl`` sets it; ``LD_PRELOAD`` of tcmalloc and Intel
OpenMP as vLLM's CPU guide recommends; ``benchmarks/bench_launch_env.py`` compares such settings).

``--profile``: instead of timing, one torch-profiler pass per side over a decode run at each batch
size (time per operator per decode token, the top entries), for docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

QUESTIONS = [
    "What is {a} plus {b}?", "Is {a} a prime number?", "Name a country whose capital starts with the letter {c}.",
    "How many legs do {a} spiders have in total?", "Write the number {a} in words.",
    "What is {a} times {b}?", "Sort these numbers: {a}, {b}, {d}.", "Which is larger, {a} or {b}?",
]


def chat_prompts(model_dir: str, n: int) -> list[list[int]]:
    """``n`` distinct chat prompts, token ids of the model's chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)].format(a=17 + 7 * i, b=3 + 5 * i, c="ABCDEFGHIKLMNPRST"[i % 17], d=i)
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


class MegarlSide:
    name = "megarl"

    def __init__(self, model_dir: str, dtype: str, max_batch: int, max_len: int):
        from megarl.engine import Engine, EngineConfig
        from megarl.models.hf_io import load_hf_model

        cfg = EngineConfig(max_batch_size=max_batch, max_seq_len=max_len, dtype=dtype)
        self.engine = Engine(load_hf_model(model_dir, cfg.torch_dtype), cfg, seed=0)

    def run(self, prompts, n: int, temperature: float) -> list[list[int]]:
        from megarl.engine import Request, SamplingParams

        p = SamplingParams(temperature=temperature, max_new_tokens=n, stop_token_ids=())
        reqs = [Request(uid=i, sample_idx=0, prompt_ids=x, params=p) for i, x in enumerate(prompts)]
        return [r.tokens for r in self.engine.generate(reqs, step=0)]


class VllmSide:
    name = "vllm"

    def __init__(self, model_dir: str, dtype: str, max_batch: int, max_len: int):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        self.llm = LLM(model=model_dir, dtype=dtype, max_model_len=max_len, max_num_seqs=max_batch, seed=0,
                       enforce_eager=True, enable_prefix_caching=False, disable_log_stats=True,
                       skip_tokenizer_init=True)

    def run(self, prompts, n: int, temperature: float) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sps = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, logprobs=0, detokenize=False,
                              seed=1000 + i) for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], sps, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w0, time.process_time() - c0, out


def cell(sides, prompts, n: int, temperature: float, rounds: int) -> dict:
    """Alternated rounds over the sides (order flipped each round); medians."""
    b = len(prompts)
    for s in sides:  # warm-up: allocations, first-call paths, the shapes of this batch
        s.run(prompts, 2, temperature)
    rates = {s.name: [] for s in sides}
    cpu = {s.name: [] for s in sides}
    tokens = {}
    for r in range(rounds):
        for s in (sides if r % 2 == 0 else sides[::-1]):
            w1, c1, _ = timed(lambda: s.run(prompts, 1, temperature))
            wn, cn, tokens[s.name] = timed(lambda: s.run(prompts, n, temperature))
            decoded = b * (n - 1)
            rates[s.name].append(decoded / max(wn - w1, 1e-9))
            cpu[s.name].append(1e3 * (cn - c1) / decoded)
    out = {f"{k}_tok_s": statistics.median(v) for k, v in rates.items()}
    out.update({f"{k}_cpu_ms_tok": statistics.median(v) for k, v in cpu.items()})
    if len(sides) == 2:
        a, c = sides[0].name, sides[1].name
        out[f"{a}_over_{c}"] = statistics.median(x / y for x, y in zip(rates[a], rates[c]))
        out["same"] = f"{sum(x == y for x, y in zip(tokens[a], tokens[c]))}/{b}"
    return out


def profile(sides, prompts, n: int, temperature: float, top: int) -> None:
    """One torch-profiler pass per side over a decode run: self CPU time per operator per token."""
    from torch.profiler import ProfilerActivity, profile as tprof

    for s in sides:
        s.run(prompts, 2, temperature)
        with tprof(activities=[ProfilerActivity.CPU]) as prof:
            w, c, _ = timed(lambda: s.run(prompts, n, temperature))
        per_tok = 1e3 / (len(prompts) * n)
        print(f"--- {s.name}: batch {len(prompts)}, T={temperature}, {n} tokens: {w * per_tok * 1e3:.3f} ms wall, "
              f"{c * per_tok * 1e3:.3f} ms CPU per token (profiled)")
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
        for e in rows:
            print(f"  {e.key[:60]:<60} {e.self_cpu_time_total * per_tok / 1e3:8.3f} ms/tok  {e.count:7d} calls")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--sides", default="megarl,vllm")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    batches = [int(x) for x in a.batch_sizes.split(",")]
    names = a.sides.split(",")
    bad = [x for x in names if x not in ("megarl", "vllm")]
    if bad or a.new_tokens < 2 or a.rounds < 1 or min(batches) < 1:
        print(f"bench_engine_vllm: error: --sides {bad} (valid: megarl, vllm), --new-tokens >= 2, --rounds >= 1, "
              f"--batch-sizes >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)  # before vLLM starts: it disables set_num_threads afterwards
    print(f"preloaded: {os.environ.get('LD_PRELOAD', '(none)')}; torch threads {torch.get_num_threads()}", flush=True)
    prompts_all = chat_prompts(a.model, max(batches))
    max_len = max(map(len, prompts_all)) + a.new_tokens + 8
    rows = []
    for dtype in a.dtypes.split(","):
        kinds = {"megarl": MegarlSide, "vllm": VllmSide}
        sides = [kinds[x](a.model, dtype, max(batches), max_len) for x in names]
        for temp in [float(x) for x in a.temperatures.split(",")]:
            for b in batches:
                if a.profile:
                    profile(sides, prompts_all[:b], a.new_tokens, temp, a.top)
                    continue
                row = {"dtype": dtype, "T": temp, "batch": b, **cell(sides, prompts_all[:b], a.new_tokens, temp, a.rounds)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del sides
    if a.json and rows:
        from megarl.utils.fs import atomic_write_text
        atomic_write_text(a.json, json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
