"""Starting reward of a real model on reasoning-gym tasks: which task can GRPO learn from?

GRPO learns only from groups whose rewards differ, so a task to train on should start with a
mean reward well inside (0, 1). This samples ``--prompts`` x ``--group-size`` responses per task
with megarl's own rollout stage (the run's tokenizer, chat template, stop tokens and verifier)
and prints, per task: mean reward, the fraction of groups with a learning signal, how many
responses used the answer tag, mean response length, and one response.

    PYTHONPATH=. .venv/bin/python benchmarks/task_rewards.py --config configs/smollm2.yaml \\
        --tasks basic_arithmetic chain_sum leg_counting --prompts 16 --group-size 4
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from megarl.config import load_config
from megarl.engine import Engine
from megarl.models.hf_io import load_hf_model
from megarl.rl.reasoning_gym_data import extract_tagged_answer
from megarl.rollout.stage import RolloutStage
from megarl.setup_run import prepare_inputs


def measure(config: str, task: str, prompts: int, group: int, overrides: list[str]) -> dict:
    cfg = load_config(config, [*overrides, "data.source=reasoning_gym", f"data.reasoning_gym.tasks=[{task}]",
                               f"rollout.group_size={group}"])
    inputs = prepare_inputs(cfg)
    model = load_hf_model(cfg.model.init_from_hf, torch.float32)
    stage = RolloutStage(Engine(model, cfg.rollout.engine_config(inputs.max_seq_len), seed=cfg.seed), inputs, cfg.rollout,
                         cfg.reward)
    t0 = time.perf_counter()
    groups = stage.run(list(range(prompts)), step=0)
    seconds = time.perf_counter() - t0
    stage.close()
    texts = [inputs.tokenizer.decode(r.tokens) for g in groups for r in g.results]
    rewards = np.array([x for g in groups for x in g.rewards])
    lengths = [len(r.tokens) for g in groups for r in g.results]
    return {"task": task, "reward_mean": float(rewards.mean()),
            "signal_groups": float(np.mean([len(set(g.rewards)) > 1 for g in groups])),
            "tagged_frac": float(np.mean([extract_tagged_answer(t) is not None for t in texts])),
            "len_mean": float(np.mean(lengths)), "truncated_frac": float(np.mean([
                r.finish_reason == "length" for g in groups for r in g.results])),
            "tokens_per_s": sum(lengths) / seconds, "example": texts[0][:300],
            "example_answer": groups[0].problem.answer}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/smollm2.yaml")
    p.add_argument("--tasks", nargs="+", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    out = []
    for task in args.tasks:
        r = measure(args.config, task, args.prompts, args.group_size, args.overrides)
        out.append(r)
        print(f"{task:22s} reward {r['reward_mean']:.3f}  signal groups {r['signal_groups']:.2f}  tagged "
              f"{r['tagged_frac']:.2f}  len {r['len_mean']:.0f}  truncated {r['truncated_frac']:.2f}  "
              f"{r['tokens_per_s']:.0f} tok/s\n    answer {r['example_answer']!r}; response: {r['example']!r}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
