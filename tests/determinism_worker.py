"""Worker of tests/test_determinism.py: a few SFT steps of the tiny default model; prints the
weight checksum. argv[1]: 1 = deterministic algorithms on, 0 = off."""
import sys

from megarl.config import load_config
from megarl.parallel.dist import init_parallel, teardown
from megarl.parallel.checksum import tensor_checksum
from megarl.rl.grpo import sft_loss
from megarl.stages.sft import sft_batch
from megarl.setup_run import prepare_inputs
from megarl.trainer.trainer import Trainer
from megarl.train import set_deterministic

if sys.argv[1] == "1":
    set_deterministic()
cfg = load_config("configs/tiny.yaml", ["sft.batch_size=16"])
inputs = prepare_inputs(cfg)
dims = init_parallel()
trainer = Trainer(inputs.args, cfg.trainer, dims, seed=cfg.seed)
trainer.set_lr(cfg.sft.lr)
for step in range(3):
    batch = sft_batch(inputs, cfg.sft, cfg.seed, step)
    n = float(batch["loss_mask"].sum())
    trainer.train_step(batch, lambda lp, mb: (sft_loss(lp, mb["loss_mask"], n), {}))
print("CHECKSUM", tensor_checksum(trainer.hf_state_dict()))
teardown(dims)
