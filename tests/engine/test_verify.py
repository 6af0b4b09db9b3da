"""Speculative verification: the torch reference's semantics, and bitwise parity of the Triton
kernel with it (interpreter on CPU, compiled on GPU).

The interpreter must be chosen before ``triton.jit`` wraps the kernels, i.e. before
``megarl.engine.verify_triton`` is first imported, which another test in the same pytest process
may already have done. So the CPU parity cases run in worker subprocesses (this file run as a
script with TRITON_INTERPRET=1), two at a time on the two cores.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.engine.sampler import gumbel_noise, sample
from megarl.engine.sampling_rows import SamplingRows
from megarl.engine.verify import verify

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

# every (temperature, top_k, top_p) of the parity matrix; 6 requests per verify call
COMBOS = [(t, k, p) for t in (0.0, 0.6, 1.0, 1.7) for k in (0, 1, 3) for p in (1.0, 0.9, 0.3)]
LENS = [1, 4, 2, 5, 3, 5]  # rows per request: 20 rows, ragged, one bonus-only request


def _per_req(vals, dtype, device):
    return torch.tensor(vals, dtype=dtype, device=device)


def _to(rows: SamplingRows, device) -> SamplingRows:
    return dataclasses.replace(rows, **{f.name: getattr(rows, f.name).to(device) for f in dataclasses.fields(rows)
                                        if isinstance(getattr(rows, f.name), torch.Tensor)})


def parity_case(vocab: int, dtype, combos, seed: int, device="cpu", lens=LENS):
    """Inputs for one verify call with deliberate ties, -0.0, -inf, huge keys, and drafts that
    match the target for a known number of rows. Returns (args, expected n_accept)."""
    g = torch.Generator().manual_seed(seed)
    n, b = sum(lens), len(lens)
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3
    logits = (logits * 4).round() / 4  # quarter steps: many exact ties, -0.0 from rounding
    logits[0, : min(3, vocab)] = logits[0].max()  # a three-way tie at the max
    logits[1, 1::2] = logits[1, 0]  # half the vocab tied
    logits[2, vocab // 2:] = float("-inf")  # masked vocab
    logits = logits.to(dtype)
    row_start = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    t, k, p = zip(*combos)
    rows = SamplingRows(temperature=_per_req(t, dtype, "cpu"), top_k=_per_req(k, torch.int64, "cpu"),
                        top_p=_per_req(p, torch.float64, "cpu"),
                        uid=_per_req([7, -3, (1 << 62) + 5, 0, -(1 << 40), 123456789][:b], torch.int64, "cpu"),
                        sample_idx=_per_req(list(range(b)), torch.int64, "cpu"),
                        position=_per_req([0, 5, (1 << 32) + 1, 17, 3, 250][:b], torch.int64, "cpu"),
                        seed=(1 << 63) + 12345 + seed, step=(1 << 32) + 2 + seed)
    args = dict(logits=logits, draft_next=torch.full((n,), -1, dtype=torch.int64), row_start=row_start, rows=rows)
    tokens, _ = verify(**args, backend="torch")
    # request r's drafts match its first (r mod len) rows, then one wrong draft; odd requests
    # carry the target token on their last row, which must never count
    draft, expect = torch.full((n,), -1, dtype=torch.int64), []
    for r, (lo, ln) in enumerate(zip(row_start.tolist(), lens)):
        m = r % ln
        expect.append(m)
        for j in range(ln - 1):
            draft[lo + j] = tokens[lo + j] if j < m else (tokens[lo + j] + 1) % vocab
        if r % 2:
            draft[lo + ln - 1] = tokens[lo + ln - 1]
    args["draft_next"] = draft
    args = {key: v.to(device) if isinstance(v, torch.Tensor) else _to(v, device) for key, v in args.items()}
    return args, expect


# ------------------------------------------------------------------ reference semantics
def _greedy_case(lens, vocab=5):
    torch.manual_seed(0)
    n = sum(lens)
    logits = torch.randn(n, vocab, dtype=torch.float64)
    b = len(lens)
    z = torch.zeros(b, dtype=torch.int64)
    rows = SamplingRows(temperature=torch.zeros(b, dtype=torch.float64), top_k=z,
                        top_p=torch.ones(b, dtype=torch.float64), uid=z, sample_idx=z, position=z, seed=0, step=0)
    return dict(logits=logits, row_start=torch.tensor([0] + list(torch.tensor(lens).cumsum(0))), rows=rows)


def test_reference_accept_counts_hand_cases():
    case = _greedy_case([3, 1, 3, 2])
    target = case["logits"].argmax(-1)  # greedy rows: the target token is the argmax
    t = target.tolist()
    wrong = lambda r: (t[r] + 1) % 5  # noqa: E731
    draft = torch.tensor([t[0], t[1], -1,        # both drafts accepted, plus the bonus token
                          -1,                    # single-row request: bonus row only
                          wrong(4), t[5], -1,    # first draft rejected (a later match does not count)
                          t[7], t[8]])           # a "draft" on the last row never counts
    tokens, n_accept = verify(draft_next=draft, **case)
    assert torch.equal(tokens, target)
    assert n_accept.tolist() == [2, 0, 0, 1]
    assert n_accept.dtype == torch.int64


def test_reference_equals_sampler_row_by_row():
    args, expect = parity_case(40, torch.float64, COMBOS[6:12], seed=3)
    tokens, n_accept = verify(**args, backend="torch")
    assert n_accept.tolist() == expect
    rs, p = args["row_start"].tolist(), args["rows"]
    for b in range(len(rs) - 1):
        for j, row in enumerate(range(rs[b], rs[b + 1])):
            noise = gumbel_noise(p.seed, p.step, p.uid[b:b + 1], p.sample_idx[b:b + 1], p.position[b:b + 1] + j, 40,
                                 torch.float64)
            one = sample(args["logits"][row:row + 1], noise, p.temperature[b].item(), p.top_k[b].item(),
                         p.top_p[b].item())
            assert tokens[row].item() == one.tokens.item(), (b, j)


def test_verify_validates_inputs():
    case = _greedy_case([2, 1])
    draft = torch.tensor([0, -1, -1])
    verify(draft_next=draft, **case)  # fine
    rows = case["rows"]
    bad = [(dict(draft_next=torch.tensor([0, -1])), "draft_next"),
           (dict(draft_next=draft.float()), "draft_next"),
           (dict(row_start=torch.tensor([0, 2, 2, 3])), "rows holds 2 requests"),
           (dict(row_start=torch.tensor([0, 3, 3])), "row_start"),
           (dict(row_start=torch.tensor([1, 2, 3])), "row_start"),
           (dict(rows=dataclasses.replace(rows, top_p=torch.tensor([0.0, 1.0], dtype=torch.float64))), "top_p"),
           (dict(rows=dataclasses.replace(rows, temperature=torch.tensor([-1.0, 0.0], dtype=torch.float64))),
            "temperature"),
           (dict(rows=dataclasses.replace(rows, top_k=torch.tensor([-1, 0]))), "top_k"),
           (dict(rows=(rows,)), "rows must be a SamplingRows")]
    for change, name in bad:
        with pytest.raises((ValueError, TypeError), match=name):
            verify(**{**case, "draft_next": draft, **change})
    with pytest.raises(ValueError, match="backend"):
        verify(draft_next=draft, **case, backend="cuda")


def test_sampling_rows_validate_their_fields():
    """One dtype per field, one size and device for all, int seed and step: each error names the field."""
    rows = _greedy_case([2, 1])["rows"]
    bad = [(dict(top_k=torch.zeros(2)), "top_k has dtype torch.float32, expected torch.int64"),
           (dict(top_p=torch.ones(2, dtype=torch.float32)), "top_p has dtype torch.float32, expected torch.float64"),
           (dict(temperature=torch.zeros(2, dtype=torch.int64)), "temperature has dtype torch.int64"),
           (dict(uid=torch.zeros(3, dtype=torch.int64)), r"uid is \[3\]"),
           (dict(position=torch.zeros(2, 1, dtype=torch.int64)), "position must be a 1-d"),
           (dict(seed=1.5), "seed must be an int")]
    for change, msg in bad:
        with pytest.raises((ValueError, TypeError), match=msg):
            dataclasses.replace(rows, **change)


# ------------------------------------------------------------------ Triton parity
def _detmath_parity(device) -> None:
    """The kernel's det_log / det_exp / u -> g, bit for bit, on every u of the noise grid (which
    includes the one u whose g is -0.0), random floats of every exponent, and special values."""
    from megarl.engine.detmath import det_exp, det_log
    from megarl.engine.verify_triton import detmath_triton
    u = (torch.arange(2 ** 23, device=device).to(torch.float32) * 2.0 ** -23) + 2.0 ** -24
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e-40, -87.5, 88.5,
                            -1e-30], device=device)
    bits = torch.randint(-(2 ** 31), 2 ** 31 - 1, (1 << 20,), generator=torch.Generator().manual_seed(0),
                         dtype=torch.int32).to(device)
    any_float = torch.cat([bits.view(torch.float32), special])
    grid = torch.cat([torch.linspace(-90, 90, 1 << 20, device=device), special])
    for op, ref, x in [("gumbel", lambda v: -det_log(-det_log(v)), u), ("det_log", det_log, any_float),
                       ("det_exp", det_exp, grid), ("det_exp", det_exp, any_float)]:
        want = ref(x)
        got = detmath_triton(x, op, block=1 << 20 if device == "cpu" else 1024)  # few big interpreter steps
        nan = torch.isnan(want)  # NaN payloads may differ; both must be NaN
        bad = ((got.view(torch.int32) != want.view(torch.int32)) & ~nan) | (nan & ~torch.isnan(got))
        assert not bad.any(), f"{op}: {int(bad.sum())} values differ, e.g. x={x[bad][:4].tolist()}"


def _triton_parity(dtype, device, vocabs_blocks, combos_per_call, noise_vocab, seed0=0):
    """Shared by the interpreter worker and the GPU test: raises AssertionError on any mismatch."""
    from megarl.engine.verify_triton import gumbel_noise_triton, verify_triton
    call = 0
    for vocab, block_v in vocabs_blocks:
        for combos in combos_per_call:
            args, expect = parity_case(vocab, dtype, combos, seed=seed0 + call, device=device)
            call += 1
            ref_tok, ref_acc = verify(**args, backend="torch")
            tri_tok, tri_acc = verify_triton(**args, block_v=block_v)
            where = f"dtype={dtype} V={vocab} block_v={block_v} combos={combos}"
            bad = (ref_tok != tri_tok).nonzero().flatten().tolist()
            assert not bad, f"{where}: tokens differ at rows {bad}: {ref_tok[bad].tolist()} vs {tri_tok[bad].tolist()}"
            assert ref_acc.tolist() == tri_acc.tolist() == expect, f"{where}: {ref_acc} {tri_acc} {expect}"
    uid = torch.tensor([0, -1, (1 << 63) - 1, -(1 << 63), 42], device=device)
    sidx = torch.tensor([0, 1, (1 << 32) + 3, 7, 2], device=device)
    pos = torch.tensor([0, 1000, (1 << 40) + 9, 1, 65535], device=device)
    for seed, step in [(0, 0), ((1 << 64) - 1, (1 << 32) - 1), (123456789, 77)]:
        ref = gumbel_noise(seed, step, uid, sidx, pos, noise_vocab, torch.float32)
        tri = gumbel_noise_triton(seed, step, uid, sidx, pos, noise_vocab, block_v=256)
        assert torch.equal(ref.view(torch.int32), tri.view(torch.int32)), f"noise bits differ (seed={seed})"


def _interpreter_worker(dtype_name: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    # fp32 and fp64 each cover half the matrix (every temperature, top-k and top-p value in
    # both). V=300 with block_v=256 exercises the V loop and the masked tail.
    combos = COMBOS[0::2] if dtype_name == "float32" else COMBOS[1::2]
    if dtype_name == "float32":
        _detmath_parity("cpu")
    calls = [combos[i:i + 6] for i in range(0, len(combos), 6)]
    _triton_parity(getattr(torch, dtype_name), "cpu", [(7, 16), (50, 64), (300, 256)],
                   calls[:1], noise_vocab=300)
    for vocab_block, chunk in zip([(7, 16), (50, 64)], calls[1:]):
        _triton_parity(getattr(torch, dtype_name), "cpu", [vocab_block], [chunk], noise_vocab=7, seed0=10)
    print("PARITY OK")


@needs_triton
def test_triton_interpreter_parity():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, __file__, name], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for name in ("float32", "float64")]
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0 and "PARITY OK" in out, out[-4000:]


@needs_triton
def test_triton_ptx_uses_ieee_ops_only():
    """Compile (no GPU needed) for sm_90 and check the exactness assumptions in the PTX: no FMA
    contraction, no approximate division / log / exp, no flush-to-zero arithmetic."""
    import triton
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megarl.engine import verify_triton as vt
    if not isinstance(vt._verify_kernel, triton.runtime.JITFunction):
        pytest.skip("kernels were built for the interpreter (TRITON_INTERPRET=1)")
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    ids = dict(uid_ptr="*i64", sidx_ptr="*i64", seed_lo="i64", seed_hi="i32", step_lo="i32", V="constexpr",
               BLOCK_V="constexpr")
    sources = [ASTSource(vt._noise_kernel, dict(out_ptr="*fp32", pos_ptr="*i64", **ids),
                         constexprs=dict(V=151936, BLOCK_V=1024))]
    for is64 in (False, True):
        f = "*fp64" if is64 else "*fp32"
        sig = dict(logits_ptr=f, stride_row="i32", draft_ptr="*i64", row_req_ptr="*i64", row_start_ptr="*i64",
                   temp_ptr=f, top_k_ptr="*i64", top_p_ptr="*fp64", pos0_ptr="*i64", tokens_ptr="*i64",
                   n_accept_ptr="*i64", IS_F64="constexpr", ID_BITS="constexpr", **ids)
        sources.append(ASTSource(vt._verify_kernel, sig,
                                 constexprs=dict(V=151936, IS_F64=is64, ID_BITS=20, BLOCK_V=512)))
    for src in sources:
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=8, enable_fp_fusion=False)).asm["ptx"]
        ops = set(re.findall(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)", ptx, flags=re.M))
        assert not [o for o in ops if o.startswith(("fma.", "mad.rn", "div.full", "div.approx", "lg2", "ex2"))], ops
        # float add/sub/mul/div all explicitly round-to-nearest (ptxas never contracts those) and
        # keep subnormals; only floor carries ftz, harmless as its argument is never subnormal
        fops = [o for o in ops if re.match(r"(add|sub|mul|div)\.", o) and re.search(r"\.f(32|64)$", o)]
        assert fops and all(".rn." in o and ".ftz" not in o for o in fops), fops


@needs_triton
@pytest.mark.gpu
def test_triton_gpu_parity_realistic_vocab():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: this test is for the compiled kernel")
    _detmath_parity("cuda")
    half = len(COMBOS) // 2
    for dtype in (torch.float32, torch.float64):
        calls = [COMBOS[i:i + 6] for i in range(0, len(COMBOS), 6)]
        _triton_parity(dtype, "cuda", [(151936, 512)], calls, noise_vocab=151936)
        _triton_parity(dtype, "cuda", [(50, 16), (300, 128)], calls[:half // 6], noise_vocab=300, seed0=50)
    args, expect = parity_case(151936, torch.float32, COMBOS[:6], seed=99, device="cuda")
    assert verify(**args)[1].tolist() == expect  # backend="auto" (the kernel on CUDA)


if __name__ == "__main__":
    _interpreter_worker(sys.argv[1])


def test_sample_rows_equals_verify_on_one_row_per_request():
    """Plain decoding's shortcut (``sample_rows``, no drafts) gives verify's tokens for the same
    batch: every (temperature, top_k, top_p) of the matrix, position keys that differ per request,
    float32 and float64 logits."""
    from megarl.engine.verify import sample_rows

    g = torch.Generator().manual_seed(7)
    b = len(COMBOS)
    for dtype in (torch.float32, torch.float64):
        logits = (torch.randn(b, 97, generator=g) * 3).to(dtype)
        rows = SamplingRows(temperature=_per_req([c[0] for c in COMBOS], dtype, "cpu"),
                            top_k=_per_req([c[1] for c in COMBOS], torch.int64, "cpu"),
                            top_p=_per_req([c[2] for c in COMBOS], torch.float64, "cpu"),
                            uid=_per_req([11 * i + 3 for i in range(b)], torch.int64, "cpu"),
                            sample_idx=_per_req([i % 4 for i in range(b)], torch.int64, "cpu"),
                            position=_per_req([5 * i for i in range(b)], torch.int64, "cpu"), seed=1234, step=9)
        want, n_accept = verify(logits, torch.full((b,), -1), torch.arange(b + 1), rows)
        got = sample_rows(logits, rows)
        assert torch.equal(got, want) and not n_accept.any()
        # the keys matter: another step samples other tokens at T > 0
        assert not torch.equal(sample_rows(logits, dataclasses.replace(rows, step=10)), want)
