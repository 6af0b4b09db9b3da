"""Worker for test_parallel_run.py: whole GRPO runs (``megarl.train.train``) under torchrun.

argv = (out_dir, run, [run ...]); each run is ``name=key=value,key=value`` of config overrides
(e.g. ``tp2=parallel.trainer_tp=2``). The process group is created here, once, so that train()
(which only tears down a group it created) can run every layout in one launch: starting
processes and importing Megatron costs more than these runs. Each run writes RUN_DIR =
out_dir/<name> (metrics.jsonl, hf/, and hf0.safetensors: the starting weights).

The run is tiny and fp64 (trainer and engine), with no SFT and a reward that varies within every
group (the response length mod 3), so each of the RL steps really updates the weights."""
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.simplefilter("ignore")  # Megatron warns about missing apex/TE at import

from safetensors.torch import load_file, save_file  # noqa: E402

from megarl.config import load_config  # noqa: E402
from megarl.models.init_weights import init_hf_state  # noqa: E402
from megarl.setup_run import prepare_inputs  # noqa: E402
from megarl.trainer.model import parse_dtype  # noqa: E402
from megarl.train import train  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smoke.yaml"
OVERRIDES = [
    "rl_steps=3", "checkpoint_every=0", "sft.steps=0", "progress=false",
    "model.hidden_size=32", "model.intermediate_size=64", "model.max_position_embeddings=96",
    "rollout.prompts_per_step=4", "rollout.group_size=3", "rollout.max_new_tokens=10", "rollout.max_batch_size=6",
    "rollout.dtype=float64", "trainer.dtype=float64", "trainer.micro_batch_size=2", "trainer.lr=0.01",
]


# A Qwen3-MoE policy: 4 experts, top-2, renormalised.
MOE = ("model.model_type=qwen3_moe,model.num_experts=4,model.num_experts_per_tok=2,"
       "model.moe_intermediate_size=32,model.norm_topk_prob=true")


def length_reward(problem, text: str) -> float:
    """Varies inside every group (unlike the task's reward for an untrained model): real updates."""
    return float(len(text) % 3)


def run(out_dir: Path, spec: str) -> None:
    """One run; the pseudo-override ``resume_at=K`` stops it after step K (a checkpoint there)
    and resumes it from that checkpoint to the end."""
    name, _, fields = spec.partition("=")
    fields = [kv for kv in fields.split(",") if kv]
    resume_at = [int(kv.split("=")[1]) for kv in fields if kv.startswith("resume_at=")]
    overrides = OVERRIDES + [kv for kv in fields if not kv.startswith("resume_at=")]
    cfg = load_config(CONFIG, overrides)
    inputs = prepare_inputs(cfg)
    inputs.reward_fn = length_reward
    if resume_at:
        first = load_config(CONFIG, overrides + [f"rl_steps={resume_at[0]}", f"checkpoint_every={resume_at[0]}"])
        train(first, out_dir / name, inputs=inputs)  # its checkpoint is in place on return, on every rank
        train(cfg, out_dir / name, resume=True, inputs=inputs)
    else:
        train(cfg, out_dir / name, inputs=inputs)
    if not dist.is_initialized() or dist.get_rank() == 0:  # the starting weights, for the test
        start = (load_file(Path(cfg.model.init_from_hf) / "model.safetensors") if cfg.model.init_from_hf
                 else init_hf_state(inputs.args, cfg.seed, parse_dtype(cfg.trainer.dtype)))
        save_file(start, str(out_dir / name / "hf0.safetensors"))


def main(out_dir: str, *specs: str) -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    for spec in specs:
        run(Path(out_dir), spec)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
