"""Everything a run needs that can fail on bad input, built *before* the run directory is touched.

A misspelt config key, a missing HF file or a malformed dataset row must end the run with one
clear message and leave nothing behind, so all of it is loaded and checked here first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megarl.config import RunConfig
from megarl.models.config import ModelArgs
from megarl.models.hf_io import load_hf_state_dict, read_hf_config
from megarl.rl.data import exact_answer_reward, load_jsonl_prompts
from megarl.rl.task import AdditionTask, Problem
from megarl.rl.tokenizer import CharTokenizer, HFTokenizer


@dataclass
class RunInputs:
    tokenizer: CharTokenizer | HFTokenizer
    problems: list[Problem]
    """The prompt set, indexed by uid."""
    reward_fn: Callable[[Problem, str], float]
    args: ModelArgs
    init_hf_state: dict[str, torch.Tensor] | None
    """HF-named starting weights, or None for a fresh init from the seed."""
    task: AdditionTask | None
    """The synthetic task (for SFT solutions), None for JSONL data."""


def prepare_inputs(cfg: RunConfig) -> RunInputs:
    task = None
    if cfg.data.source == "addition":
        tokenizer = CharTokenizer()
        task = AdditionTask(cfg.task)
        problems = [task.problem(uid) for uid in range(len(task))]
        reward_fn = task.reward
    else:
        tokenizer = HFTokenizer(cfg.data.tokenizer_path or cfg.model.init_from_hf)
        problems = load_jsonl_prompts(cfg.data.jsonl_path, tokenizer)
        reward_fn = exact_answer_reward

    if cfg.model.init_from_hf:
        hf_cfg = read_hf_config(cfg.model.init_from_hf)
        args = ModelArgs.from_hf_config(hf_cfg)
        init_state = load_hf_state_dict(cfg.model.init_from_hf, dtype=torch.float32)
        if args.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"model.init_from_hf vocab_size={args.vocab_size} is smaller than the tokenizer's "
                             f"{tokenizer.vocab_size}")
    else:
        m = cfg.model
        args = ModelArgs(
            vocab_size=tokenizer.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
            num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads, rope_theta=m.rope_theta,
            tie_word_embeddings=m.tie_word_embeddings, max_position_embeddings=m.max_position_embeddings,
            model_type=m.model_type, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
        )
        init_state = None
    if args.eos_token_id is None:
        args.eos_token_id = tokenizer.eos_id
    if task is None and cfg.sft.steps > 0:
        raise ValueError("sft.steps must be 0 with data.source=jsonl: SFT trains on the synthetic task's "
                         "worked solutions (data.source=addition)")
    return RunInputs(tokenizer=tokenizer, problems=problems, reward_fn=reward_fn, args=args,
                     init_hf_state=init_state, task=task)
