"""Worker for test_sequence_parallel.py, run under torchrun on 2 processes with argv = (out_dir,
torch_dist_dir) (on 4: the same at TP=2 x PP=2, fp64 only, without the start from torch_dist_dir).

For each dtype (float64, float32), each of shard_worker's ``CASES`` and sequence parallelism off
and on, every rank builds a TP=2 trainer from the same seeded weights and trains it for
shard_worker's 2 GRPO steps (old logprobs, loss, grad norm per step), then saves the trained
weights (HF names, gathered) and the logprobs of the trained model to ``out_dir/rank<r>.pt``.
One launch for all: starting processes and importing Megatron costs far more than the tiny
models. Last, a TP=2 trainer with sequence parallelism starts from ``torch_dist_dir`` (written by
``megarl convert hf-to-torch-dist`` at TP=1) and saves the weights it holds. The test asserts."""
import dataclasses
import os
import sys
import warnings
from pathlib import Path

import torch

if __package__:
    from .shard_worker import CASES, case_args, train_batch, train_steps
    from .test_model import reference
else:  # run by torchrun as a script
    warnings.simplefilter("ignore")  # Megatron warns about missing apex/TE at import
    sys.path.insert(0, str(Path(__file__).parent))
    from shard_worker import CASES, case_args, train_batch, train_steps
    from test_model import reference

from megarl.parallel.dist import init_parallel, teardown
from megarl.trainer.trainer import Trainer, TrainerConfig

DTYPES = ("float64", "float32")


def run(sp: bool, dtype: str, pp: int = 1) -> dict:
    dims = init_parallel(tp=2, pp=pp, sequence_parallel=sp)
    out = {}
    for case in CASES:
        args = case_args(*case)
        cfg = TrainerConfig(lr=1e-2, micro_batch_size=2, dtype=dtype, clip_grad=0.3, weight_decay=0.1)
        trainer = Trainer(args, cfg, dims, hf_state=reference(args, seed=3, dtype=getattr(torch, dtype))
                          .hf_state_dict(), seed=0)
        assert trainer.gpt.config.sequence_parallel == sp
        steps = train_steps(trainer, args)
        batch = train_batch(args, 5)
        out[case] = {"train": steps, "trained_hf": trainer.hf_state_dict(),
                     "logprobs": trainer.masked_logprobs(batch["input_ids"], batch["loss_mask"]),
                     "all_logprobs": trainer.token_logprobs(batch["input_ids"][:3, :11])}
    teardown(dataclasses.replace(dims, owns_process_group=False))  # keep the process group for the next run
    return out


def start_from(folder: str) -> dict:
    """The weights of a TP=2 (sequence-parallel) trainer started from torch_dist ``folder``."""
    from megarl.models.config import ModelArgs
    from megarl.trainer.dist_convert import checkpoint_hf_config

    dims = init_parallel(tp=2, sequence_parallel=True)
    args = ModelArgs.from_hf_config(checkpoint_hf_config(folder))
    hf = Trainer(args, TrainerConfig(), dims, mcore_dir=folder, seed=1).hf_state_dict()
    teardown(dataclasses.replace(dims, owns_process_group=False))
    return hf


def main(out_dir: str, torch_dist_dir: str) -> None:
    if int(os.environ["WORLD_SIZE"]) == 4:  # TP=2 x PP=2 (1F1B): fp64 only
        results = {("float64", sp): run(sp, "float64", pp=2) for sp in (False, True)}
    else:
        results = {(dtype, sp): run(sp, dtype) for dtype in DTYPES for sp in (False, True)}
        results["started_from_torch_dist"] = start_from(torch_dist_dir)
    torch.save(results, Path(out_dir) / f"rank{torch.distributed.get_rank()}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
