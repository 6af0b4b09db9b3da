"""Supervised warm-up on the synthetic task's worked solutions, so RL starts from a useful policy.

Solutions are sampled in their random styles, so the warmed-up policy keeps real entropy at
temperature 1 (an almost deterministic policy would make every draft look perfect).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

from tqdm.auto import tqdm

from megarl.rl.batching import dp_rows, make_batch
from megarl.rl.grpo import sft_loss


@dataclass
class SFTConfig:
    """Supervised warm-up on the task's worked solutions, before RL."""

    steps: int = 600
    """Optimizer steps of SFT; 0 skips SFT."""
    batch_size: int = 32
    """Solutions per SFT step."""
    lr: float = 1e-3
    """Learning rate of the SFT phase (the RL phase uses trainer.lr)."""

    def __post_init__(self) -> None:
        from megarl.utils.dataclass_config import check_number

        check_number("sft.steps", self.steps, ge=0, integer=True, note="0 skips SFT")
        check_number("sft.batch_size", self.batch_size, ge=1, integer=True)
        if self.steps > 0:
            check_number("sft.lr", self.lr, gt=0)
        else:
            check_number("sft.lr", self.lr, ge=0)


def sft_batch(inputs, sft: SFTConfig, seed: int, step: int) -> dict:
    """Batch ``step`` of SFT: a pure function of (seed, step), so a resumed run sees the same data."""
    task, tok = inputs.task, inputs.tokenizer
    rng = random.Random(f"megarl-sft-{seed}-{step}")
    prompts, responses = [], []
    for _ in range(sft.batch_size):
        problem = inputs.problems[rng.randrange(len(inputs.problems))]
        prompts.append(tok.encode(problem.prompt))
        responses.append(tok.encode(task.solution(problem, rng)) + [tok.eos_id])
    return make_batch(prompts, responses, tok.pad_id)


def run_sft(trainer, inputs, sft: SFTConfig, seed: int, progress: bool = True) -> dict[str, float]:
    trainer.set_lr(sft.lr)
    t0 = time.perf_counter()
    bar = tqdm(range(sft.steps), desc="SFT", disable=not progress or trainer.dims.rank != 0)
    first = last = None
    for step in bar:
        batch = sft_batch(inputs, sft, seed, step)
        n = float(batch["loss_mask"].sum())  # the whole step's count; each DP rank trains its rows
        # T=1 whatever rollout.temperature is: SFT fits the data's own distribution (plain NLL).
        out = trainer.train_step(dp_rows(batch, trainer.dims.dp_rank, trainer.dims.dp),
                                 lambda lp, mb: (sft_loss(lp, mb["loss_mask"], n), {}), temperature=1.0)
        last = out["loss"]
        first = last if first is None else first
        bar.set_postfix(loss=f"{last:.3f}")
    return {"sft_steps": sft.steps, "sft_loss_first": first, "sft_loss_last": last,
            "sft_time_s": time.perf_counter() - t0}
