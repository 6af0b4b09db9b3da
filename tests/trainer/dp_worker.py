"""Worker for test_dp_gloo.py, run under torchrun: two DP ranks each train on half of the batch
and rank 0 saves the resulting HF weights to argv[1]."""
import sys
import warnings
from pathlib import Path

import torch

warnings.simplefilter("ignore")
sys.path.insert(0, str(Path(__file__).parent))

from tests.conftest import tiny_args  # noqa: E402
from test_trainer import make_batch, nll_loss  # noqa: E402

from megarl.parallel.dist import init_parallel, teardown  # noqa: E402
from megarl.trainer.trainer import Trainer, TrainerConfig  # noqa: E402


def main(out: str) -> None:
    dims = init_parallel()
    assert dims.dp == 2, dims
    args = tiny_args("qwen2")
    batch = make_batch(args)
    rows = slice(dims.dp_rank * 3, dims.dp_rank * 3 + 3)
    half = {k: (v[rows] if v.dim() else v) for k, v in batch.items()}
    tr = Trainer(args, TrainerConfig(lr=1e-2, micro_batch_size=2, dtype="float64"), dims, seed=5)
    metrics = [tr.train_step(half, nll_loss) for _ in range(2)]
    if dims.rank == 0:
        torch.save({"weights": tr.hf_state_dict(), "metrics": metrics}, out)
    teardown(dims)


if __name__ == "__main__":
    main(sys.argv[1])
