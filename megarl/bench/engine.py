"""``megarl bench engine``: decode throughput of the native rollout engine.

For a Qwen2.5-1.5B-shaped model with random weights (``--model-size 1.5b``; ``tiny`` is a small
model of the same family for CPU runs), at each batch size B:
- ``engine``: decode tokens/s of ``Engine.generate`` with speculation off, per KV cache
  (``--kv-cache``), B requests of ``--prompt-len`` random prompt tokens sampling
  ``--new-tokens`` tokens each (greedy, as ``generate`` below, no stop token). Decode time =
  time(N tokens) - time(1 token): the prefill and the first token drop out. (Until 2026-11-25
  the engine sampled at T=1 here against a greedy ``generate``: on random weights the logits are
  flat, so the exact sampler hashed most of the vocabulary of every row, a cost ``generate``'s
  argmax does not have: tiny model 0.74x / 0.58x / 0.55x of ``generate`` at batch 1 / 16 / 64.)
- ``engine_spec``: the same with speculation on, K=4 drafts per row from coupled bubble drafts
  pre-generated with the same weights (``Engine.pregenerate``, untimed: bubble work), so every
  draft is accepted: the ceiling of speculation at K=4 (RL's next-step drafts come close to it;
  docs/design.md §1).
- ``hf``: ``transformers`` ``generate`` (greedy, KV cache, same weights, same shapes).
- ``bound``: the memory-bandwidth bound, B / (bytes read per step / ``--hbm-gbps``), bytes =
  weights + the KV cache of B requests at the mean context. Meaningful on a GPU only (the default
  3350 GB/s is an H100 SXM's HBM3; a CPU's memory is far slower and its decode compute-bound).
Also the cost of a speculative verify step (K=4 drafts per row, batch 16) relative to a plain
decode step at the same context (``verify_k4_b16``: ``Engine.run`` timed directly).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections import deque

import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.engine.engine import _Batch, _Seq
from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM
from megarl.spec.config import SpecConfig
from megarl.spec.speculator import Speculator
from megarl.utils.fs import atomic_write_text

MODEL_SIZES = {
    # Qwen2.5-1.5B (HF Qwen/Qwen2.5-1.5B config.json)
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6, max_position_embeddings=32768,
                 tie_word_embeddings=True, rms_norm_eps=1e-6),
    # the same family shrunk for CPU runs (GQA 3:1, head_dim 64)
    "tiny": dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                 num_attention_heads=6, num_key_value_heads=2, rope_theta=1e6, max_position_embeddings=4096,
                 tie_word_embeddings=True, rms_norm_eps=1e-6),
}
KV_CACHES = ("slots", "paged")
SPEC_K = 4


@dataclasses.dataclass
class BenchShape:
    model_size: str
    batch_sizes: list[int]
    prompt_len: int
    new_tokens: int
    dtype: str
    device: str
    kv_caches: list[str]
    hbm_gbps: float
    repeats: int


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _requests(args: ModelArgs, batch: int, prompt_len: int, new_tokens: int, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, args.vocab_size, (batch, prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, stop_token_ids=())
    return [Request(uid=i, sample_idx=0, prompt_ids=p, params=params) for i, p in enumerate(prompts)]


def _engine(model: CausalLM, sd, shape: BenchShape, kv_cache: str, batch: int, spec: bool) -> Engine:
    cfg = EngineConfig(max_batch_size=batch, max_seq_len=shape.prompt_len + shape.new_tokens + SPEC_K + 1,
                       dtype=shape.dtype, device=shape.device, kv_cache=kv_cache)
    spec_obj = Speculator(SpecConfig(enabled=True, sources=("bubble",), k_init=SPEC_K, k_min=SPEC_K, k_max=SPEC_K,
                                     forward_cost_tokens=0, max_batch=1 << 30)) if spec else None
    eng = Engine(model, cfg, seed=0, spec=spec_obj)
    eng.load_weights(sd)
    return eng


def _decode_rate(gen, batch: int, shape: BenchShape) -> tuple[float, float]:
    """Decode tokens/s: (N - 1) tokens per request in time(N) - time(1), fastest of the repeats;
    and time(1) (prefill + first token)."""
    t1 = min(_timed(lambda: gen(1), shape.device) for _ in range(shape.repeats))
    tn = min(_timed(lambda: gen(shape.new_tokens), shape.device) for _ in range(shape.repeats))
    return batch * (shape.new_tokens - 1) / max(tn - t1, 1e-9), t1


def _bench_engine(model, sd, shape: BenchShape, kv_cache: str, batch: int) -> dict:
    eng = _engine(model, sd, shape, kv_cache, batch, spec=False)
    args = model.args

    def gen(n):
        eng.generate(_requests(args, batch, shape.prompt_len, n), step=0)

    gen(2)  # warm-up (allocations, kernel compiles)
    plain, t1 = _decode_rate(gen, batch, shape)
    spec_eng = _engine(model, sd, shape, kv_cache, batch, spec=True)
    reqs = _requests(args, batch, shape.prompt_len, shape.new_tokens)
    times, accept = [], 0.0
    for rep in range(shape.repeats + 1):  # the first pass warms up the verify shapes
        spec_eng.pregenerate(reqs, step=rep)  # coupled drafts of this step, same weights: all accepted
        spec_eng.reset_stats()
        dt = _timed(lambda: spec_eng.generate(reqs, step=rep), shape.device)
        if rep:
            times.append(dt)
            accept = spec_eng.spec.metrics()["spec/accept_len_mean"]
    spec_rate = batch * (shape.new_tokens - 1) / max(min(times) - t1, 1e-9)
    return {"engine_tok_s": plain, "engine_spec_tok_s": spec_rate, "spec_accept_len": accept}


def _bench_hf(hf, args: ModelArgs, shape: BenchShape, batch: int) -> float:
    ids = torch.tensor([r.prompt_ids for r in _requests(args, batch, shape.prompt_len, 1)],
                       device=shape.device)
    mask = torch.ones_like(ids)

    def gen(n):
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=0, eos_token_id=None)

    gen(2)
    return _decode_rate(gen, batch, shape)[0]


def _verify_cost(model, sd, shape: BenchShape, kv_cache: str, batch: int = 16, iters: int = 5) -> dict:
    """One engine step over ``batch`` rows at context prompt_len: plain decode (1 token per row)
    vs verify (1 + K tokens per row), forward + sampling/verify, median of ``iters``."""
    eng = _engine(model, sd, shape, kv_cache, batch, spec=False)
    reqs = _requests(model.args, batch, shape.prompt_len, shape.new_tokens)
    running: list[_Seq] = []
    table = eng.cache.table
    out = {}
    with torch.inference_mode():
        eng.admit(deque(_Seq(i, r) for i, r in enumerate(reqs)), running)
        g = torch.Generator().manual_seed(1)
        for name, k in (("decode", 0), ("verify", SPEC_K)):
            drafts = [torch.randint(0, model.args.vocab_size, (k,), generator=g).tolist() for _ in running]
            batch_ = _Batch(running, [[s.req.prompt_ids[-1]] for s in running], drafts)
            ts = []
            for i in range(iters + 1):
                ts.append(_timed(lambda: eng.run(batch_, step=0), shape.device))
                for s in running:  # back to the prompt: every iteration sees the same context
                    table.truncate(s.slot, table.lengths[s.slot] - 1 - k)
            out[f"{name}_step_ms"] = 1e3 * statistics.median(ts[1:])
    out["verify_over_decode"] = out["verify_step_ms"] / out["decode_step_ms"]
    return out


def _bound(model: CausalLM, shape: BenchShape, batch: int, elsize: int) -> dict:
    a = model.args
    weights = sum(p.numel() for p in model.parameters()) * elsize  # parameters() counts tied ones once
    ctx = shape.prompt_len + shape.new_tokens / 2  # mean context over the decode
    kv = batch * ctx * a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * elsize
    step_s = (weights + kv) / (shape.hbm_gbps * 1e9)
    return {"bytes_per_step": weights + kv, "bound_tok_s": batch / step_s}


def bench_engine(shape: BenchShape, json_path: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape.model_size not in MODEL_SIZES:
        raise ValueError(f"--model-size={shape.model_size!r} is invalid; valid choices: {', '.join(MODEL_SIZES)}")
    args = ModelArgs(**MODEL_SIZES[shape.model_size], model_type="qwen2")
    torch_dtype = EngineConfig(dtype=shape.dtype).torch_dtype
    hf_cfg = args.to_hf_config()
    hf_cfg.pop("architectures"), hf_cfg.pop("torch_dtype")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_cfg), dtype=torch_dtype,
                                          attn_implementation="sdpa").to(shape.device).eval()
    sd = {k: v.detach() for k, v in hf.state_dict().items()}  # the engines load the HF model's weights
    model = CausalLM(args)
    elsize = torch.finfo(torch_dtype).bits // 8
    rows = []
    for batch in shape.batch_sizes:
        row = {"batch": batch, "hf_tok_s": _bench_hf(hf, args, shape, batch), **_bound(model, shape, batch, elsize)}
        for kv in shape.kv_caches:
            row[kv] = _bench_engine(model, sd, shape, kv, batch)
            row[kv]["speedup_vs_hf"] = row[kv]["engine_tok_s"] / row["hf_tok_s"]
            row[kv]["frac_of_bound"] = row[kv]["engine_tok_s"] / row["bound_tok_s"]
        rows.append(row)
    verify = {kv: _verify_cost(model, sd, shape, kv) for kv in shape.kv_caches}
    device_name = torch.cuda.get_device_name() if shape.device.startswith("cuda") else "cpu"
    report = {
        "device": device_name, "shape": dataclasses.asdict(shape), "model": MODEL_SIZES[shape.model_size],
        "weights_bytes": sum(p.numel() for p in model.parameters()) * elsize, "rows": rows,
        "verify_k4_b16": verify,
        "note": (f"bound_tok_s assumes {shape.hbm_gbps} GB/s of memory bandwidth (--hbm-gbps; default: H100 SXM "
                 "HBM3) and is only meaningful on that GPU; on a CPU decode is compute-bound"),
    }
    atomic_write_text(json_path, json.dumps(report, indent=2) + "\n")
    return report


def format_table(report: dict) -> str:
    kvs = report["shape"]["kv_caches"]
    head = f"{'batch':>5} {'hf tok/s':>10} {'bound tok/s':>12}"
    for kv in kvs:
        head += f" | {kv + ' tok/s':>12} {'spec tok/s':>10} {'x hf':>6} {'of bound':>8}"
    lines = [f"device {report['device']}, model {report['shape']['model_size']}, dtype {report['shape']['dtype']}",
             head]
    for r in report["rows"]:
        line = f"{r['batch']:>5} {r['hf_tok_s']:>10.1f} {r['bound_tok_s']:>12.0f}"
        for kv in kvs:
            e = r[kv]
            line += (f" | {e['engine_tok_s']:>12.1f} {e['engine_spec_tok_s']:>10.1f} {e['speedup_vs_hf']:>6.2f}"
                     f" {e['frac_of_bound']:>8.1%}")
        lines.append(line)
    for kv, v in report["verify_k4_b16"].items():
        lines.append(f"verify K={SPEC_K} at batch 16 ({kv}): {v['verify_step_ms']:.2f} ms vs decode "
                     f"{v['decode_step_ms']:.2f} ms = {v['verify_over_decode']:.2f}x")
    lines.append(report["note"])
    return "\n".join(lines)


def shape_from_args(a) -> BenchShape:
    tiny = a.model_size == "tiny"
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    batch_sizes = [int(x) for x in a.batch_sizes.split(",")] if a.batch_sizes else (
        [1, 16, 64] if tiny else [1, 16, 64, 256])
    shape = BenchShape(
        model_size=a.model_size, batch_sizes=batch_sizes,
        prompt_len=a.prompt_len or (32 if tiny else 128), new_tokens=a.new_tokens or (32 if tiny else 128),
        dtype=a.dtype or ("bfloat16" if device.startswith("cuda") else "float32"), device=device,
        kv_caches=list(KV_CACHES) if a.kv_cache == "both" else [a.kv_cache], hbm_gbps=a.hbm_gbps,
        repeats=a.repeats)
    if min(shape.batch_sizes) < 1 or shape.prompt_len < 1 or shape.new_tokens < 2 or shape.repeats < 1:
        raise ValueError(f"bench engine: --batch-sizes={shape.batch_sizes} (valid: >= 1 each), --prompt-len="
                         f"{shape.prompt_len} (>= 1), --new-tokens={shape.new_tokens} (>= 2), --repeats="
                         f"{shape.repeats} (>= 1)")
    try:
        EngineConfig(dtype=shape.dtype, device=shape.device)
    except ValueError as e:
        raise ValueError(f"bench engine --dtype/--device: {e}") from None
    if shape.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device={shape.device} but no CUDA device is visible; valid here: cpu")
    if shape.hbm_gbps <= 0:
        raise ValueError(f"--hbm-gbps={shape.hbm_gbps} is invalid; valid range: > 0")
    return shape
