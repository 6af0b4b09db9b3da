"""Counter-based Gumbel noise, logit filters and the sampler."""
import math
import struct

import pytest
import torch

from megarl.engine.detmath import det_exp, det_log
from megarl.engine.sampler import NOISE_HI, NOISE_LO, SamplingParams, filter_logits, gumbel_noise, noise_hash, sample

M = 0xFFFFFFFF


def _rotl(x, r):
    return ((x << r) | (x >> (32 - r))) & M


def murmur3_32(data: bytes, seed: int = 0) -> int:
    """Plain-Python MurmurHash3_x86_32, the reference for the documented noise formula."""
    h = seed
    n4 = len(data) // 4
    for (k,) in struct.iter_unpack("<I", data[: 4 * n4]):
        k = _rotl((k * 0xCC9E2D51) & M, 15) * 0x1B873593 & M
        h = (_rotl(h ^ k, 13) * 5 + 0xE6546B64) & M
    tail = data[4 * n4:]
    k = 0
    for i, b in enumerate(tail):
        k |= b << (8 * i)
    if tail:
        h ^= _rotl((k * 0xCC9E2D51) & M, 15) * 0x1B873593 & M
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M
    return h ^ (h >> 16)


def _noise(seed=7, step=3, uid=11, sidx=2, pos=5, vocab=50, dtype=torch.float64):
    t = lambda x: torch.tensor([x], dtype=torch.int64)  # noqa: E731
    return gumbel_noise(seed, step, t(uid), t(sidx), t(pos), vocab, dtype)[0]


def test_reference_murmur3_known_vectors():
    assert murmur3_32(b"", 0) == 0
    assert murmur3_32(b"", 1) == 0x514E28B7
    assert murmur3_32(b"aaaa", 0x9747B28C) == 0x5A97808A
    assert murmur3_32(b"abcd", 0x9747B28C) == 0xF0478627


def test_hash_matches_documented_formula():
    keys = [(0, 0, 0, 0, 0), (123456789012345, 17, -5, 3, 1000), ((1 << 64) - 1, (1 << 32) - 1, (1 << 62) + 7, 9, 4)]
    vocab = 37
    for seed, step, uid, sidx, pos in keys:
        h = noise_hash(seed, step, torch.tensor([uid]), torch.tensor([sidx]), torch.tensor([pos]), vocab)[0]
        s = seed & ((1 << 64) - 1)
        u = uid & ((1 << 64) - 1)
        for v in range(vocab):
            words = [s & M, s >> 32, step & M, u & M, u >> 32, sidx & M, pos & M, v]
            assert int(h[v]) == murmur3_32(struct.pack("<8I", *words), 0)
        # and the fp32 mapping of the docstring, bit for bit
        g = _noise(seed, step, uid, sidx, pos, vocab, torch.float32)
        uu = (h >> 9).to(torch.float32) * 2.0 ** -23 + 2.0 ** -24
        assert torch.equal(g, -det_log(-det_log(uu)))


def _ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in units of the float32 ulp at the exact value (float64 math throughout:
    the engine turns on flush-denormal process-wide, which would zero a float32 ulp of 0)."""
    _, e = torch.frexp(exact)
    ulp = torch.ldexp(torch.ones_like(exact), (e - 24).clamp(min=-149))
    return (got.double() - exact).abs() / ulp


def test_det_log_accuracy_on_every_noise_input():
    u = torch.arange(2 ** 23, dtype=torch.int64).to(torch.float32) * 2.0 ** -23 + 2.0 ** -24  # the whole u grid
    lu = det_log(u)
    assert _ulps(lu, torch.log(u.double())).max() <= 2
    v = -lu  # the second log's inputs, (0, 16.7]
    assert (v > 0).all()
    assert _ulps(det_log(v), torch.log(v.double())).max() <= 2
    g = -det_log(v)
    assert torch.isfinite(g).all() and -2.82 < g.min() < -2.81 and 16.6 < g.max() < 16.7
    # the bounds sample_keyed prunes with hold for every noise value
    assert NOISE_LO < g.min() and g.max() < NOISE_HI
    # random positive normal and subnormal floats (all exponents)
    bits = torch.randint(1, 0x7F800000, (1 << 20,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    x = bits.view(torch.float32)
    x64 = torch.where(bits < 0x00800000, bits.double() * 2.0 ** -149, x.double())  # no float op on subnormals
    assert _ulps(det_log(x), torch.log(x64)).max() <= 2
    special = det_log(torch.tensor([0.0, -0.0, -1.0, float("inf"), float("nan"), 1.0]))
    assert special[:2].tolist() == [float("-inf")] * 2 and special[2:5].isnan().tolist() == [True, False, True]
    assert special[3] == float("inf") and special[5] == 0.0


def test_detmath_bits_do_not_depend_on_flush_denormal():
    """The engine turns flush-to-zero on for CPU speed, GPUs keep subnormals: same bits either way."""
    def flushing() -> bool:
        return (torch.tensor([1e-39], dtype=torch.float32) * 1.0).item() == 0.0

    u = torch.arange(0, 2 ** 23, 7).to(torch.float32) * 2.0 ** -23 + 2.0 ** -24
    bits = torch.randint(-(2 ** 31), 2 ** 31 - 1, (1 << 18,), generator=torch.Generator().manual_seed(2),
                         dtype=torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.tensor([1e-40, -1e-40, -1e-20, 1e-45, -1e-38])])
    run = lambda: [(-det_log(-det_log(u))).view(torch.int32), det_log(x).view(torch.int32),  # noqa: E731
                   det_exp(x).view(torch.int32), det_exp(torch.linspace(-90, 90, 1 << 18)).view(torch.int32)]
    before = flushing()
    try:
        torch.set_flush_denormal(False)
        keep = run()
        torch.set_flush_denormal(True)
        flush = run()
    finally:
        torch.set_flush_denormal(before)
    for a, b in zip(keep, flush):
        nan = torch.isnan(a.view(torch.float32))
        assert torch.equal(a[~nan], b[~nan]) and torch.isnan(b.view(torch.float32))[nan].all()


def test_det_exp_accuracy_and_exact_one():
    x = torch.cat([torch.linspace(-87, 88, 1 << 22, dtype=torch.float32),
                   -torch.rand(1 << 18, generator=torch.Generator().manual_seed(1)) * 1e-3])
    assert _ulps(det_exp(x), torch.exp(x.double())).max() <= 2
    edge = torch.tensor([0.0, -0.0, -1e-30, 1e-30, -87.5, 88.5, float("-inf"), float("inf"), float("nan")])
    out = det_exp(edge)
    assert out[:4].tolist() == [1.0, 1.0, 1.0, 1.0]  # exactly 1 at 0: the top-p weight of the max token
    assert out[4:8].tolist() == [0.0, float("inf"), 0.0, float("inf")] and out[8].isnan()
    # monotone on the top-p domain (s - max in [-17, 0]): a coarser check of the polynomial
    y = det_exp(torch.linspace(-17, 0, 1 << 20, dtype=torch.float32))
    assert (y[1:] >= y[:-1]).all()
    with pytest.raises(TypeError, match="float32"):
        det_exp(torch.zeros(2, dtype=torch.float64))


def test_noise_deterministic_and_keyed():
    base = _noise()
    assert torch.equal(base, _noise())
    for change in [dict(seed=8), dict(step=4), dict(uid=12), dict(sidx=3), dict(pos=6)]:
        other = _noise(**change)
        assert (other != base).float().mean() > 0.9, change
    # a row's noise does not depend on which other rows are in the batch
    uid = torch.arange(10)
    full = gumbel_noise(1, 2, uid, uid * 0, uid + 3, 50, torch.float64)
    assert torch.equal(full[4:5], gumbel_noise(1, 2, uid[4:5], uid[4:5] * 0, uid[4:5] + 3, 50, torch.float64))
    # cast to the requested dtype
    assert _noise(dtype=torch.bfloat16).dtype == torch.bfloat16


def test_gumbel_distribution():
    n = 2000
    uid = torch.arange(n)
    g = gumbel_noise(0, 0, uid, torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), 500,
                     torch.float64)
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - 0.5772156649) < 0.01  # Euler-Mascheroni; SE ~ 0.0018
    assert abs(g.var().item() - math.pi ** 2 / 6) < 0.03
    # CDF exp(-exp(-x)) at a few points
    for x in (-1.0, 0.0, 1.0, 3.0):
        assert abs((g <= x).double().mean().item() - math.exp(-math.exp(-x))) < 0.005


def test_sampling_frequencies_follow_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0], dtype=torch.float64)
    temp, n = 0.7, 30000
    uid = torch.arange(n)
    z = torch.zeros(n, dtype=torch.int64)
    noise = gumbel_noise(42, 1, uid, z, z, 6, torch.float64)
    out = sample(logits.expand(n, 6), noise, temp)
    counts = torch.bincount(out.tokens, minlength=6).double()
    expected = torch.softmax(logits / temp, -1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5  # chi-square, 5 dof: p = 0.001


def test_top_k_then_top_p_sampling_frequencies():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0], dtype=torch.float64)
    n = 20000
    uid = torch.arange(n)
    z = torch.zeros(n, dtype=torch.int64)
    noise = gumbel_noise(3, 0, uid, z, z, 6, torch.float64)
    out = sample(logits.expand(n, 6), noise, 1.0, top_k=3)
    counts = torch.bincount(out.tokens, minlength=6).double()
    assert counts[[2, 3, 4]].sum() == 0  # outside the top 3 {5, 0, 1}
    expected = torch.softmax(logits[[0, 1, 5]], -1) * n
    chi2 = ((counts[[0, 1, 5]] - expected) ** 2 / expected).sum().item()
    assert chi2 < 13.8  # 2 dof, p = 0.001


def test_filter_top_k_top_p_hand_computed():
    lg = torch.tensor([[2.0, 1.0, 0.0, 3.0]], dtype=torch.float64)
    inf = float("-inf")
    # top-k=2 keeps ids 3 and 0
    assert filter_logits(lg, 1.0, 2, 1.0).tolist() == [[2.0, inf, inf, 3.0]]
    # temperature scales before filtering
    assert filter_logits(lg, 0.5, 0, 1.0).tolist() == [[4.0, 2.0, 0.0, 6.0]]
    # probs sorted: 3:0.6439, 0:0.2369, 1:0.0871, 2:0.0321
    assert filter_logits(lg, 1.0, 0, 0.6).tolist() == [[inf, inf, inf, 3.0]]
    assert filter_logits(lg, 1.0, 0, 0.7).tolist() == [[2.0, inf, inf, 3.0]]
    assert filter_logits(lg, 1.0, 0, 0.9).tolist() == [[2.0, 1.0, inf, 3.0]]
    assert filter_logits(lg, 1.0, 0, 0.01).tolist() == [[inf, inf, inf, 3.0]]  # at least one
    # top-p on the renormalised top-k: top-2 probs 0.731, 0.269 -> 0.75 needs both
    assert filter_logits(lg, 1.0, 2, 0.75).tolist() == [[2.0, inf, inf, 3.0]]
    assert filter_logits(lg, 1.0, 2, 0.7).tolist() == [[inf, inf, inf, 3.0]]
    # ties: lower token id wins the last top-k place
    tie = torch.tensor([[1.0, 5.0, 1.0, 1.0]], dtype=torch.float64)
    assert filter_logits(tie, 1.0, 2, 1.0).tolist() == [[1.0, 5.0, inf, inf]]
    # per-row parameters
    two = torch.cat([lg, lg])
    out = filter_logits(two, torch.tensor([1.0, 1.0]), torch.tensor([1, 0]), torch.tensor([1.0, 0.9]))
    assert out.tolist() == [[inf, inf, inf, 3.0], [2.0, 1.0, inf, 3.0]]
    # per-row temperatures, one row at T = 1 (which the division skips) and T = 0 read as 1
    out = filter_logits(torch.cat([lg, lg, lg]), torch.tensor([1.0, 2.0, 0.0]), 0, 1.0)
    assert out.tolist() == [[2.0, 1.0, 0.0, 3.0], [1.0, 0.5, 0.0, 1.5], [2.0, 1.0, 0.0, 3.0]]
    # top_p = 1 keeps even tokens whose cumulative mass rounds to 1
    far = torch.tensor([[0.0, -60.0, -80.0]], dtype=torch.float32)
    assert torch.isfinite(filter_logits(far, 1.0, 0, 1.0)).all()


def _documented_top_p(scaled: torch.Tensor, k: int, p: float) -> list[bool]:
    """The module docstring's top-k / top-p rule for one row s = logits / T, written out with
    Python ints and floats."""
    s = scaled.tolist()
    order = sorted(range(len(s)), key=lambda v: (-s[v], v))
    rank = {v: r for r, v in enumerate(order)}
    in_k = [k == 0 or rank[v] < k for v in range(len(s))]
    w = det_exp((scaled - scaled.max()).to(torch.float32)).tolist()  # difference in the logits' dtype
    q = [int(w[v] * 2 ** 24) if in_k[v] else 0 for v in range(len(s))]
    z = sum(q)
    above = {v: sum(q[u] for u in order[: rank[v]]) for v in range(len(s))}
    return [in_k[v] and (p >= 1.0 or float(above[v]) < p * float(z) or rank[v] == 0) for v in range(len(s))]


def test_top_p_integer_criterion():
    # two equal logits: q = 2**24 each, Z = 2**25; p = 0.5 puts the second exactly at p * Z
    two = torch.tensor([[0.0, 0.0, -30.0]], dtype=torch.float64)
    inf = float("-inf")
    assert filter_logits(two, 1.0, 0, 0.5).tolist() == [[0.0, inf, inf]]  # ties: lower id ranks first
    assert filter_logits(two, 1.0, 0, 0.5 + 1e-9).tolist() == [[0.0, 0.0, inf]]
    # exp(-30) * 2**24 < 1: q = 0, so no p < 1 ever reaches that token; p = 1 (off) keeps it
    assert filter_logits(two, 1.0, 0, 0.999999).tolist() == [[0.0, 0.0, inf]]
    assert filter_logits(two, 1.0, 0, 1.0).tolist() == two.tolist()
    # top-p mass is over the top-k set only
    three = torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=torch.float32)
    assert filter_logits(three, 1.0, 2, 0.6).tolist() == [[1.0, 1.0, inf, inf]]  # 2nd: above = 1/2 Z
    assert filter_logits(three, 1.0, 2, 0.5).tolist() == [[1.0, inf, inf, inf]]
    # -0.0 and 0.0 tie (ranked by id), temperature applied before the weights
    signed = torch.tensor([[-0.0, 0.0, -1.0]], dtype=torch.float64)
    assert filter_logits(signed, 2.0, 1, 1.0)[0, :2].tolist() == [-0.0, inf]
    # random rows (dtype, ties, temperature, top-k) against the criterion written out in Python
    gen = torch.Generator().manual_seed(5)
    for trial in range(40):
        dtype = (torch.float32, torch.float64)[trial % 2]
        x = ((torch.randn(1, 30, generator=gen) * 8).round() / 4).to(dtype)
        t, k, p = [0.5, 1.0, 1.7][trial % 3], [0, 1, 4, 7][trial % 4], [0.2, 0.6, 0.9, 0.99][trial % 4 - 1]
        got = (filter_logits(x, t, k, p) != inf)[0].tolist()
        assert got == _documented_top_p((x / torch.tensor(t, dtype=dtype))[0], k, p), trial


def test_greedy_is_argmax_and_stats():
    torch.manual_seed(0)
    logits = torch.randn(8, 30, dtype=torch.float64)
    noise = torch.randn(8, 30, dtype=torch.float64) * 10  # huge noise must be ignored by greedy rows
    temp = torch.tensor([0.0, 1.0] * 4, dtype=torch.float64)
    out = sample(logits, noise, temp, torch.tensor([0, 5] * 4), 1.0)
    assert torch.equal(out.tokens[0::2], logits[0::2].argmax(-1))
    assert torch.equal(out.tokens[1::2], (filter_logits(logits, 1.0, 5, 1.0) + noise)[1::2].argmax(-1))
    logp = torch.log_softmax(logits, -1)  # T = 1 for both kinds of rows here
    assert torch.allclose(out.logprobs, logp.gather(1, out.tokens[:, None])[:, 0])
    assert torch.allclose(out.entropies, -(logp.exp() * logp).sum(-1))
    # logprob/entropy use the temperature of sampling rows
    out2 = sample(logits, noise, 0.5)
    logp2 = torch.log_softmax(logits / 0.5, -1)
    assert torch.allclose(out2.logprobs, logp2.gather(1, out2.tokens[:, None])[:, 0])
    assert torch.allclose(out2.entropies, -(logp2.exp() * logp2).sum(-1))


def test_sampling_params_validation():
    SamplingParams(temperature=0.0, top_k=3, top_p=0.5, max_new_tokens=1, stop_token_ids=(1, 2))
    for kw, name in [(dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
                     (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                     (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop_token_ids=(-1,)), "stop_token_ids")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kw)
    assert SamplingParams(stop_token_ids=[1, 2]).stop_token_ids == (1, 2)
