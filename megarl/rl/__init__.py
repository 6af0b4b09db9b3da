"""RL pieces that need no model and no process group: tasks and datasets, tokenizers, rewards
and the sandbox for model-written code, GRPO losses and the step's batch/loss builder."""
from megarl.rl.data import exact_answer_reward, extract_answer, load_jsonl_prompts
from megarl.rl.grpo import group_advantages, grpo_loss, kl_k3, sft_loss
from megarl.rl.task import (ANSWER_MARKER, SEPARATORS, AdditionTask, EntropyEstimate, Problem, TaskConfig,
                            answer_reward, check_working, estimate_entropy, parse_prompt, parse_solution)
from megarl.rl.tokenizer import CharTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "ANSWER_MARKER", "SEPARATORS", "AdditionTask", "CharTokenizer", "EntropyEstimate", "HFTokenizer", "Problem",
    "TaskConfig", "Tokenizer", "answer_reward", "check_working", "estimate_entropy", "exact_answer_reward",
    "extract_answer", "group_advantages", "grpo_loss", "kl_k3", "load_jsonl_prompts", "parse_prompt",
    "parse_solution", "sft_loss",
]
