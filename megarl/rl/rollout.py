"""The rollout stage of a synchronous GRPO step: which prompts, G samples each, rewards.

Data order is a pure function of (seed, step): step t takes prompts [t*P, (t+1)*P) of the
concatenated per-epoch permutations, so a resumed run and a rank that pre-generates step t+1
(bubble drafts, issue 3) know the prompts without communication.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch.distributed as dist

from megarl.config import RunConfig
from megarl.engine import Engine, Request, Result, SamplingParams
from megarl.rl.placement import LengthHistory, place
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
    """Generates a step's GRPO groups. With ``replicas`` > 1 (rollout data parallelism) this
    process's rollout group generates its share of the prompts (``rollout.placement``:
    round robin, or balanced by predicted length, megarl/rl/placement.py) and the groups of all
    replicas are exchanged over ``dp_group`` (rank ``replica`` of it is this group's rank), so every
    process returns every group, in ``uids`` order."""

    def __init__(self, engine: Engine, inputs, cfg: RunConfig, replica: int = 0, replicas: int = 1,
                 dp_group: dist.ProcessGroup | None = None):
        if not 0 <= replica < replicas:
            raise ValueError(f"rollout replica {replica} is outside 0..{replicas - 1}")
        if replicas > 1 and dp_group is None:
            raise ValueError(f"{replicas} rollout replicas need their data-parallel group (dp_group)")
        self.engine, self.inputs, self.cfg = engine, inputs, cfg
        self.replica, self.replicas, self.dp_group = replica, replicas, dp_group
        self.engine_forwards = 0  # forwards of every replica's engine in the last run()
        self.replica_tokens: list[int] = []  # response tokens each replica generated in the last run()
        # Every process updates it from every group, so all compute the same placement.
        self.history = LengthHistory()
        r = cfg.rollout
        self.params = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                                     max_new_tokens=r.max_new_tokens, stop_token_ids=(inputs.tokenizer.eos_id,))

    def _assignment(self, uids: list[int]) -> list[list[int]]:
        return place(uids, self.replicas, self.cfg.rollout.placement, self.history)

    def _mine(self, uids: list[int]) -> list[int]:
        return [uids[j] for j in self._assignment(uids)[self.replica]]

    def requests(self, uids: list[int]) -> list[Request]:
        """The G requests of each prompt in ``uids``, grouped by prompt."""
        tok, g = self.inputs.tokenizer, self.cfg.rollout.group_size
        return [Request(uid=u, sample_idx=i, prompt_ids=tok.encode(self.inputs.problems[u].prompt), params=self.params)
                for u in uids for i in range(g)]

    def run(self, uids: list[int], step: int, on_group: Callable[[Group], None] | None = None) -> list[Group]:
        """Every group of ``uids`` (all replicas'). ``on_group(group)`` is called, in this process,
        for each group of this replica as soon as its last sample finishes (stream training)."""
        self.engine.reset_stats()
        assignment = self._assignment(uids)
        mine = [uids[j] for j in assignment[self.replica]]
        on_finish = None
        if on_group is not None:
            g = self.cfg.rollout.group_size
            pending = {k: [None] * g for k in range(len(mine))}

            def on_finish(i: int, result: Result) -> None:
                k = i // g  # requests are grouped by prompt: request i is sample i % g of prompt k
                pending[k][i % g] = result
                if all(r is not None for r in pending[k]):
                    on_group(self.groups([mine[k]], pending.pop(k))[0])

        results = self.engine.generate(self.requests(mine), step=step, on_finish=on_finish)
        self.engine_forwards = self.engine.stats["forwards"]
        self.replica_tokens = [sum(len(x.tokens) for x in results)]
        if self.replicas > 1:
            shares = [None] * self.replicas
            dist.all_gather_object(shares, (results, self.engine_forwards), group=self.dp_group)
            g = self.cfg.rollout.group_size
            by_index: dict[int, list[Result]] = {}
            for (res, _), indices in zip(shares, assignment):  # replica r generated uids[indices] in order
                for k, j in enumerate(indices):
                    by_index[j] = res[k * g:(k + 1) * g]
            results = [x for j in range(len(uids)) for x in by_index[j]]
            self.engine_forwards = sum(f for _, f in shares)
            self.replica_tokens = [sum(len(x.tokens) for x in res) for res, _ in shares]
        groups = self.groups(uids, results)
        for grp in groups:
            self.history.update(grp.problem.uid, [len(x.tokens) for x in grp.results])
        return groups

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
        results = self.engine.pregenerate(self.requests(self._mine(uids)), step)
        return sum(len(r.tokens) for r in results)

    def metrics(self, groups: list[Group]) -> dict[str, float]:
        """Per-step rollout figures (read right after ``run``: the engine's counters cover it). With
        several replicas the ``spec/*`` figures are this replica's own speculator's."""
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
            "engine_forwards": self.engine_forwards,
            # Slowest replica's tokens over the mean: 1.0 is a perfectly balanced step.
            "replica_token_imbalance": max(self.replica_tokens) / max(1e-9, float(np.mean(self.replica_tokens))),
            # Without speculation every token costs its request one forward.
            "forward_reduction": 1.0 - forwards / max(1, int(lens.sum())),
        }
