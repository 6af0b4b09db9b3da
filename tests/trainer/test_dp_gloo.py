"""Data parallelism over gloo: DP=2 (half the batch each) gives the DP=1 weights, in fp64."""
from pathlib import Path

import pytest
import torch

from megarl.trainer.trainer import Trainer, TrainerConfig

from tests.torchrun import torchrun
from .test_trainer import cpu_fp64_trainer, make_batch, nll_loss


@pytest.mark.multiproc
@cpu_fp64_trainer
def test_dp2_matches_dp1(dims, make_args, tmp_path):
    out = tmp_path / "dp2.pt"
    torchrun(Path(__file__).parent / "dp_worker.py", 2, str(out))
    dp2 = torch.load(out)

    args = make_args("qwen2")
    tr = Trainer(args, TrainerConfig(lr=1e-2, micro_batch_size=2, dtype="float64"), dims, seed=5)
    batch = make_batch(args)
    metrics = [tr.train_step(batch, nll_loss) for _ in range(2)]
    for m1, m2 in zip(metrics, dp2["metrics"]):  # metrics are summed over DP ranks
        assert abs(m1["loss"] - m2["loss"]) < 1e-12 and m1["tokens"] == m2["tokens"]
    w1 = tr.hf_state_dict()
    assert max((w1[k] - dp2["weights"][k]).abs().max().item() for k in w1) < 1e-12
