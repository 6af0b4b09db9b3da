"""vLLM's process groups on every process (megarl/engine/vllm_groups.py): processes that have made
different numbers of groups are named before vLLM builds its own (one 2-process launch, no vLLM).
That trainer-only processes join the groups of the generating processes' vLLM is tested in whole
runs (tests/test_vllm_parallel_run.py, disaggregated placement)."""
from pathlib import Path

import pytest

from tests.torchrun import torchrun


@pytest.mark.multiproc
def test_different_group_counts_fail_on_every_process():
    torchrun(Path(__file__).parent / "vllm_groups_worker.py", 2)
