"""Worker of tests/test_gpu.py: two train steps of the Megatron trainer on whatever device this
process sees (CUDA, or CPU through the compatibility layer); saves the weights."""
import sys

import torch

from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM
from megarl.parallel.dist import init_parallel, teardown
from megarl.rl.grpo import sft_loss
from megarl.trainer.trainer import Trainer, TrainerConfig

args = ModelArgs(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, model_type="qwen2", eos_token_id=1)
torch.manual_seed(0)
init = CausalLM(args).hf_state_dict()
dims = init_parallel()
trainer = Trainer(args, TrainerConfig(lr=1e-3, micro_batch_size=2), dims, hf_state=init, seed=0)
g = torch.Generator().manual_seed(1)
ids = torch.randint(2, 40, (4, 24), generator=g)
mask = torch.ones(4, 23)
mask[:, :5] = 0
n = float(mask.sum())
for _ in range(2):
    out = trainer.train_step({"input_ids": ids, "loss_mask": mask}, lambda lp, mb: (sft_loss(lp, mb["loss_mask"], n), {}))
torch.save({"device": str(dims.device), "loss": out["loss"],
            "weights": {k: v.float().cpu() for k, v in trainer.hf_state_dict().items()}}, sys.argv[1])
teardown(dims)
