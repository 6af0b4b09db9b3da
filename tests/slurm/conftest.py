"""Session fixture: a real single-node Slurm (tests/slurm/cluster.py).

Without Slurm (not installed, not root) the tests that need it skip, naming the reason; with
``MEGARL_REQUIRE_SLURM=1`` (set by .ci/run, which installs Slurm first) they fail instead, so CI
cannot pass without running them."""
import os

import pytest

from tests.slurm.cluster import SlurmUnavailable, start


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    try:
        cluster = start(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as e:
        if os.environ.get("MEGARL_REQUIRE_SLURM") == "1":
            pytest.fail(f"MEGARL_REQUIRE_SLURM=1 but Slurm cannot run here: {e}")
        pytest.skip(f"no single-node Slurm: {e}")
    yield cluster
    cluster.stop()
