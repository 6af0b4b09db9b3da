"""``sample_keyed`` (greedy rows without noise, the other rows hashing only the tokens that can
win) gives exactly the tokens of the full-noise reference ``sample(logits, gumbel_noise(...))``,
on each of its paths: torch ops, and the fused C++ kernel (csrc/keyed_gumbel.cpp) on its scalar
and its AVX-512 path (the noise of both is also compared with torch's on every one of the 2**23
values)."""
from types import SimpleNamespace

import pytest
import torch

from megarl.engine import sampler
from megarl.engine.sampler import gumbel_noise, sample, sample_keyed

NATIVE_BUILT = sampler._native is not None
PATHS = {"torch": (False, False), "scalar": (True, False), "avx512": (True, True)}  # (USE_NATIVE, NATIVE_VECTOR)


@pytest.fixture(autouse=True, params=list(PATHS))
def path(request, monkeypatch):
    """Every test below runs on the torch path and on both paths of the C++ kernel (skipped only
    if it is not built, or for the AVX-512 one, if this CPU lacks AVX-512)."""
    native, vector = PATHS[request.param]
    if native and not NATIVE_BUILT:
        pytest.skip(f"megarl._keyed_gumbel is not built: {sampler._NATIVE_ERROR}")
    if vector and not sampler._native.avx512:
        pytest.skip("this CPU has no AVX-512")
    monkeypatch.setattr(sampler, "USE_NATIVE", native)
    monkeypatch.setattr(sampler, "NATIVE_VECTOR", vector)
    return request.param


def test_native_noise_equals_torch_on_every_value(path):
    """The kernel's noise of each of the 2**23 possible hash prefixes, bit for bit torch's
    ``_gumbel`` (float32 op by op: a fused multiply-add or another log would show here)."""
    if path == "torch":
        pytest.skip("a property of the kernel")
    idx = torch.arange(1 << 23, dtype=torch.int64)
    got = torch.from_numpy(sampler._native.gumbel_values(idx.numpy(), vector=path == "avx512"))
    want = torch.cat([sampler._gumbel(c << 9, torch.float32) for c in idx.split(1 << 20)])
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_the_path_in_use_is_the_one_asked_for(path, monkeypatch):
    """The fixture's switch really selects the path (else the two runs would test one thing)."""
    calls = []
    monkeypatch.setattr(sampler, "_pruned_argmax", lambda *a: calls.append(1) or torch.zeros(2, dtype=torch.int64))
    sample_keyed(torch.randn(2, 50), 1.0, 0, 1.0, 1, 2, torch.arange(2), torch.zeros(2, dtype=torch.int64),
                 torch.arange(2))
    assert bool(calls) == (path == "torch")
    if path != "torch":  # and the kernel is asked for the path of the fixture
        real, seen = sampler._native, []
        monkeypatch.setattr(sampler, "_native", SimpleNamespace(
            keyed_argmax_f32=lambda *a: seen.append(a[-1]) or real.keyed_argmax_f32(*a)))
        sample_keyed(torch.randn(2, 50), 1.0, 0, 1.0, 1, 2, torch.arange(2), torch.zeros(2, dtype=torch.int64),
                     torch.arange(2))
        assert seen == [path == "avx512"]


def _case(n, v, dtype, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype)
    temp = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.5, 3.0], dtype=dtype)[torch.randint(0, 6, (n,), generator=g)]
    top_k = torch.tensor([0, 0, 1, 5, 40])[torch.randint(0, 5, (n,), generator=g)]
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.9, 0.99], dtype=torch.float64)[torch.randint(0, 5, (n,), generator=g)]
    key = [torch.randint(0, 1 << 40, (n,), generator=g), torch.randint(0, 8, (n,), generator=g),
           torch.randint(0, 500, (n,), generator=g)]
    return logits, temp, top_k, top_p, key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 6.0, 20.0])  # flat (every token a candidate) to peaked (a few)
def test_keyed_equals_full_noise(dtype, scale):
    logits, temp, top_k, top_p, key = _case(200, 2000, dtype, scale, seed=int(scale))
    full = sample(logits, gumbel_noise(5, 9, *key, logits.shape[1], dtype), temp, top_k, top_p).tokens
    assert torch.equal(sample_keyed(logits, temp, top_k, top_p, 5, 9, *key), full)
    # the same on the non-greedy rows alone (no greedy row to skip) and with scalar parameters
    hot = temp != 0
    sub = [x[hot] for x in key]
    ref = sample(logits[hot], gumbel_noise(5, 9, *sub, logits.shape[1], dtype), 1.0).tokens
    assert torch.equal(sample_keyed(logits[hot], 1.0, 0, 1.0, 5, 9, *sub), ref)


def test_keyed_ties_and_special_values():
    """Rows of equal logits (every token ties), NaN and +-inf logits: the same picks as the full row."""
    v = 64
    logits = torch.zeros(6, v, dtype=torch.float32)
    logits[1, 7] = float("nan")
    logits[2, 9] = logits[2, 30] = float("inf")
    logits[3] = float("-inf")
    logits[4, :10] = 50.0  # ten tied leaders far above the rest
    logits[5, 3] = -float("inf")
    key = [torch.arange(6), torch.zeros(6, dtype=torch.int64), torch.arange(6) * 3]
    full = sample(logits, gumbel_noise(1, 2, *key, v, torch.float32), 1.0).tokens
    assert torch.equal(sample_keyed(logits, 1.0, 0, 1.0, 1, 2, *key), full)
    # without the NaN row (which sends a whole call to the torch path), the kernel takes the rest
    keep = torch.tensor([0, 2, 3, 4, 5])
    sub = [x[keep] for x in key]
    assert torch.equal(sample_keyed(logits[keep], 1.0, 0, 1.0, 1, 2, *sub), full[keep])


def test_keyed_bounds_matter(monkeypatch):
    """A noise range narrower than the real one prunes tokens that do win: the check has teeth."""
    logits, temp, top_k, top_p, key = _case(200, 2000, torch.float32, 6.0, seed=6)
    full = sample(logits, gumbel_noise(5, 9, *key, 2000, torch.float32), temp, top_k, top_p).tokens
    monkeypatch.setattr(sampler, "NOISE_HI", 0.0)
    assert not torch.equal(sample_keyed(logits, temp, top_k, top_p, 5, 9, *key), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_winner_with_the_largest_noise_far_below_the_probed_tokens(dtype):
    """The candidate bound at its tightest: the winner is a token ~15 nats below the ``PROBE``
    highest logits, carried by the largest noise value among 4M keys (g* ~ 15, near NOISE_HI),
    and the probed tokens' best score sits just below its score. A bound tighter than the noise
    range (e.g. NOISE_HI - 1) drops the winner and picks a probed token."""
    v, positions = 1 << 16, 64
    key = [torch.zeros(positions, dtype=torch.int64), torch.zeros(positions, dtype=torch.int64),
           torch.arange(positions)]
    noise = gumbel_noise(3, 4, *key, v, dtype)
    row = int(noise.max(dim=1).values.argmax())
    winner, g_star = int(noise[row].argmax()), float(noise[row].max())
    assert g_star > sampler.NOISE_HI - 2.0  # the search found a value that tests the bound
    probed = torch.tensor([t for t in range(sampler.PROBE + 1) if t != winner][:sampler.PROBE])
    logits = torch.full((1, v), float("-inf"), dtype=dtype)
    logits[0, winner] = 0.0
    logits[0, probed] = g_star - float(noise[row, probed].max()) - 0.01  # best probed score: g* - 0.01
    one = [x[row:row + 1] for x in key]
    full = sample(logits, gumbel_noise(3, 4, *one, v, dtype), 1.0).tokens
    assert full.tolist() == [winner]
    assert sample_keyed(logits, 1.0, 0, 1.0, 3, 4, *one).tolist() == [winner]


def test_keys_at_their_extremes():
    """Negative uids (two's complement words), a 64-bit seed, a step past 2**32 and large positions:
    the kernel's key words are the documented ones."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 3000, generator=g) * 4
    key = [torch.tensor([-1, -5, -(1 << 40), 7, (1 << 62) + 3, 0, -2, 1]), torch.arange(8) * 1000,
           torch.tensor([0, 1, 2, (1 << 31) + 5, 4000, 77, 1 << 33, 9])]
    for seed, step in (((1 << 64) - 1, (1 << 32) + 7), (-3, -1), (0, 0)):
        full = sample(logits, gumbel_noise(seed, step, *key, 3000, torch.float32), 1.0).tokens
        assert torch.equal(sample_keyed(logits, 1.0, 0, 1.0, seed, step, *key), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", ["two tokens", "full chunk"])
def test_lowest_id_wins_a_tie_the_probe_does_not_see(dtype, chunk):
    """Scores that tie by rounding (spacing 4 at 2**25 in float32, 2**54 in float64): 16 tokens at
    ``a`` with noise < -2 (the probed ones) all score ``a - 4``, and so do lower-id tokens at ``a - 4``
    with |noise| < 2, found later in the scan, in one chunk of 16: two of them (a partly pruned
    chunk) or the whole chunk. The lowest id of those wins, not the probed token nor a later lane."""
    v = (1 << 16) + 5
    key = [torch.tensor([9]), torch.tensor([1]), torch.tensor([4])]
    g = gumbel_noise(1, 2, *key, v, torch.float32)[0]
    a = 2.0 ** (25 if dtype == torch.float32 else 54) + 64
    low = (g < -2.01).nonzero()[:, 0]
    probed = low[low >= v // 2][:16]  # high ids
    small = (g.abs() < 1.99).view(-1)[: v // 2 // 16 * 16].view(-1, 16)
    logits = torch.full((1, v), -float("inf"), dtype=dtype)
    logits[0, probed] = a
    if chunk == "full chunk":
        c = int(small.all(dim=1).nonzero()[0, 0])
        tied = torch.arange(16 * c, 16 * c + 16)
    else:
        c = int((small.sum(dim=1) >= 2).nonzero()[3, 0])
        tied = (16 * c + small[c].nonzero()[:, 0])[:2]
    logits[0, tied] = a - 4
    full = sample(logits, gumbel_noise(1, 2, *key, v, dtype), 1.0).tokens
    assert len(probed) == 16 and full.tolist() == [int(tied[0])]
    assert sample_keyed(logits, 1.0, 0, 1.0, 1, 2, *key).tolist() == [int(tied[0])]
