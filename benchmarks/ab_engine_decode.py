"""A/B of the engine's decode step before and after the plain-decoding changes (RoPE once over q
and k with the rotation's sign folded into sin, and no verify when no row has a draft), in one
process, alternated: the earlier code is restored by swapping it in (``_before``) around the A runs.

    PYTHONPATH=. .venv/bin/python benchmarks/ab_engine_decode.py --model ~/.cache/megarl/models/smollm2 \
        [--cells float32:1:0,float32:64:0,bfloat16:1:0,bfloat16:64:0,float32:64:1] [--rounds 4] [--new-tokens 32]

Each cell (dtype:batch:temperature) times ``Engine.generate`` of 1 and of N tokens per request for
A (before) and B (after), order flipped every round; decode time per token = (t(N) - t(1)) / (B (N - 1)),
wall and process CPU time. Prints medians and the median of the per-round ratios A / B (> 1: B is
faster), and whether A and B gave the same tokens and logprobs (they must: the changes are exact).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import time

import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.engine.runner import ModelRunner
from megarl.engine.scheduler import Batch as _Batch, Verified as _Verified
from megarl.engine.sampler import token_stats
from megarl.engine.sampling_rows import SamplingRows
from megarl.engine.verify import verify
from megarl.models import llama
from megarl.models.hf_io import load_hf_model
from megarl.models.llama import inv_freq_and_scale

# ---- the code before the change (megarl/models/llama.py, megarl/engine/engine.py), verbatim but for
# the names it reads on the engine, which now live on its runner (megarl/engine/runner.py), and the
# sampling set-up verify takes (a SamplingRows, megarl/engine/sampling_rows.py)
def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: dict | None = None):
    """cos/sin of shape [B, T, 1, D] for the rotate-half RoPE convention used by HF Llama/Qwen2;
    ``scaling``: a llama3/yarn ``ModelArgs.rope_scaling`` (megarl/models/rope.py), None for plain RoPE."""
    calc = torch.promote_types(dtype, torch.float32)
    inv_freq, scale = inv_freq_and_scale(head_dim, theta, scaling, calc, positions.device)
    freqs = positions.to(calc)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)



def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin



def _attention_forward_before(self, x, cos, sin, attn):
    b, t, _ = x.shape
    q, k, v = self.project(x)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = attn(self.layer_idx, q, k, v)
    return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))


def run(self, batch: _Batch, step: int) -> _Verified:
    """Device work for one batch: one forward over every row's pending + draft tokens through
    the cache, then the target's own sample at the last pending position and at every draft
    position, compared with the drafts (megarl.engine.verify)."""
    if self.static is not None:  # the same work over fixed shapes (EngineConfig.static_shapes)
        return _Verified(*self.static.run(batch, step))
    inputs = [p + d for p, d in zip(batch.pending, batch.drafts)]
    n_new = [len(x) for x in inputs]
    dev = self.device
    hidden = self.forward([s.slot for s in batch.seqs], inputs)  # [N, H], packed
    # Verified rows: the last pending token and each draft token, in order, request by request.
    keep, draft_next, n_rows, off = [], [], [], 0
    for n, d in zip(n_new, batch.drafts):
        keep += range(off + n - 1 - len(d), off + n)
        draft_next += d + [-1]
        n_rows.append(len(d) + 1)
        off += n
    h = hidden if len(keep) == off else hidden[torch.tensor(keep, device=dev)]
    logits = self.head_logits(h).to(self.sample_dtype)
    reqs = [s.req for s in batch.seqs]
    row_start = torch.tensor([0] + list(itertools.accumulate(n_rows)), dtype=torch.int64, device=dev)
    rows = SamplingRows.of(reqs, [len(s.tokens) for s in batch.seqs], self.seed, step, self.sample_dtype, dev)
    tokens, n_accept = verify(logits, torch.tensor(draft_next, dtype=torch.int64, device=dev), row_start, rows)
    logprobs, entropies = token_stats(logits, rows.temperature.repeat_interleave(torch.tensor(n_rows, device=dev)),
                                      tokens)
    out = _Verified([], [], [], n_accept.tolist())
    if self.hidden_hook:  # the accepted rows' hidden states, for a learned drafter
        self.spec.on_verify(reqs, h, tokens, n_rows, out.n_accept, [len(s.tokens) for s in batch.seqs])
    tokens, logprobs, entropies = tokens.tolist(), logprobs.tolist(), entropies.tolist()
    for b, lo in enumerate(row_start[:-1].tolist()):
        hi = lo + out.n_accept[b] + 1
        out.tokens.append(tokens[lo:hi])
        out.logprobs.append(logprobs[lo:hi])
        out.entropies.append(entropies[lo:hi])
    return out


@contextlib.contextmanager
def _before():
    """Swap the earlier code in for the duration of the block."""
    saved = (llama.rope_cos_sin, llama.Attention.forward, ModelRunner.run)
    llama.rope_cos_sin, llama.Attention.forward, ModelRunner.run = rope_cos_sin, _attention_forward_before, run
    try:
        yield
    finally:
        llama.rope_cos_sin, llama.Attention.forward, ModelRunner.run = saved


def _gen(eng, prompts, n, temp):
    p = SamplingParams(temperature=temp, max_new_tokens=n, stop_token_ids=())
    res = eng.generate([Request(uid=i, sample_idx=0, prompt_ids=x, params=p) for i, x in enumerate(prompts)], step=3)
    return [(r.tokens, r.logprobs, r.entropies) for r in res]


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def cell(model_dir, dtype, batch, temp, n, rounds):
    cfg = EngineConfig(max_batch_size=batch, max_seq_len=48 + n, dtype=dtype)
    eng = Engine(load_hf_model(model_dir, cfg.torch_dtype), cfg, seed=0)
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, eng.vocab_size, (batch, 40), generator=g).tolist()
    sides = {"A": _before, "B": contextlib.nullcontext}
    wall, cpu, outs = {k: [] for k in sides}, {k: [] for k in sides}, {}
    for name, ctx in sides.items():  # warm-up
        with ctx():
            _gen(eng, prompts, 2, temp)
    for r in range(rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            with sides[name]():
                w1, c1, _ = _timed(lambda: _gen(eng, prompts, 1, temp))
                wn, cn, outs[name] = _timed(lambda: _gen(eng, prompts, n, temp))
            wall[name].append(1e3 * (wn - w1) / (batch * (n - 1)))
            cpu[name].append(1e3 * (cn - c1) / (batch * (n - 1)))
    med = statistics.median
    return (f"{dtype:>8} B={batch:<3} T={temp}: wall ms/token A {med(wall['A']):.3f} B {med(wall['B']):.3f} "
            f"A/B {med(a / b for a, b in zip(wall['A'], wall['B'])):.3f}; CPU ms/token A {med(cpu['A']):.3f} "
            f"B {med(cpu['B']):.3f} A/B {med(a / b for a, b in zip(cpu['A'], cpu['B'])):.3f}; "
            f"same tokens+logprobs+entropies: {outs['A'] == outs['B']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cells", default="float32:1:0,float32:64:0,bfloat16:1:0,bfloat16:64:0,float32:64:1")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    for c in a.cells.split(","):
        dtype, batch, temp = c.split(":")
        print(cell(a.model, dtype, int(batch), float(temp), a.new_tokens, a.rounds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
