"""``EngineConfig.static_shapes`` (megarl/engine/static_step.py): decode/verify over rows and
tokens padded to fixed buckets, the step a CUDA graph would capture, gives the engine's own tokens
and logprobs (fp64), with and without drafts; padding never writes into a request's blocks."""
import pytest
import torch

from megarl.engine.static_step import BATCH_BUCKETS, TOKEN_BUCKETS, bucket
from megarl.spec.config import SpecConfig
from megarl.spec.speculator import Speculator
from tests.engine.test_engine import engine, key, mixed_requests


def test_buckets():
    assert [bucket(n, BATCH_BUCKETS, 64) for n in (1, 3, 5, 64, 65)] == [1, 4, 8, 64, 65]
    assert bucket(3, BATCH_BUCKETS, 3) == 3  # never more rows than the engine runs
    assert [bucket(n, TOKEN_BUCKETS, 9) for n in (1, 4, 9)] == [1, 5, 9]


@pytest.mark.parametrize("max_batch_size", [3, 5])  # 3: buckets 1, 2, 3 (capped); 5: padded to 4 and 5
def test_static_shapes_give_the_engines_tokens(max_batch_size):
    reqs = mixed_requests(20)  # greedy, T != 1, top-k, top-p, stops, lengths 1-14
    ref = engine(max_batch_size=max_batch_size, kv_cache="paged", kv_block_size=4).generate(reqs, step=3)
    eng = engine(max_batch_size=max_batch_size, kv_cache="paged", kv_block_size=4, static_shapes=True)
    out = eng.generate(reqs, step=3)
    assert [key(r) for r in out] == [key(r) for r in ref]
    for a, b in zip(out, ref):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-10)
        assert a.entropies == pytest.approx(b.entropies, abs=1e-10)
    assert len(eng.static._buffers) > 1  # several buckets really ran


def test_static_shapes_with_drafts_padded_to_token_buckets():
    """Bubble drafts from perturbed weights: rows of 1 to K+1 tokens in one step, padded to T, with
    partial acceptance; the padded tokens' k/v go to the scratch block, not to any request."""
    reqs = mixed_requests(16)
    spec_cfg = SpecConfig(enabled=True, sources=("bubble", "group"), forward_cost_tokens=0.0, k_init=4, k_max=4)
    ref = engine(max_batch_size=4, kv_cache="paged", kv_block_size=4).generate(reqs, step=2)
    eng = engine(max_batch_size=4, kv_cache="paged", kv_block_size=4, static_shapes=True)
    eng.spec = Speculator(spec_cfg)
    exact = {k: v.clone() for k, v in eng.model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    eng.load_weights({k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in exact.items()})
    eng.pregenerate(reqs, 2)
    eng.load_weights(exact)
    out = eng.generate(reqs, step=2)
    assert [key(r) for r in out] == [key(r) for r in ref]
    for a, b in zip(out, ref):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-10)
    m = eng.spec.metrics()
    assert 0 < m["spec/accepted"] < m["spec/drafted"]  # drafts were partly accepted
    assert any(t > 1 for _, t in eng.static._buffers)  # verify rows ran in token buckets
    assert all(t in TOKEN_BUCKETS for _, t in eng.static._buffers)  # drafts cut by a row's room included


def test_static_shapes_needs_the_paged_cache():
    with pytest.raises(ValueError, match="kv_cache='paged'"):
        engine(static_shapes=True)


@pytest.mark.gpu
def test_static_shapes_on_cuda_give_the_cpu_engines_tokens():
    """On CUDA (Triton paged attention and verification, block size 16): the CPU engine's tokens."""
    reqs = mixed_requests(12)
    ref = engine(max_batch_size=5, kv_cache="paged", kv_block_size=16).generate(reqs, step=3)
    eng = engine(max_batch_size=5, kv_cache="paged", kv_block_size=16, static_shapes=True, device="cuda")
    assert [key(r) for r in eng.generate(reqs, step=3)] == [key(r) for r in ref]
