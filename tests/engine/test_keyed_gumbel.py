"""The C++ kernel's AVX-512 path (csrc/keyed_gumbel.cpp) picks the tokens of its scalar path and
of the full-noise torch reference on rows built to stress it: exact ties (more of them than the
probe holds), -inf (filtered) tokens, the largest finite and subnormal scores, +inf, NaN, and
vocabulary sizes around multiples of 16 (the tail lanes); the noise, and the bound both paths
prune with before taking logarithms, are checked on every value."""
import numpy as np
import pytest
import torch

from megarl.engine import sampler
from megarl.engine.sampler import gumbel_noise, sample

native = sampler._native
pytestmark = pytest.mark.skipif(native is None, reason=f"megarl._keyed_gumbel is not built: {sampler._NATIVE_ERROR}")
needs_avx512 = pytest.mark.skipif(native is not None and not native.avx512, reason="this CPU has no AVX-512")
PATHS = [False, pytest.param(True, marks=needs_avx512)]  # the kernel's vector argument
BIG = {torch.float32: 2.0 ** 30, torch.float64: 2.0 ** 60}  # s + g rounds back to s: exact score ties


def _stress_rows(v: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """One row per hazard, [R, v]."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda scale: (torch.randn(v, generator=g, dtype=torch.float64) * scale).to(dtype)  # noqa: E731
    big, fmax = BIG[dtype], torch.finfo(dtype).max
    rows = [rand(1.0), rand(0.01), rand(30.0), torch.zeros(v, dtype=dtype), torch.full((v,), -float("inf"), dtype=dtype)]
    tied = rand(1.0)  # 40 scattered tokens tie exactly at the top (more than the 16 probed)
    tied[torch.randperm(v, generator=g)[:40]] = big
    rows.append(tied)
    filtered = torch.full((v,), -float("inf"), dtype=dtype)  # top-k/top-p leftovers: a few finite tokens
    keep = torch.randperm(v, generator=g)[:max(1, v // 50)]
    filtered[keep] = rand(3.0)[keep]
    rows.append(filtered)
    extremes = rand(1.0)
    pick = torch.randperm(v, generator=g)
    extremes[pick[: v // 4]] = fmax
    extremes[pick[v // 4: v // 2]] = -fmax
    extremes[pick[v // 2: 3 * v // 4]] = torch.finfo(dtype).smallest_normal / 8  # subnormal
    rows.append(extremes)
    infs = rand(1.0)
    infs[pick[:3]] = float("inf")  # ties at +inf: the lowest of the three ids
    rows.append(infs)
    last = torch.full((v,), -float("inf"), dtype=dtype)
    last[-1] = 0.0  # the only finite token is in the tail lanes
    rows.append(last)
    return torch.stack(rows)


def _kernel(scores: torch.Tensor, key, vector: bool, threads: int = 1) -> torch.Tensor:
    fn = native.keyed_argmax_f32 if scores.dtype == torch.float32 else native.keyed_argmax_f64
    hi = float(torch.tensor(sampler.NOISE_HI, dtype=scores.dtype))
    return torch.from_numpy(fn(scores.numpy(), 77, 5, *[x.numpy() for x in key], hi, threads, vector))


def _keys(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-(1 << 40), 1 << 40, (n,), generator=g), torch.randint(0, 8, (n,), generator=g),
            torch.randint(0, 1 << 20, (n,), generator=g)]


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("v", [1, 2, 15, 16, 17, 31, 33, 1013, 4099])
def test_vector_equals_scalar_and_torch_on_stress_rows(dtype, v):
    rows = _stress_rows(v, dtype, seed=v)
    rows = rows.repeat(8, 1)  # each hazard under 8 keys
    key = _keys(rows.shape[0], seed=v)
    want = sample(rows, gumbel_noise(77, 5, *key, v, dtype), 1.0).tokens
    assert torch.equal(_kernel(rows, key, vector=False), want)
    assert torch.equal(_kernel(rows, key, vector=True), want)
    assert torch.equal(_kernel(rows, key, vector=True, threads=2), want)


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_vector_equals_scalar_on_many_random_rows(dtype):
    """Flat to peaked rows (every token a candidate, or a few, so full and queued chunks both)."""
    g = torch.Generator().manual_seed(1)
    scale = torch.tensor([0.1, 1.0, 3.0, 8.0, 30.0], dtype=torch.float64).repeat(40)[:, None]
    rows = (torch.randn(200, 3001, generator=g, dtype=torch.float64) * scale).to(dtype)
    key = _keys(200, seed=2)
    got = _kernel(rows, key, vector=True)
    assert torch.equal(got, _kernel(rows, key, vector=False))
    assert torch.equal(got, sample(rows, gumbel_noise(77, 5, *key, 3001, dtype), 1.0).tokens)


@pytest.mark.parametrize("vector", PATHS)
@pytest.mark.parametrize("where", [0, 15, 16, 700, 1012])
def test_a_row_with_nan_is_reported(vector, where):
    """A NaN anywhere (the probe's first 16 tokens, a full chunk, the tail lanes) gives -1, which
    sends the call to the torch path; the other rows keep their tokens."""
    rows = _stress_rows(1013, torch.float32, seed=3)[:4].clone()
    key = _keys(4, seed=4)
    clean = _kernel(rows, key, vector)
    rows[2, where] = float("nan")
    got = _kernel(rows, key, vector)
    assert got[2] == -1
    assert torch.equal(got[[0, 1, 3]], clean[[0, 1, 3]])


@pytest.mark.parametrize("vector", PATHS)
def test_bucket_bound_holds_for_every_noise_value_and_is_tight(vector):
    """The kernel skips a token's logarithms when its score plus the bound of its hash's bucket is
    below the best score: exact only if no noise value exceeds its bound. The table holds the
    noise of each bucket's largest hash prefix, which is the bucket's largest noise only because
    the noise never decreases as the prefix grows: both checked on all 2**23 values. Each bound is
    also the largest noise of its bucket (not looser: on flat rows the bound is what spares nearly
    every token its logarithms)."""
    idx = np.arange(1 << 23, dtype=np.int64)
    g, bound = native.gumbel_values(idx, vector=False), native.gumbel_bounds(idx, vector=vector)
    assert np.all(np.diff(g) >= 0)
    assert (g <= bound).all()
    bucket = np.zeros_like(idx)  # the bit length of d = 2**23 - 1 - idx
    d = (1 << 23) - 1 - idx
    nz = d > 0
    bucket[nz] = np.floor(np.log2(d[nz])).astype(np.int64) + 1
    top = np.full(24, -np.inf, dtype=np.float32)
    np.maximum.at(top, bucket, g)
    assert np.array_equal(bound, top[bucket])
    assert np.all(np.diff(top) < 0)  # buckets nearer u = 1 (smaller d) hold larger noise


@needs_avx512
def test_vector_noise_equals_scalar_on_every_value():
    idx = np.arange(1 << 23, dtype=np.int64)
    assert np.array_equal(native.gumbel_values(idx, vector=True).view(np.int32),
                          native.gumbel_values(idx, vector=False).view(np.int32))
