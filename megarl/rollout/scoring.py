"""Finished samples into scored GRPO groups: rewards computed in the reward pool as each response
finishes (:class:`Scoring`, which hands each group on for stream training), or one by one
(:func:`score_groups`); and the step's line of ``rollouts.jsonl`` (:func:`rollout_line`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

from megarl.engine import Result
from megarl.rl.task import Problem


@dataclass
class Group:
    """The G samples of one prompt, with their rewards."""

    problem: Problem
    results: list[Result]
    rewards: list[float] = field(default_factory=list)


GroupSink = Callable[[Group], None]
"""Where a finished, scored group goes as soon as it is complete (stream training: the step's
``StreamUpdate.add_group``, in the timeline's train phase: megarl/stages/roles.py);
docs/design.md §3 names it as one of the step's calls back up."""


def score_groups(inputs, uids: list[int], results: list[Result], group_size: int) -> list[Group]:
    """The results of the G requests of each prompt in ``uids`` (grouped by prompt) as GRPO
    groups, with their rewards scored here, one by one."""
    tok, g = inputs.tokenizer, group_size
    groups = []
    for k, u in enumerate(uids):
        p, res = inputs.problems[u], results[k * g:(k + 1) * g]
        rewards = [float(inputs.reward_fn(p, tok.decode(r.tokens))) for r in res]
        groups.append(Group(problem=p, results=res, rewards=rewards))
    return groups


def rollout_line(step: int, groups: list[Group], aborted: dict[int, list[Result]] | None = None) -> dict:
    """One line of ``rollouts.jsonl`` (``rollout.dump``): every sample of the step, in order, and
    (tail batching's short rounds) the deferred prompts' samples as the stop left them: their
    lengths and finish reasons ("aborted": still running), which the simulator's replay needs
    (megarl/sim/replay.py: they held batch rows until the stop). ``forwards``: the target
    forwards a sample took (fewer than its tokens where speculation accepted drafts: the replay
    speeds up each response by its own acceptance)."""
    line = {"step": step, "samples": [{"uid": r.uid, "sample_idx": r.sample_idx, "tokens": list(r.tokens),
                                       "reward": reward, "finish_reason": r.finish_reason, "forwards": r.n_forwards}
                                      for g in groups for r, reward in zip(g.results, g.rewards)]}
    if aborted:
        line["deferred"] = [{"uid": u, "lengths": [len(r.tokens) for r in res],
                             "finish_reasons": [r.finish_reason for r in res]} for u, res in aborted.items()]
    return line


class Scoring:
    """Rewards of one replica's share of a step, scored in the pool as each response finishes;
    with ``on_group`` (stream training) each group is handed on once its last sample is out and
    scored, strictly in the order the groups finished (the gradients are summed in that order,
    so it must not depend on how fast rewards come back). ``on_finish`` is what the engine calls
    (the backend's ``OnFinish``, megarl/rollout/backend.py)."""

    def __init__(self, inputs, pool, group_size: int, mine: list[int], on_group: GroupSink | None):
        self.inputs, self.pool, self.mine, self.on_group = inputs, pool, mine, on_group
        self.g = group_size
        self.results: list[list[Result | None]] = [[None] * self.g for _ in mine]
        self.futures: list[list] = [[None] * self.g for _ in mine]
        self.done: list[int] = []  # groups whose samples are all out, in finishing order
        self.next = 0  # done[next:] are not handed on yet
        self._errors0 = pool.stats()["error_total"]
        self.errors = 0
        """Rewards of the share that crashed or hung (scored 0), once :meth:`finish` returned."""
        self.timeout_s = 0.0
        """The pool's reward timeout once :meth:`finish` returned (adaptive: it follows the runs)."""

    def stop_at(self, groups: int) -> Callable[[], bool]:
        """A ``ShouldStop`` for the engine (tail batching's short rounds): yes once ``groups`` of
        the share's groups are complete (counted in engine iterations: deterministic)."""
        return functools.partial(self._complete, groups)

    def _complete(self, groups: int) -> bool:
        return len(self.done) >= groups

    def on_finish(self, i: int, result: Result) -> None:
        k = i // self.g  # requests are grouped by prompt: request i is sample i % g of prompt k
        self.results[k][i % self.g] = result
        problem = self.inputs.problems[self.mine[k]]
        self.futures[k][i % self.g] = self.pool.submit(self.inputs.reward_fn, problem,
                                                       self.inputs.tokenizer.decode(result.tokens))
        if all(r is not None for r in self.results[k]):
            self.done.append(k)
        self._hand_on(wait=False)

    def _hand_on(self, wait: bool) -> None:
        if self.on_group is None:
            return
        while self.next < len(self.done):
            k = self.done[self.next]
            if not wait and not all(f.done() for f in self.futures[k]):
                return
            group = Group(self.inputs.problems[self.mine[k]], self.results[k],
                          [f.result() for f in self.futures[k]])
            self.on_group(group)
            self.next += 1

    def finish(self) -> list[float | None]:
        """After generation: every complete group handed on, and this share's rewards, in
        request order (None for a request aborted by a short round: it was never scored)."""
        self._hand_on(wait=True)
        rewards = [f.result() if f is not None else None for fs in self.futures for f in fs]
        stats = self.pool.stats()
        self.errors, self.timeout_s = stats["error_total"] - self._errors0, stats["timeout_s"]
        return rewards
