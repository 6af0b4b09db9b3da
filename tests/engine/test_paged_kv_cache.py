"""Paged KV cache: block-table bookkeeping (host only), cached attention against a no-cache
forward, the torch reference and the Triton kernel (interpreter) of paged attention, and the
engine with ``kv_cache="paged"`` token-identical to the slot cache (fp64)."""
import dataclasses
import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.engine.paged_attention import paged_attention, paged_attention_torch
from megarl.engine.paged_kv_cache import BlockTable, PagedKVCache
from megarl.models.llama import attention
from megarl.spec.config import SpecConfig
from megarl.spec.speculator import Speculator
from tests.engine.test_engine import key, mixed_requests, tiny_model
from tests.engine.test_kv_cache import packed
from tests.engine.test_kv_cache import tiny_model as tiny_model64
from tests.spec.test_spec_engine import Scripted

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None


def make_cache(model, rows=4, seq=32, block=4, blocks=0):
    a = model.args
    return PagedKVCache(a.num_hidden_layers, rows, seq, a.num_key_value_heads, a.head_dim, torch.float64, "cpu",
                        block_size=block, num_blocks=blocks)


# ------------------------------------------------------------------ bookkeeping (host only)
def check_invariants(t: BlockTable) -> None:
    """Refcounts = references from the rows' block lists; the free pool = the blocks nobody holds;
    each row holds blocks for its length; the promised total matches a recount; the host tensor
    mirrors the lists."""
    refs = [0] * t.num_blocks
    for r in range(t.max_slots):
        for blk in t.blocks[r]:
            refs[blk] += 1
        assert len(t.blocks[r]) == -(-t.lengths[r] // t.block_size)
        assert t.tensor[r, :len(t.blocks[r])].tolist() == t.blocks[r]
    assert refs == t.refcount
    assert sorted(t._free_blocks) == [b for b in range(t.num_blocks) if refs[b] == 0]
    assert t._promised == sum(max(0, t._budget[r] - sum(t._own[r])) for r in range(t.max_slots) if t._used[r])
    assert t.available_blocks() >= 0


def test_block_table_allocate_free_reuse():
    t = BlockTable(max_seqs=3, max_seq_len=16, block_size=4, num_blocks=8)
    assert [t.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="no free KV-cache request row"):
        t.allocate()
    assert t.reserve([0, 1], [5, 3]) == [0, 0]
    assert t.blocks[0] == [0, 1] and t.blocks[1] == [2]  # lowest free block first, 5 positions = 2 blocks
    assert t.reserve([1], [2]) == [3] and t.blocks[1] == [2, 3]  # crosses into a second block
    assert t.tensor[0, :2].tolist() == [0, 1] and t.tensor[1, :2].tolist() == [2, 3]
    t.free(0)
    assert t.n_free_blocks == 6 and t.refcount[:2] == [0, 0] and t.lengths[0] == 0
    with pytest.raises(ValueError, match="not allocated"):
        t.free(0)  # double free
    with pytest.raises(ValueError, match="not allocated"):
        t.reserve([0], [1])
    assert t.allocate() == 0
    t.reserve([0], [1])
    assert t.blocks[0] == [0]  # the freed blocks are reused, lowest first
    check_invariants(t)
    with pytest.raises(ValueError, match="max_seq_len"):
        t.reserve([2], [17])


def test_truncate_returns_whole_blocks():
    t = BlockTable(2, 32, 4, 8)
    r = t.allocate()
    t.reserve([r], [10])  # blocks 0, 1, 2 (positions 8, 9 in block 2)
    t.truncate(r, 8)  # rejected drafts at 8, 9: block 2 goes back
    assert t.blocks[r] == [0, 1] and t.n_free_blocks == 6 and t.lengths[r] == 8
    t.truncate(r, 7)  # within block 1: kept
    assert t.blocks[r] == [0, 1]
    assert t.reserve([r], [2]) == [7] and t.blocks[r] == [0, 1, 2]
    check_invariants(t)
    with pytest.raises(ValueError, match="cannot truncate"):
        t.truncate(r, 10)


def test_share_refcounts_and_copy_on_write():
    t = BlockTable(4, 32, 4, 16)
    src, a, b = (t.allocate() for _ in range(3))
    t.reserve([src], [10])  # prompt prefix of 10 positions: 2 full blocks + 2 positions of a third
    copies = t.share(src, [a, b], 10)
    # full blocks by reference, the partial last block copied once per sample
    assert t.blocks[a][:2] == t.blocks[b][:2] == t.blocks[src][:2] == [0, 1]
    assert t.refcount[0] == t.refcount[1] == 3 and t.refcount[2] == 1
    assert copies == [(2, 3), (2, 4)] and t.blocks[a][2] == 3 and t.blocks[b][2] == 4
    assert t.lengths[a] == t.lengths[b] == 10
    # the samples append to their own blocks
    assert t.reserve([src, a, b], [3, 3, 3]) == [10, 10, 10]
    assert not t.pending_copies
    check_invariants(t)
    # the source finishes first: shared blocks live on while a sample holds them
    t.free(src)
    assert t.refcount[0] == 2 and 0 not in t._free_blocks and 2 in t._free_blocks
    # writing into a shared block (after a truncation into it) copies it first
    t.truncate(a, 6)
    t.reserve([a], [1])
    old, new = t.pending_copies[-1]
    assert old == 1 and t.blocks[a] == [0, new] and t.refcount[1] == 1 and t.refcount[new] == 1
    check_invariants(t)
    t.free(a)
    t.free(b)
    assert t.n_free_blocks == 16 and not any(t.refcount)
    with pytest.raises(ValueError, match="not empty"):
        c, d = t.allocate(), t.allocate()
        t.reserve([c, d], [4, 1])
        t.share(c, [d], 4)
    with pytest.raises(ValueError, match="holds"):
        t.share(c, [t.allocate()], 9)


def test_promised_blocks_and_out_of_blocks_error():
    t = BlockTable(4, 32, 4, 6)
    r = t.allocate(max_positions=15)  # 4 blocks promised, none taken yet
    assert t.available_blocks() == 2 and t.n_free_blocks == 6
    assert t.can_allocate(8) and not t.can_allocate(9)
    assert t.can_allocate(13, shared=12)  # 4 blocks, 3 of them received by reference
    with pytest.raises(RuntimeError, match=r"needs 3.*raise EngineConfig\.num_kv_blocks \(now 6"):
        t.allocate(max_positions=12)
    t.reserve([r], [15])  # takes its promised blocks: the others' share is untouched
    assert t.available_blocks() == 2
    t.truncate(r, 4)  # blocks freed by truncation stay promised to r
    assert t.available_blocks() == 2 and t.n_free_blocks == 5
    check_invariants(t)
    u = t.allocate()  # nothing promised: writes take unpromised blocks ...
    t.reserve([u], [8])
    with pytest.raises(RuntimeError, match="num_kv_blocks"):  # ... until none is left
        t.reserve([u], [1])
    t.free(r)
    assert t.available_blocks() == 4
    check_invariants(t)


def test_block_table_random_operations_keep_invariants():
    """300 random engine-like operations (admit with promises, grow, share a prefix, truncate
    drafts, finish): the invariants hold after each, promised rows never run out, and at the end
    every block is back in the pool."""
    rng = random.Random(0)
    t = BlockTable(max_seqs=6, max_seq_len=40, block_size=4, num_blocks=30)
    limit = {}
    for _ in range(300):
        live = [r for r in range(t.max_slots) if t._used[r]]
        op = rng.random()
        if op < 0.25 and t.n_free:
            longest = rng.randint(1, 40)
            donors = [r for r in live if 0 < t.lengths[r] <= longest]
            if donors and rng.random() < 0.5:
                src = rng.choice(donors)
                n = rng.randint(1, t.lengths[src])
                if t.can_allocate(longest, n):
                    r = t.allocate(longest, n)
                    t.share(src, [r], n)
                    limit[r] = longest
            elif t.can_allocate(longest):
                limit[t.allocate(longest)] = longest
        elif op < 0.7 and live:
            r = rng.choice(live)
            room = limit[r] - t.lengths[r]
            if room > 0:
                t.reserve([r], [rng.randint(1, min(room, 5))])  # never fails: its blocks are promised
                t.pending_copies.clear()
        elif op < 0.85 and live:
            r = rng.choice(live)
            t.truncate(r, rng.randint(max(0, t.lengths[r] - 5), t.lengths[r]))
        elif live:
            t.free(rng.choice(live))
        check_invariants(t)
    for r in range(t.max_slots):
        if t._used[r]:
            t.free(r)
    check_invariants(t)
    assert t.n_free_blocks == 30 and t.available_blocks() == 30


# ------------------------------------------------------------------ cached attention
@torch.no_grad()
def test_paged_decode_matches_full_forward():
    model = tiny_model64()
    cache = make_cache(model, block=4)
    prompts = [[5, 6, 7, 8, 9], [3, 2], [10, 11, 12]]
    cont = [[13, 14, 15, 16], [17, 18, 19, 20], [21, 22, 23, 24]]
    rows = [cache.table.allocate() for _ in prompts]
    attn, pos = cache.batch(rows, [len(p) for p in prompts])
    assert pos.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2]]
    logits = model(packed(prompts), pos, attn)[0]
    off = 0
    for p in prompts:
        assert torch.allclose(logits[off:off + len(p)], model(torch.tensor([p]))[0], rtol=0, atol=1e-10)
        off += len(p)
    for i in range(4):  # decode steps cross block boundaries (block size 4)
        attn, pos = cache.batch(rows, [1] * len(rows))
        logits = model(packed([[c[i]] for c in cont]), pos, attn)[0]
        for b, p in enumerate(prompts):
            ref = model(torch.tensor([p + cont[b][: i + 1]]))[0, -1]
            assert torch.allclose(logits[b], ref, rtol=0, atol=1e-10)
    attn, pos = cache.batch(rows[:2], [1, 3])  # a decode row next to a verify row
    assert not attn.dense
    logits = model(packed([[30], [31, 32, 33]]), pos, attn)[0]
    assert torch.allclose(logits[0], model(torch.tensor([prompts[0] + cont[0] + [30]]))[0, -1], rtol=0, atol=1e-10)
    assert torch.allclose(logits[1:], model(torch.tensor([prompts[1] + cont[1] + [31, 32, 33]]))[0, -3:],
                          rtol=0, atol=1e-10)


@torch.no_grad()
def test_paged_shared_prefix_equals_own_prefill():
    model = tiny_model64()
    cache = make_cache(model, block=4)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    src, a, b = (cache.table.allocate() for _ in range(3))
    attn, pos = cache.batch([src], [6])
    model(packed([prompt[:6]]), pos, attn)
    cache.share_prefix(src, [a, b], 6)
    tb = cache.table
    assert tb.blocks[a][0] == tb.blocks[b][0] == tb.blocks[src][0] and tb.refcount[tb.blocks[src][0]] == 3
    assert len({tb.blocks[x][1] for x in (src, a, b)}) == 3  # the partial block: one copy each
    assert torch.equal(cache.k[:, tb.blocks[a][1], :, :2], cache.k[:, tb.blocks[src][1], :, :2])
    attn, pos = cache.batch([src, a, b], [1, 3, 1])
    logits = model(packed([[11], [11, 20, 21], [11]]), pos, attn)[0]
    ref = model(torch.tensor([prompt + [20, 21]]))[0]
    assert torch.allclose(logits[0], ref[6], rtol=0, atol=1e-10) and torch.allclose(logits[4], ref[6], rtol=0,
                                                                                     atol=1e-10)
    assert torch.allclose(logits[1:4], ref[6:9], rtol=0, atol=1e-10)


@torch.no_grad()
def test_reused_blocks_ignore_stale_entries():
    model = tiny_model64()
    cache = make_cache(model, rows=1, block=4)
    r = cache.table.allocate()
    attn, pos = cache.batch([r], [9])
    model(torch.arange(1, 10)[None], pos, attn)
    cache.table.free(r)
    r = cache.table.allocate()
    attn, pos = cache.batch([r], [3])
    assert torch.allclose(model(torch.tensor([[4, 5, 6]]), pos, attn)[0], model(torch.tensor([[4, 5, 6]]))[0],
                          rtol=0, atol=1e-10)


def random_paged_case(dtype, b=3, t=3, hq=6, hkv=2, d=8, bs=4, n_blocks=16, seed=0, device="cpu"):
    """Random caches, a shuffled block table (non-contiguous, shared first block) and ragged rows:
    request 0 verifies t tokens across a block boundary, request 1 decodes one, request 2 two."""
    g = torch.Generator().manual_seed(seed)
    kc, vc = (torch.randn(n_blocks, hkv, bs, d, generator=g, dtype=dtype) for _ in range(2))
    q = torch.randn(b, t, hq, d, generator=g, dtype=dtype)
    perm = torch.randperm(n_blocks, generator=g)
    tables = torch.stack([perm[:5], torch.cat([perm[:1], perm[5:9]]), perm[9:14]])[:b].to(torch.int32)
    q_start = torch.tensor([9, 2, 17])[:b]
    n_q = torch.tensor([t, 1, min(2, t)])[:b]
    return [x.to(device) for x in (q, kc, vc, tables, q_start, n_q)]


def test_paged_attention_reference_equals_dense_attention():
    q, kc, vc, tables, q_start, n_q = random_paged_case(torch.float64)
    out = paged_attention(q, kc, vc, tables, q_start, n_q)  # auto on CPU: the torch reference
    bs = kc.shape[2]
    for b in range(q.shape[0]):
        n = int(q_start[b] + n_q[b])
        ks, vs = ([c[int(tables[b, p // bs]), :, p % bs] for p in range(n)] for c in (kc, vc))
        keys, values = torch.stack(list(ks))[None], torch.stack(list(vs))[None]  # [1, n, Hkv, D]
        mask = torch.arange(n)[None, :] <= (q_start[b] + torch.arange(int(n_q[b])))[:, None]
        ref = attention(q[b:b + 1, :int(n_q[b])], keys, values, mask[None])[0]
        assert torch.allclose(out[b, :int(n_q[b])], ref, rtol=0, atol=1e-12)
        assert not out[b, int(n_q[b]):].any()  # padding rows are zero
    with pytest.raises(ValueError, match="backend"):
        paged_attention(q, kc, vc, tables, q_start, n_q, backend="cuda")
    with pytest.raises(ValueError, match="multiple of Hkv"):
        paged_attention_torch(q[:, :, :5], kc, vc, tables, q_start, n_q)


# ------------------------------------------------------------------ Triton kernel
# The interpreter must be chosen before triton.jit wraps the kernel, and once it has run it leaves
# triton.language patched in its process (later compiles there fail): the interpreter cases run
# in a subprocess, this file run as a script with TRITON_INTERPRET=1 (as tests/engine/test_verify.py).
INTERPRETER_CASES = [(dtype, atol, t, hq, hkv) for dtype, atol in ((torch.float32, 1e-5), (torch.float64, 1e-12))
                     for t, hq, hkv in ((1, 4, 1), (5, 6, 2))]  # decode (GQA 4) and a K=4 verify (GQA 3)


def _interpreter_worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    from megarl.engine.paged_attention_triton import paged_attention_triton
    for dtype, atol, t, hq, hkv in INTERPRETER_CASES:
        case = random_paged_case(dtype, t=t, hq=hq, hkv=hkv, seed=t)
        got, want = paged_attention_triton(*case), paged_attention_torch(*case)
        err = (got - want).abs().max().item()
        assert got.dtype == dtype and err <= atol, f"dtype={dtype} T={t} Hq={hq} Hkv={hkv}: max error {err} > {atol}"
    q, kc, vc, *rest = random_paged_case(torch.float32)
    try:
        paged_attention_triton(q, kc[:, :, :3], vc[:, :, :3], *rest)
    except ValueError as e:
        assert "power of two" in str(e), e
    else:
        raise AssertionError("block_size=3 must be refused")
    print("PARITY OK")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_interpreter_matches_reference():
    """fp32 within 1e-5 and fp64 within 1e-12 of the torch reference: decode (T=1, 4 query heads
    on 1 KV head) and a K=4 verify (T=5, GQA 3) over shuffled, shared blocks and ragged rows."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "PARITY OK" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_kernel_cuda_matches_reference(dtype, atol):
    from megarl.engine.paged_attention_triton import paged_attention_triton
    for t in (1, 5):  # Qwen2.5-1.5B heads: 12 query heads on 2 KV heads of 128
        case = random_paged_case(torch.float32, b=3, t=t, hq=12, hkv=2, d=128, bs=16, n_blocks=16,
                                 device="cuda")
        case[:3] = [x.to(dtype) for x in case[:3]]
        got = paged_attention_triton(*case).float()
        want = paged_attention_torch(*[x.float() if x.is_floating_point() else x for x in case])
        assert torch.allclose(got, want, rtol=0, atol=atol), (got - want).abs().max()


@pytest.mark.gpu
def test_paged_engine_cuda_equals_cpu_slots_fp64():
    reqs = mixed_requests(12)
    cpu = paged_engine("slots").generate(reqs, step=3)
    gpu = Engine(tiny_model(), EngineConfig(max_batch_size=8, max_seq_len=64, dtype="float64", device="cuda",
                                            kv_cache="paged"), seed=1234).generate(reqs, step=3)
    assert [key(r) for r in gpu] == [key(r) for r in cpu]


# ------------------------------------------------------------------ engine: paged == slots
def paged_engine(kv_cache="paged", max_batch_size=4, block=4, blocks=0, spec=None):
    return Engine(tiny_model(), EngineConfig(max_batch_size=max_batch_size, max_seq_len=64, dtype="float64",
                                             kv_cache=kv_cache, kv_block_size=block, num_kv_blocks=blocks),
                  seed=1234, spec=spec)


def grpo_requests(n_prompts=3, g=4):
    rng = random.Random(7)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(1,))
    return [Request(uid=10 + i, sample_idx=j, prompt_ids=prompt, params=params)
            for i, prompt in enumerate([rng.randrange(2, 40) for _ in range(n)] for n in (6, 9, 3)[:n_prompts])
            for j in range(g)]


def assert_cache_empty(eng):
    t = eng.cache.table
    check_invariants(t)
    assert t.n_free == t.max_slots and t.n_free_blocks == t.num_blocks and not any(t.refcount)


def test_paged_engine_equals_slots_plain_and_grpo():
    for reqs, batch in ((mixed_requests(10), 4), (grpo_requests(), 8)):
        ref = paged_engine("slots", max_batch_size=batch).generate(reqs, step=5)
        eng = paged_engine(max_batch_size=batch)
        out = eng.generate(reqs, step=5)
        assert [key(r) for r in out] == [key(r) for r in ref]
        for a, b in zip(out, ref):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-10)
        assert_cache_empty(eng)


def test_grpo_group_shares_prompt_blocks():
    eng = paged_engine(max_batch_size=8)
    from collections import deque

    from megarl.engine.engine import _Seq
    reqs = grpo_requests(n_prompts=2)  # prompts of 6 and 9 tokens, 4 samples each
    running = []
    eng.admit(deque(_Seq(i, r) for i, r in enumerate(reqs)), running)
    t = eng.cache.table
    assert eng.stats["forwards"] == 1  # one prefill forward for both prompts
    held = {blk for s in running for blk in t.blocks[s.slot]}
    # prefix 5 = 1 full block (shared) + a partial one (copied): 1 + 4 blocks; prefix 8 = 2 full blocks
    assert len(held) == (1 + 4) + 2
    assert [t.lengths[s.slot] for s in running] == [5] * 4 + [8] * 4
    assert all(t.blocks[s.slot][:2] == t.blocks[running[4].slot] for s in running[4:])


@pytest.mark.parametrize("flip", [0.3, 1.0])
def test_paged_engine_speculative_equals_slots(flip):
    reqs = [dataclasses.replace(r, params=dataclasses.replace(r.params, max_new_tokens=20)) for r in grpo_requests()]
    ref = paged_engine("slots", max_batch_size=8).generate(reqs, step=2)
    answers = {(r.uid, r.sample_idx): r.tokens for r in ref}
    spec = Speculator(SpecConfig(enabled=True, sources=("group",), k_init=4, k_min=1, k_max=8))
    spec.sources = [Scripted(spec.cfg, answers, flip)]
    eng = paged_engine(max_batch_size=8, spec=spec)
    out = eng.generate(reqs, step=2)
    assert [key(r) for r in out] == [key(r) for r in ref]
    m = spec.metrics()
    assert 0 < m["spec/accepted"] < m["spec/drafted"]  # truncations of rejected drafts happened
    assert_cache_empty(eng)


def test_small_pool_admits_fewer_and_stays_exact():
    reqs = grpo_requests()
    ref = paged_engine("slots", max_batch_size=8).generate(reqs, step=1)
    # longest request: 9-token prompt + 12 new - 1 = 20 positions = 5 blocks of 4; 12 blocks hold
    # about two requests at a time, fewer than the 8 rows
    eng = paged_engine(max_batch_size=8, blocks=12)
    out = eng.generate(reqs, step=1)
    assert [key(r) for r in out] == [key(r) for r in ref]
    roomy = paged_engine(max_batch_size=8)
    roomy.generate(reqs, step=1)
    assert eng.stats["forwards"] > roomy.stats["forwards"]  # fewer requests per forward
    assert_cache_empty(eng)
    with pytest.raises(RuntimeError, match=r"uid=11.*raise EngineConfig\.num_kv_blocks \(now 4"):
        paged_engine(blocks=4).generate(reqs[4:5], step=1)


def test_kv_cache_config_validation():
    for kw, name in [(dict(kv_cache="pages"), "kv_cache"), (dict(kv_block_size=12), "kv_block_size"),
                     (dict(num_kv_blocks=-1), "num_kv_blocks")]:
        with pytest.raises(ValueError, match=name):
            EngineConfig(**kw)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp64"])
def test_triton_kernel_compiles_for_h100(dtype):
    """No GPU needed: the kernel compiles to PTX for sm_90 at Qwen2.5-1.5B's shapes (12 query heads
    on 2 KV heads of 128, blocks of 16; decode and a K=4 verify), with fp32 accumulation for bf16."""
    import triton
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megarl.engine import paged_attention_triton as pat
    if not isinstance(pat._paged_attn_kernel, triton.runtime.JITFunction):
        pytest.skip("kernels were built for the interpreter (TRITON_INTERPRET=1)")
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    ptr = f"*{dtype}"
    sig = dict(q_ptr=ptr, k_ptr=ptr, v_ptr=ptr, tbl_ptr="*i64", qstart_ptr="*i64", nq_ptr="*i64", out_ptr=ptr,
               **{s: "i32" for s in ("sq_b", "sq_t", "sq_h", "sk_blk", "sk_h", "sk_pos", "so_b", "so_t", "so_h",
                                     "st_b")}, scale="fp32")
    for t in (1, 5):
        consts = dict(REP=6, D=128, BLOCK_M=max(16, triton.next_power_of_2(6 * t)), BLOCK_D=128, BLOCK_SIZE=16,
                      ACC_F64=dtype == "fp64", IEEE=dtype != "bf16")
        src = ASTSource(pat._paged_attn_kernel, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
        if dtype == "bf16":  # tensor-core MMA on bf16 operands, fp32 accumulators
            assert "bf16" in ptx and ("wgmma" in ptx or "mma.sync" in ptx), "no bf16 tensor-core dot"


if __name__ == "__main__":
    _interpreter_worker()
