"""``megarl bench engine --model HF_DIR``: the engine's decode tokens/s on real weights (e.g.
SmolLM2-135M from ``megarl fetch smollm2``) next to ``transformers`` ``generate``.

For each dtype, response-length mode and batch size B, greedy (T=0), B requests of
``--prompt-len`` random prompt tokens, one process, the same torch thread count on both sides:
- ``equal`` lengths: every request decodes ``--new-tokens`` tokens.
- ``tailed`` lengths: request i decodes ``max(2, round(N * ((i + 1) / B) ** 3))`` tokens, a
  long tail as in RL rollouts (mean ~N/4, the longest N; batch 1: N). ``generate`` has no per-row stop here
  (no EOS), so it runs every row to the longest length: only each row's own tokens count.
- ``engine``: ``Engine.generate`` with speculation off; ``engine_spec``: with speculation on, K=4
  coupled bubble drafts pre-generated with the same weights (untimed bubble work, all accepted
  at T=0: the ceiling of speculation at K=4).
Decode tokens/s = sum over rows of (length - 1) / (time(lengths) - time(1 token)): the prefill and
the first token drop out. The systems run alternately (A/B/A/B, ``--repeats`` rounds) and the
fastest round of each counts, so a busy shared machine slows both sides alike. The greedy tokens
of the engine and of ``generate`` are compared row by row (``same_tokens``: rows identical).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.models.hf_io import load_hf_model, read_hf_config
from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM
from megarl.spec.config import SpecConfig
from megarl.spec.speculator import Speculator
from megarl.utils.fs import atomic_write_text

SPEC_K = 4
LENGTHS = ("tailed", "equal")


def response_lengths(mode: str, batch: int, new_tokens: int) -> list[int]:
    """Tokens each of ``batch`` requests decodes (``mode``: tailed or equal)."""
    if mode == "equal":
        return [new_tokens] * batch
    return [max(2, round(new_tokens * ((i + 1) / batch) ** 3)) for i in range(batch)]


def _prompts(vocab: int, batch: int, prompt_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()


def _requests(prompts, lengths) -> list[Request]:
    return [Request(uid=i, sample_idx=0, prompt_ids=p, params=SamplingParams(temperature=0.0, max_new_tokens=n))
            for i, (p, n) in enumerate(zip(prompts, lengths))]


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class _Systems:
    """The three decoders of one (dtype, batch) cell, each a ``run(lengths) -> (s, tokens)``."""

    def __init__(self, hf, model: CausalLM, dtype: str, batch: int, prompts, max_len: int):
        self.hf, self.prompts = hf, prompts
        cfg = EngineConfig(max_batch_size=batch, max_seq_len=max_len, dtype=dtype)
        self.engine = Engine(model, cfg, seed=0)  # the two engines share the (read-only) model
        spec = Speculator(SpecConfig(enabled=True, sources=("bubble",), k_init=SPEC_K, k_min=SPEC_K, k_max=SPEC_K,
                                     forward_cost_tokens=0, max_batch=1 << 30))
        self.spec = Engine(model, cfg, seed=0, spec=spec)
        self.ids = torch.tensor(prompts)
        self._step = 0

    def hf_run(self, lengths):
        n = max(lengths)
        with torch.inference_mode():
            dt, out = _timed(lambda: self.hf.generate(
                self.ids, attention_mask=torch.ones_like(self.ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0, eos_token_id=None))
        p = self.ids.shape[1]
        return dt, [out[i, p:p + k].tolist() for i, k in enumerate(lengths)]

    def engine_run(self, lengths):
        dt, res = _timed(lambda: self.engine.generate(_requests(self.prompts, lengths), step=0))
        return dt, [r.tokens for r in res]

    def spec_run(self, lengths):
        reqs = _requests(self.prompts, lengths)
        self._step += 1  # a fresh step: its drafts come from this pregenerate only
        self.spec.pregenerate(reqs, step=self._step)  # untimed bubble work
        dt, res = _timed(lambda: self.spec.generate(reqs, step=self._step))
        return dt, [r.tokens for r in res]


def _cell(sys_: _Systems, lengths: list[int], repeats: int) -> dict:
    """Alternate the systems (A/B/C, A/B/C, ...); the fastest round of each counts."""
    names = ("hf", "engine", "engine_spec")
    runs = {"hf": sys_.hf_run, "engine": sys_.engine_run, "engine_spec": sys_.spec_run}
    one = [1] * len(lengths)
    for name in names:  # warm-up: allocations, first-call paths
        runs[name]([2] * len(lengths))
    full = {n: [] for n in names}
    first = {n: [] for n in names}
    tokens = {}
    for _ in range(repeats):
        for name in names:
            first[name].append(runs[name](one)[0])
            dt, tokens[name] = runs[name](lengths)
            full[name].append(dt)
    decoded = sum(n - 1 for n in lengths)
    out = {f"{n}_tok_s": decoded / max(min(full[n]) - min(first[n]), 1e-9) for n in names}
    out["engine_over_hf"] = out["engine_tok_s"] / out["hf_tok_s"]
    out["spec_over_hf"] = out["engine_spec_tok_s"] / out["hf_tok_s"]
    same = [a == b for a, b in zip(tokens["engine"], tokens["hf"])]
    out["same_tokens"] = f"{sum(same)}/{len(same)}"
    out["spec_same_as_plain"] = tokens["engine_spec"] == tokens["engine"]
    out["mean_len"] = sum(lengths) / len(lengths)
    return out


def bench_engine_model(model_dir: str, batch_sizes: list[int], dtypes: list[str], lengths: list[str],
                       prompt_len: int, new_tokens: int, repeats: int, threads: int, json_path: str) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # the engine sets it anyway (process-wide): both sides run with it
    args = ModelArgs.from_hf_config(read_hf_config(model_dir))
    rows = []
    for dtype in dtypes:
        tdt = EngineConfig(dtype=dtype).torch_dtype
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdt, attn_implementation="sdpa").eval()
        model = load_hf_model(model_dir, tdt)  # the same file's weights as generate's
        for batch in batch_sizes:
            prompts = _prompts(args.vocab_size, batch, prompt_len)
            systems = _Systems(hf, model, dtype, batch, prompts, prompt_len + new_tokens + SPEC_K + 1)
            for mode in lengths:
                cell = _cell(systems, response_lengths(mode, batch, new_tokens), repeats)
                rows.append({"dtype": dtype, "lengths": mode, "batch": batch, **cell})
                print(format_row(rows[-1]), flush=True)
            del systems
        del hf, model
    report = {"model": model_dir, "threads": threads, "prompt_len": prompt_len, "new_tokens": new_tokens,
              "repeats": repeats, "rows": rows}
    atomic_write_text(json_path, json.dumps(report, indent=2) + "\n")
    return report


HEAD = (f"{'dtype':>8} {'lengths':>7} {'batch':>5} {'hf tok/s':>9} {'engine':>9} {'spec':>9} "
        f"{'eng/hf':>6} {'spec/hf':>7} {'same greedy rows':>16} {'spec=plain':>10}")


def format_row(r: dict) -> str:
    return (f"{r['dtype']:>8} {r['lengths']:>7} {r['batch']:>5} {r['hf_tok_s']:>9.1f} {r['engine_tok_s']:>9.1f} "
            f"{r['engine_spec_tok_s']:>9.1f} {r['engine_over_hf']:>6.2f} {r['spec_over_hf']:>7.2f} "
            f"{r['same_tokens']:>16} {str(r['spec_same_as_plain']):>10}")


def format_model_table(report: dict) -> str:
    lines = [f"model {report['model']}, {report['threads']} torch threads, prompt {report['prompt_len']} tokens, "
             f"up to {report['new_tokens']} new tokens, greedy; fastest of {report['repeats']} alternated rounds",
             HEAD]
    return "\n".join(lines + [format_row(r) for r in report["rows"]])


def run_cli(args) -> int:
    """``megarl bench engine --model``: flags checked (exit 2 naming each bad one), bench run, table printed."""
    sizes = [int(x) for x in args.batch_sizes.split(",")] if args.batch_sizes else [1, 8, 32, 64]
    prompt_len, new_tokens = args.prompt_len or 32, args.new_tokens or 48
    bad = [f"{k}={v} (valid: {ok})" for k, v, ok in [
        ("--batch-sizes", sizes, ">= 1 each"), ("--prompt-len", prompt_len, ">= 1"), ("--new-tokens", new_tokens, ">= 2"),
        ("--repeats", args.repeats, ">= 1"), ("--threads", args.threads, ">= 1")]
        if (min(v) if isinstance(v, list) else v) < (2 if k == "--new-tokens" else 1)]
    if not Path(args.model, "config.json").is_file():
        bad.append(f"--model={args.model} (valid: a HF folder with config.json and safetensors weights; "
                   "`megarl fetch smollm2` prints one)")
    if args.device not in (None, "cpu") or args.dtype == "float64":
        bad.append(f"--device={args.device} --dtype={args.dtype} (valid with --model: cpu; float32 or bfloat16)")
    if bad:
        print(f"megarl: error: bench engine: {'; '.join(bad)}", file=sys.stderr)
        return 2
    dtypes = [args.dtype] if args.dtype else ["float32", "bfloat16"]
    lengths = list(LENGTHS) if args.lengths == "both" else [args.lengths]
    report = bench_engine_model(args.model, sizes, dtypes, lengths, prompt_len, new_tokens, args.repeats,
                                args.threads, args.json)
    print(format_model_table(report))
    return 0
