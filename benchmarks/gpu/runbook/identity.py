"""The GPU runbook's ``identity`` part: token identity with speculation on vs off in the engine's
dtype (bf16 on a GPU), per draft source (bubble, history, group, prompt, the learned drafter, all
four sources together), over two RL steps with a weight update between them, on each KV cache;
as divergences per 10k tokens (a divergence is the first token where a response differs from the
reference; what follows it is not counted). Controls: the reference run repeated, and run with a
smaller batch (batch-shape rounding without speculation). A row per KV cache, step and variant
(:mod:`benchmarks.gpu.runbook.rows`), so a part cut at its limit keeps the comparisons it finished.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import torch

from benchmarks.gpu.runbook.parts import SHAPES, _sync
from benchmarks.gpu.runbook.rows import Rows


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


def identity_settings(shapes: dict, dry_run: bool) -> IdentitySettings:
    """The runbook's ``identity`` shapes (:class:`~benchmarks.gpu.runbook.profiles.IdentityShapes`); on a
    CPU dry run the tiny model in fp32."""
    s = IdentitySettings(**{**shapes, "kv_caches": tuple(shapes.get("kv_caches", ("slots", "paged")))})
    return dataclasses.replace(s, shape="tiny", device="cpu", dtype="float32") if dry_run else s


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


def identity_part(s: IdentitySettings, rows: Rows) -> dict:
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
            rows.add(f"{kv} step {step} reference", kv=kv, step=step, variant="reference",
                     tokens=sum(map(len, ref_tokens)), seconds=ref_s)
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
                rows.add(f"{kv} step {step} {v}", kv=kv, step=step, variant=v, **res[v]["steps"][step])
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.runbook.identity", description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["identity"])
    p.add_argument("--rows", required=True, help="the part's JSONL file (rows as they finish, then the result)")
    p.add_argument("--shapes", default="{}", help="the runbook's identity shapes, as JSON")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    p.add_argument("--work-dir", help="scratch folder (unused: the runbook passes it to every part)")
    a = p.parse_args(argv)
    rows = Rows(a.rows)
    figures = identity_part(identity_settings(json.loads(a.shapes), a.dry_run), rows)
    rows.result({**figures, "dry_run": a.dry_run})
    return 0


if __name__ == "__main__":
    sys.exit(main())
