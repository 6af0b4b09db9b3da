"""Session-wide Megatron parallel state (it is process-global): initialised once, torn down at
the end. Tests receive the ``ParallelDims`` through the ``dims`` fixture."""
from __future__ import annotations

import warnings

import pytest

from megarl.models.config import ModelArgs


@pytest.fixture(scope="session")
def dims():
    from megarl.parallel.dist import init_parallel, teardown

    with warnings.catch_warnings():  # Megatron warns about missing apex/TE at import
        warnings.simplefilter("ignore")
        d = init_parallel(tp=1, pp=1)
    yield d
    teardown(d)


def tiny_args(model_type: str = "qwen2", tie: bool = False, **kw) -> ModelArgs:
    """hidden 32, 2 layers, 4 query heads over 2 kv heads (GQA), vocab 40."""
    base = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=64, tie_word_embeddings=tie, model_type=model_type)
    base.update(kw)
    return ModelArgs(**base)


@pytest.fixture
def make_args():
    """Factory fixture for tiny ``ModelArgs`` (tests call ``make_args('llama', tie=True)``)."""
    return tiny_args

