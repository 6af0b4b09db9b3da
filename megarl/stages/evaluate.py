"""Evaluation during training: a held-out prompt set sampled on the rollout engine every
``eval.every`` steps (and at step 0, and after the last step), its figures logged with the step's
metrics under ``eval/`` (megarl/rl/eval_metrics.py).

Exact and apart from training (docs/design.md §1.1): an evaluation sample is the engine's keyed
sample of (weights, prompt, seed, :data:`EVAL_NOISE_STEP`, held-out uid, sample index). Held-out
uids are never trained on and the noise step is one no RL step reaches, so no evaluation sample
shares its noise with a training sample; every evaluation of a run uses the same noise, so its
curve compares weights, not draws. The speculator is detached while it runs (its history and
drafter see training samples only), its rewards are scored in a pool of its own, and it reads the
engine's weights without writing anything: a run's training is the same with evaluation on or off
(tests/test_eval.py). ``megarl eval`` (megarl/eval_cli.py) runs the same evaluation on an exported
model: the final export's figures equal the run's last in-run evaluation.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch.distributed as dist

from megarl.engine import Engine, Request, SamplingParams
from megarl.rl.eval_metrics import PREFIX, eval_line, eval_metrics
from megarl.rl.reward_pool import RewardPool
from megarl.rl.rewards import RewardConfig
from megarl.rl.task import Problem
from megarl.rollout.config import RolloutConfig

log = logging.getLogger("megarl")

EVAL_NOISE_STEP = 2 ** 32 - 1
"""The step in the noise key of every evaluation sample (the key keeps a step's low 32 bits; RL
steps stay far below this one)."""


@dataclass
class EvalConfig:
    """Evaluation on held-out prompts during training (off by default)."""

    every: int = 0
    """Evaluate every N RL steps, before the first step (step 0) and after the last; 0: never.
    Evaluation never changes the training run."""
    prompts: int = 0
    """Size of the held-out set. data.source=addition: the task's held-out problems (uids from
    ``task.num_prompts`` on), training unchanged. Other sources: the last N prompts of the set,
    which training then never draws (this changes the training run whether ``every`` is 0 or not)."""
    samples: int = 4
    """Samples per held-out prompt (n of pass@k; k = 1, 2, 4, ... up to n, and n)."""
    temperature: float | None = None
    """Sampling temperature of the evaluation; None: ``rollout.temperature``; 0: greedy. top-k/top-p
    are the rollout's."""
    max_new_tokens: int | None = None
    """Longest evaluation response; None: ``rollout.max_new_tokens``, which also bounds it (the
    engine's context is sized by the rollout: a response stops at the longest training prompt +
    ``rollout.max_new_tokens`` tokens)."""
    pass_threshold: float = 1.0
    """A sample counts as correct for pass@k when its reward is at least this."""
    greedy: bool = False
    """Also evaluate greedily (one response per prompt, the argmax at every token), logged under
    ``eval/greedy/``; with ``temperature`` 0 the main evaluation is the greedy one already."""

    def __post_init__(self) -> None:
        from megarl.utils.dataclass_config import check_number

        check_number("eval.every", self.every, ge=0, integer=True, note="0 = no evaluation")
        check_number("eval.prompts", self.prompts, ge=0, integer=True)
        check_number("eval.samples", self.samples, ge=1, integer=True)
        if self.temperature is not None:
            check_number("eval.temperature", self.temperature, ge=0, note="0 = greedy; null = rollout.temperature")
        if self.max_new_tokens is not None:
            check_number("eval.max_new_tokens", self.max_new_tokens, ge=1, integer=True,
                         note="null = rollout.max_new_tokens")
        check_number("eval.pass_threshold", self.pass_threshold)
        if self.every and not self.prompts:
            raise ValueError(f"eval.every={self.every} needs a held-out set: set eval.prompts >= 1 (or eval.every=0)")

    def check_against(self, rollout: RolloutConfig, long_rollout_tp: int, rollout_tp: int) -> None:
        """What the section needs of the rest of the run config (``RunConfig.__post_init__``)."""
        if self.max_new_tokens is not None and self.max_new_tokens > rollout.max_new_tokens:
            raise ValueError(f"eval.max_new_tokens={self.max_new_tokens} exceeds rollout.max_new_tokens="
                             f"{rollout.max_new_tokens}, which sizes the engine's context; valid: <= "
                             f"{rollout.max_new_tokens}, or null")
        if self.every and long_rollout_tp not in (0, rollout_tp):
            raise ValueError("eval.every > 0 with tail.long_rollout_tp (elastic rollout TP) is not supported: the "
                             "short-round engine misses the weights of a step before a long round; set "
                             "tail.long_rollout_tp=0 or eval.every=0")


@dataclass
class HeldOut:
    """The held-out prompts and how many prompts training draws from (uids ``0 .. train_size-1``)."""

    problems: list[Problem]
    prompt_ids: list[list[int]]
    train_size: int


def held_out_set(cfg: EvalConfig, problems: list[Problem], prompt_ids: list[list[int]], tokenizer, task,
                 max_seq_len: int, prompts_per_step: int) -> HeldOut | None:
    """``cfg``'s held-out set (None without one), checked to fit the engine's context; ``task``:
    the synthetic task (None for other sources)."""
    n = cfg.prompts
    if not n:
        return None
    if task is not None:
        held = [task.problem(u) for u in task.eval_uids(n)]
        ids, train_size = [tokenizer.encode_prompt(p.prompt) for p in held], len(problems)
    else:
        train_size = len(problems) - n
        if train_size < prompts_per_step:
            raise ValueError(f"eval.prompts={n} leaves {train_size} of the {len(problems)} prompts for training, "
                             f"fewer than rollout.prompts_per_step={prompts_per_step}; valid: eval.prompts <= "
                             f"{len(problems) - prompts_per_step}")
        held, ids = problems[train_size:], prompt_ids[train_size:]
    longest = max(range(n), key=lambda i: len(ids[i]))
    if len(ids[longest]) >= max_seq_len:
        raise ValueError(f"held-out prompt uid {held[longest].uid} is {len(ids[longest])} tokens, beyond the rollout "
                         f"engine's context of {max_seq_len} (the longest training prompt + rollout.max_new_tokens); "
                         f"valid: fewer eval.prompts, or a larger rollout.max_new_tokens")
    return HeldOut(held, ids, train_size)


class Evaluator:
    """Samples the held-out set on ``engine`` and scores it. With ``replicas`` > 1 rollout
    replicas each generate every ``replicas``-th prompt and the shares are gathered over
    ``dp_group``, so every generating process returns the same figures."""

    def __init__(self, cfg: EvalConfig, engine: Engine, held: HeldOut, reward_fn, tokenizer, rollout: RolloutConfig,
                 reward: RewardConfig, replica: int = 0, replicas: int = 1, dp_group=None):
        self.cfg, self.engine, self.held, self.reward_fn, self.tokenizer = cfg, engine, held, reward_fn, tokenizer
        self.reward, self.replica, self.replicas, self.dp_group = reward, replica, replicas, dp_group
        temp = rollout.temperature if cfg.temperature is None else cfg.temperature
        self.params = SamplingParams(temperature=temp, top_k=rollout.top_k, top_p=rollout.top_p,
                                     max_new_tokens=cfg.max_new_tokens or rollout.max_new_tokens,
                                     stop_token_ids=tokenizer.stop_ids)

    def run(self) -> dict[str, float]:
        """The ``eval/`` figures of the engine's current weights (with ``eval.greedy`` and a sampling
        temperature, the greedy pass's under ``eval/greedy/`` too)."""
        metrics = self._figures(self.params, self.cfg.samples, PREFIX)
        if self.cfg.greedy and self.params.temperature > 0:
            greedy = dataclasses.replace(self.params, temperature=0.0, top_k=0, top_p=1.0)
            metrics.update(self._figures(greedy, 1, PREFIX + "greedy/"))
        return metrics

    def _figures(self, params: SamplingParams, n: int, prefix: str) -> dict[str, float]:
        mine = list(range(self.replica, len(self.held.problems), self.replicas))
        requests = [Request(uid=self.held.problems[i].uid, sample_idx=s, prompt_ids=self.held.prompt_ids[i],
                            params=params) for i in mine for s in range(n)]
        spec, self.engine.spec = self.engine.spec, None  # the speculator sees training samples only
        try:
            results = self.engine.generate(requests, step=EVAL_NOISE_STEP)
        finally:
            self.engine.spec = spec
        # A pool of its own: the rollout pool's adaptive timeout learns from training rewards only.
        with RewardPool(self.reward.workers, self.reward.sandbox, adaptive=False) as pool:
            futures = [pool.submit(self.reward_fn, self.held.problems[i], self.tokenizer.decode(r.tokens))
                       for i, r in zip((i for i in mine for _ in range(n)), results)]
            rewards = [f.result() for f in futures]
        rows = {i: ([rewards[k * n + s] for s in range(n)], [len(results[k * n + s].tokens) for s in range(n)],
                    [results[k * n + s].finish_reason == "length" for s in range(n)]) for k, i in enumerate(mine)}
        if self.replicas > 1:
            shares = [None] * self.replicas
            dist.all_gather_object(shares, rows, group=self.dp_group)
            rows = {i: row for share in shares for i, row in share.items()}
        order = sorted(rows)
        return eval_metrics([rows[i][0] for i in order], [rows[i][1] for i in order], [rows[i][2] for i in order],
                            self.cfg.pass_threshold, prefix)


class Evaluation:
    """What the step loop calls after every step (every process, every role): ``evaluation(step)``
    returns the ``eval/`` figures of the weights after ``step`` updates when an evaluation is due
    then, and ``eval_time_s``, its wall time (``{}`` otherwise). ``evaluator``: this process's
    (None where it does not generate); ``from_generators``: hands the first generating process's
    figures to every process (``Exchange.from_generators``)."""

    def __init__(self, cfg: EvalConfig, rl_steps: int, evaluator: Evaluator | None, from_generators, rank0: bool):
        self.cfg, self.rl_steps, self.evaluator, self.from_generators, self.rank0 = \
            cfg, rl_steps, evaluator, from_generators, rank0

    @classmethod
    def build(cls, cfg: EvalConfig, rl_steps: int, inputs, engine: Engine | None, rollout: RolloutConfig,
              reward: RewardConfig, rollout_groups, replicas: int, from_generators, rank0: bool) -> Evaluation:
        """The run's evaluation: an :class:`Evaluator` on ``engine`` where this process generates
        (``inputs``: the run's ``RunInputs``; ``rollout_groups``: this process's rollout groups)."""
        evaluator = None
        if engine is not None and cfg.every:
            evaluator = Evaluator(cfg, engine, inputs.held_out, inputs.reward_fn, inputs.tokenizer, rollout, reward,
                                  rollout_groups.group_index, replicas, rollout_groups.dp_group)
        return cls(cfg, rl_steps, evaluator, from_generators, rank0)

    def due(self, step: int) -> bool:
        every = self.cfg.every
        return bool(every) and (step % every == 0 or step == self.rl_steps)

    def __call__(self, step: int) -> dict[str, float]:
        if not self.due(step):
            return {}
        t0 = time.perf_counter()
        metrics = self.from_generators(self.evaluator.run() if self.evaluator is not None else None)
        if self.rank0:
            log.info(eval_line(f"step {step}", metrics))
        return {**metrics, "eval_time_s": time.perf_counter() - t0}  # (a timing: outside eval/, not repeatable)
