"""Worker of test_real_size_gpu.py: the trainer's real-size options on whatever device this
process sees (on CUDA: Megatron's own CUDA paths, no CPU compatibility layer but the missing-TE
names). bf16 with the distributed optimizer and full recompute against fp32 from the same
bf16-rounded weights, and a Qwen3-MoE step (its router reads a Transformer Engine name). Saves
what the test checks to argv[1]."""
import sys
import warnings
from pathlib import Path

import torch

warnings.simplefilter("ignore")
sys.path.insert(0, str(Path(__file__).parent))

from tests.conftest import tiny_args  # noqa: E402
from test_trainer import make_batch, nll_loss  # noqa: E402

from megarl.models.init_weights import init_hf_state  # noqa: E402
from megarl.parallel.dist import init_parallel, teardown  # noqa: E402
from megarl.trainer.trainer import Trainer, TrainerConfig  # noqa: E402


def main(out: str) -> None:
    dims = init_parallel()
    args = tiny_args("qwen2")
    hf = {k: v.to(torch.bfloat16) for k, v in init_hf_state(args, 3, torch.float32).items()}
    common = dict(lr=1e-3, micro_batch_size=4)
    t32 = Trainer(args, TrainerConfig(**common), dims, hf_state={k: v.float() for k, v in hf.items()})
    t16 = Trainer(args, TrainerConfig(**common, dtype="bfloat16", distributed_optimizer=True, recompute="full"),
                  dims, hf_state=hf)
    before = {n: p.detach().float().cpu().clone() for n, p in t32.gpt.named_parameters()}
    losses = []
    for s in range(3):
        batch = make_batch(args, seed=s)
        losses.append((t32.train_step(batch, nll_loss)["loss"], t16.train_step(batch, nll_loss)["loss"]))
    res = {"device": str(dims.device), "losses": losses, "before": before,
           "fp32": {n: p.detach().float().cpu() for n, p in t32.gpt.named_parameters()},
           "masters": {n: p.main_param.detach().cpu().view(p.shape) for n, p in t16.gpt.named_parameters()},
           "dtypes": sorted({str(p.dtype) for p in t16.gpt.parameters()}),
           "grad_dtypes": sorted({str(p.main_grad.dtype) for p in t16.gpt.parameters()})}
    moe = tiny_args("qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    res["moe_loss"] = Trainer(moe, TrainerConfig(**common), dims, seed=1).train_step(make_batch(moe), nll_loss)["loss"]
    torch.save(res, out)
    teardown(dims)


if __name__ == "__main__":
    main(sys.argv[1])
