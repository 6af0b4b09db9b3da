"""The rollout stage of a synchronous GRPO step: which prompts, G samples each, rewards.

Data order is a pure function of (seed, step): step t takes prompts [t*P, (t+1)*P) of the
concatenated per-epoch permutations, so a resumed run and a rank that pre-generates step t+1
(bubble drafts, issue 3) know the prompts without communication.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from megarl.config import RunConfig
from megarl.engine import Engine, Request, Result, SamplingParams
from megarl.rl.task import Problem


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    order = list(range(n))
    random.Random(f"megarl-data-{seed}-{epoch}").shuffle(order)
    return order


def prompt_uids_for_step(step: int, cfg: RunConfig, n: int) -> list[int]:
    p = cfg.rollout.prompts_per_step
    if p > n:
        raise ValueError(f"rollout.prompts_per_step={p} is larger than the prompt set ({n} prompts)")
    orders: dict[int, list[int]] = {}
    uids = []
    for i in range(step * p, (step + 1) * p):
        if i // n not in orders:
            orders[i // n] = epoch_order(cfg.seed, i // n, n)
        uids.append(orders[i // n][i % n])
    return uids


@dataclass
class Group:
    """The G samples of one prompt, with their rewards."""

    problem: Problem
    results: list[Result]
    rewards: list[float] = field(default_factory=list)


class RolloutStage:
    def __init__(self, engine: Engine, inputs, cfg: RunConfig):
        self.engine, self.inputs, self.cfg = engine, inputs, cfg
        r = cfg.rollout
        self.params = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                                     max_new_tokens=r.max_new_tokens, stop_token_ids=(inputs.tokenizer.eos_id,))

    def requests(self, uids: list[int]) -> list[Request]:
        """The G requests of each prompt in ``uids``, grouped by prompt."""
        tok, g = self.inputs.tokenizer, self.cfg.rollout.group_size
        return [Request(uid=u, sample_idx=i, prompt_ids=tok.encode(self.inputs.problems[u].prompt), params=self.params)
                for u in uids for i in range(g)]

    def run(self, uids: list[int], step: int) -> list[Group]:
        self.engine.reset_stats()
        return self.groups(uids, self.engine.generate(self.requests(uids), step=step))

    def groups(self, uids: list[int], results: list[Result]) -> list[Group]:
        """The results of ``requests(uids)`` as GRPO groups, with their rewards."""
        tok, g = self.inputs.tokenizer, self.cfg.rollout.group_size
        groups = []
        for k, u in enumerate(uids):
            p, res = self.inputs.problems[u], results[k * g:(k + 1) * g]
            rewards = [float(self.inputs.reward_fn(p, tok.decode(r.tokens))) for r in res]
            groups.append(Group(problem=p, results=res, rewards=rewards))
        return groups

    def pregenerate(self, uids: list[int], step: int) -> int:
        """Bubble work: generate step ``step``'s samples now, as that step's coupled drafts.
        Returns the tokens generated."""
        results = self.engine.pregenerate(self.requests(uids), step)
        return sum(len(r.tokens) for r in results)

    def metrics(self, groups: list[Group]) -> dict[str, float]:
        """Per-step rollout figures (read right after ``run``: the engine's counters cover it)."""
        results = [r for g in groups for r in g.results]
        rewards = np.array([x for g in groups for x in g.rewards])
        lens = np.array([len(r.tokens) for r in results])
        ents = [e for r in results for e in r.entropies]
        forwards = int(sum(r.n_forwards for r in results))
        spec = self.engine.spec.metrics() if self.engine.spec is not None else {}
        return {**spec,
            "reward_mean": float(rewards.mean()),
            "reward_max": float(rewards.max()),
            "entropy_mean": float(np.mean(ents)) if ents else 0.0,
            "response_len_mean": float(lens.mean()),
            "response_len_max": int(lens.max()),
            "response_len_p50": float(np.percentile(lens, 50)),
            "truncated_frac": float(np.mean([r.finish_reason == "length" for r in results])),
            "zero_var_groups": int(sum(len(set(g.rewards)) == 1 for g in groups)),
            "rollout_tokens": int(lens.sum()),
            "target_forwards": forwards,
            "engine_forwards": self.engine.stats["forwards"],
            # Without speculation every token costs its request one forward.
            "forward_reduction": 1.0 - forwards / max(1, int(lens.sum())),
        }
