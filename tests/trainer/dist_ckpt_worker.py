"""Worker for test_dist_ckpt.py, run under torchrun on 2 ranks.

``save OUT TP PP DISTOPT DTYPE``: 2 steps, an RL checkpoint (trainer.checkpoint_format=torch_dist:
its trainer/ folder a Megatron distributed checkpoint) in OUT/run, 2 more steps; rank 0 saves the
final weights (HF names) to OUT/uninterrupted.pt and the saved ones (Megatron names, whole) to
OUT/saved_mcore.pt.
``resume OUT TP PP DISTOPT DTYPE``: a trainer from other weights loads that checkpoint (written in
any layout) and takes the last 2 steps; rank 0 saves its weights to OUT/resumed_tp<TP>_pp<PP>.pt.
``plain OUT`` (1 rank): Megatron-core's own ``load_plain_tensors`` of the trainer/ folder into OUT/plain.pt.
Every step trains on the same 6 rows, split over the data-parallel ranks."""
import sys
import warnings
from pathlib import Path

import torch

warnings.simplefilter("ignore")
sys.path.insert(0, str(Path(__file__).parent))

from tests.conftest import tiny_args  # noqa: E402
from test_trainer import make_batch, nll_loss  # noqa: E402

from megarl.checkpoint.rl_state import load_checkpoint, save_checkpoint  # noqa: E402
from megarl.parallel.dist import init_parallel, teardown  # noqa: E402
from megarl.trainer.trainer import Trainer, TrainerConfig  # noqa: E402


CKPT = "run/checkpoints/step_000002"


def plain_load(out: str) -> None:
    """Megatron-core alone (no megarl code, no megarl patches), one process: every tensor of
    the checkpoint's trainer/ folder, whole, saved to OUT/plain.pt."""
    from megatron.core import dist_checkpointing

    torch.distributed.init_process_group("gloo")
    tensors = dist_checkpointing.load_plain_tensors(str(Path(out) / CKPT / "trainer"))
    torch.save(tensors, Path(out) / "plain.pt")
    torch.distributed.destroy_process_group()


def main(mode: str, out: str, tp: str, pp: str, dist_opt: str, dtype: str) -> None:
    dims = init_parallel(tp=int(tp), pp=int(pp))
    args = tiny_args("qwen2", tie=False)
    per = 6 // dims.dp
    rows = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
    batches = [{k: (v[rows] if v.dim() else v) for k, v in make_batch(args, seed=s).items()} for s in range(4)]
    cfg = TrainerConfig(lr=1e-2, weight_decay=0.1, micro_batch_size=2, dtype=dtype,
                        distributed_optimizer=dist_opt == "1", checkpoint_format="torch_dist")
    out = Path(out)
    if mode == "save":
        tr = Trainer(args, cfg, dims, seed=5)
        for b in batches[:2]:
            tr.train_step(b, nll_loss)
        save_checkpoint(out / "run", 2, tr.checkpoint_state(), {"marker": 1}, dims=dims)
        saved = tr.mcore_state_dict()  # what a plain Megatron load of the folder must give
        if dims.rank == 0:
            torch.save(saved, out / "saved_mcore.pt")
        for b in batches[2:]:
            tr.train_step(b, nll_loss)
        weights = tr.hf_state_dict()
        if dims.rank == 0:
            torch.save(weights, out / "uninterrupted.pt")
    else:
        tr = Trainer(args, cfg, dims, seed=77)
        trainer_state, loop_state = load_checkpoint(out / CKPT, dims)
        assert loop_state["marker"] == 1, loop_state
        tr.load_state_dict(trainer_state)
        assert tr.steps_done == 2, tr.steps_done
        for b in batches[2:]:
            tr.train_step(b, nll_loss)
        weights = tr.hf_state_dict()
        if dims.rank == 0:
            torch.save(weights, out / f"resumed_tp{tp}_pp{pp}.pt")
    teardown(dims)


if __name__ == "__main__":
    plain_load(sys.argv[2]) if sys.argv[1] == "plain" else main(*sys.argv[1:])
