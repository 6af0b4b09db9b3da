"""The rollout stage of a synchronous GRPO step (docs/design.md §3): each rollout replica
generates its share of the step's prompts (megarl/sched/placement.py), G samples each, scored in a
worker pool as they finish (megarl/rollout/scoring.py); a replica done early does bubble work until
the last one is (megarl/sched/bubble.py runs its units); then the replicas exchange their groups.
Which prompts a step takes is megarl/sched/prompts.py's.
"""
from __future__ import annotations

import functools
import math
import time

import numpy as np
import torch.distributed as dist

from megarl.engine import Request, Result, SamplingParams
from megarl.rl.reward_pool import RewardPool
from megarl.rl.rewards import RewardConfig
from megarl.rollout.backend import RolloutBackend, ShouldStop
from megarl.rollout.config import RolloutConfig
from megarl.rollout.scoring import Group, GroupSink, Scoring, score_groups
from megarl.sched.bubble import BubbleUnit, BubbleWorker, PhaseEnd, run_units
from megarl.sched.bubble_budget import BubbleBudget
from megarl.sched.placement import LengthHistory, place
from megarl.sched.timeline import StepTimeline


class RolloutStage:
    """Generates a step's GRPO groups. With ``replicas`` > 1 (rollout data parallelism) this
    process's rollout group generates its share of the prompts (``rollout.placement``:
    round robin, or balanced by predicted length, megarl/sched/placement.py) and the groups of all
    replicas are exchanged over ``dp_group`` (rank ``replica`` of it is this group's rank), so every
    process returns every group, in ``uids`` order."""

    def __init__(self, engine: RolloutBackend, inputs, rollout: RolloutConfig, reward: RewardConfig, replica: int = 0,
                 replicas: int = 1, dp_group: dist.ProcessGroup | None = None,
                 tp_group: dist.ProcessGroup | None = None):
        if not 0 <= replica < replicas:
            raise ValueError(f"rollout replica {replica} is outside 0..{replicas - 1}")
        if replicas > 1 and dp_group is None:
            raise ValueError(f"{replicas} rollout replicas need their data-parallel group (dp_group)")
        self.engine, self.inputs, self.cfg = engine, inputs, rollout
        self.replica, self.replicas, self.dp_group, self.tp_group = replica, replicas, dp_group, tp_group
        self.engine_forwards = 0  # forwards of every replica's engine in the last run()
        self.spec_metrics: dict[str, float] = {}  # this replica's speculator figures of the last run()
        self.bubble_budget = BubbleBudget()  # which bubble units fit (megarl/sched/bubble_budget.py)
        self._worker: BubbleWorker | None = None  # bubble work of the last run(), until wait_bubble()
        self._others: list[list[Result]] = []  # other replicas' results of the last run(), for share_drafts()
        self.replica_tokens: list[int] = []  # response tokens each replica generated in the last run()
        # Every process updates it from every group, so all compute the same placement.
        self.history = LengthHistory()
        self.pool = RewardPool(reward.workers, reward.sandbox, reward.adaptive_timeout)
        self.reward_errors = 0  # rewards of the last run() that crashed or hung (scored 0), all replicas
        self.reward_timeout_s = 0.0  # the reward pool's timeout after the last run()
        # Prompts the last run() left incomplete (tail batching's keep), with their samples as the stop left them.
        self.aborted: dict[int, list[Result]] = {}
        r = rollout
        self.params = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                                     max_new_tokens=r.max_new_tokens, stop_token_ids=inputs.tokenizer.stop_ids)

    @property
    def spec(self):
        """The engine's Speculator (None without speculation)."""
        return self.engine.spec

    def _assignment(self, uids: list[int]) -> list[list[int]]:
        return place(uids, self.replicas, self.cfg.placement, self.history)

    def requests(self, uids: list[int]) -> list[Request]:
        """The G requests of each prompt in ``uids``, grouped by prompt."""
        g = self.cfg.group_size
        return [Request(uid=u, sample_idx=i, prompt_ids=self.inputs.prompt_ids[u], params=self.params)
                for u in uids for i in range(g)]

    def run(self, uids: list[int], step: int, on_group: GroupSink | None = None,
            timeline: StepTimeline | None = None, bubble: list[BubbleUnit] | None = None,
            low_priority: bool = False, keep: int | None = None) -> list[Group]:
        """Every group of ``uids`` (all replicas'). ``on_group(group)`` is called, in this process,
        for each group of this replica as soon as its last sample finishes (stream training).

        With several replicas, a replica that finished its share runs the ``bubble`` units (bubble
        work, megarl/rollout/bubble.py, as megarl/sched/policy.py's ``bubble_plan`` picks and
        orders them) in their own thread (megarl/sched/bubble.py; ``low_priority``: at the OS's
        idle priority), until the step's last replica is done, while it waits
        for the others; the replicas then exchange their groups, without waiting for the bubble
        work's last unit (``wait_bubble`` does, before training; ``share_drafts`` then hands the
        step + 1 bubble drafts around). ``timeline`` gets this process's generate and reward phases
        (``on_group`` and the bubble units record their own train and bubble phases); the rollout
        phase ends after the exchange.

        ``keep`` (tail batching, megarl/sched/tail.py): stop generating once ``keep`` prompts are
        complete (each replica once its share, ``ceil(keep / replicas)``, is): only the complete
        groups are returned, in ``uids`` order, and the others are left in ``self.aborted``.
        Completion is counted in engine iterations, so which prompts make it is deterministic."""
        tl = timeline if timeline is not None else StepTimeline()
        self.engine.reset_stats()
        assignment = self._assignment(uids)
        mine = [uids[j] for j in assignment[self.replica]]
        scoring = Scoring(self.inputs, self.pool, self.cfg.group_size, mine, on_group)
        should_stop = None
        if keep is not None:
            should_stop = scoring.stop_at(min(len(mine), math.ceil(keep / self.replicas)))
        t_gen = time.perf_counter()
        results = self.engine.generate(self.requests(mine), step=step, on_finish=scoring.on_finish,
                                       should_stop=should_stop)
        tl.fill("generate", t_gen, time.perf_counter())
        tl.tokens = sum(len(x.tokens) for x in results)
        self.engine_forwards = self.engine.stats["forwards"]
        self.spec_metrics = self.engine.spec.metrics() if self.engine.spec is not None else {}
        self.replica_tokens = [tl.tokens]
        t_rew = time.perf_counter()  # what the pool has not finished yet (and the groups not yet handed on:
        rewards = scoring.finish()  # their stream training is recorded as "train" inside this span)
        tl.fill("reward", t_rew, time.perf_counter())
        self.reward_errors, self.reward_timeout_s = scoring.errors, scoring.timeout_s
        if self.replicas > 1:
            results, rewards = self._exchange(uids, assignment, results, rewards, bubble, low_priority)
        tl.end_rollout()
        g = self.cfg.group_size
        groups, self.aborted = [], {}
        for k, u in enumerate(uids):
            res = results[k * g:(k + 1) * g]
            if any(r.finish_reason == "aborted" for r in res):
                self.aborted[u] = res
            else:
                groups.append(Group(self.inputs.problems[u], res, rewards[k * g:(k + 1) * g]))
        for grp in groups:
            self.history.update(grp.problem.uid, [len(x.tokens) for x in grp.results])
        return groups

    def _exchange(self, uids, assignment, results, rewards, bubble, low_priority):
        """Bubble work until every replica is done, then every replica's results and rewards to
        every replica, in ``uids`` order (the bubble units' measured lengths with them). The bubble
        work's last unit may still run: see :meth:`wait_bubble`."""
        if bubble:
            self._bubble(bubble, low_priority)
        shares = [None] * self.replicas
        dist.all_gather_object(shares, (results, rewards, self.engine_forwards, self.reward_errors,
                                        dict(self.bubble_budget.unit_s)), group=self.dp_group)
        self.bubble_budget.adopt([s[4] for r, s in enumerate(shares) if r != self.replica])
        self._others = [s[0] for r, s in enumerate(shares) if r != self.replica]
        self.engine_forwards = sum(s[2] for s in shares)
        self.reward_errors = sum(s[3] for s in shares)
        self.replica_tokens = [sum(len(x.tokens) for x in s[0]) for s in shares]
        return _in_uids_order(shares, assignment, self.cfg.group_size, len(uids))

    def _bubble(self, plan: list[BubbleUnit], low_priority: bool) -> None:
        """Run ``plan``'s units in the bubble thread (megarl/sched/bubble.py; at the OS's idle
        priority with ``low_priority``) until every replica has finished its share."""
        end = PhaseEnd(self.dp_group, self.tp_group, self.engine.device)
        end.post()
        stop = self.bubble_budget.start(end.over)
        self._worker = BubbleWorker(functools.partial(run_units, plan, stop), low_priority,
                                    flush_denormal=self.engine.device.type == "cpu")
        end.wait()
        self.bubble_budget.phase_over()

    def wait_bubble(self) -> None:
        """After ``run``: wait for the bubble work's last unit, if one is still in flight."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def share_drafts(self, step: int) -> None:
        """After ``wait_bubble`` and any pre-generation of the step: give this replica's
        speculator what the others made (``Speculator.share_drafts``: their samples as history
        drafts, the bubble drafts they pre-generated for step + 1). Nothing to do with one replica."""
        if self.replicas == 1:
            return
        others, self._others = self._others, []
        if self.spec is not None:
            self.spec.share_drafts(others, step, self.dp_group)

    def close(self) -> None:
        """Stop the reward pool's threads (after the last ``run``)."""
        self.pool.close()

    def groups(self, uids: list[int], results: list[Result]) -> list[Group]:
        """The results of ``requests(uids)`` as GRPO groups, with their rewards scored here, one
        by one (``run`` scores them in the pool as they finish)."""
        return score_groups(self.inputs, uids, results, self.cfg.group_size)

    def pregenerate(self, uids: list[int], step: int, should_stop: ShouldStop | None = None) -> int:
        """Bubble work: generate step ``step``'s samples now, as that step's coupled drafts; the
        replicas hand them to each other in ``share_drafts``. Returns the tokens generated.

        ``uids`` are split into one share per replica by the placement policy (the shares the
        replicas will most likely generate at step ``step``). Without
        ``should_stop`` this replica does its own share. With it (work in idle time, until the
        step's last replica is done) it goes on with the next replicas' shares, cyclically: the
        replicas still generating cannot do theirs, and a share two replicas both make gives
        the same drafts (same weights, same noise), of which the longer prefix is kept."""
        shares = self._assignment(uids)
        tokens = 0
        for k in range(self.replicas if should_stop is not None else 1):
            if should_stop is not None and should_stop():
                break
            share = shares[(self.replica + k) % self.replicas]
            results = self.engine.pregenerate(self.requests([uids[j] for j in share]), step, should_stop=should_stop)
            tokens += sum(len(r.tokens) for r in results)
        return tokens

    def metrics(self, groups: list[Group]) -> dict[str, float]:
        """Per-step rollout figures of ``run``'s groups. With several replicas the ``spec/*``
        figures are this replica's own speculator's, for its share (bubble work not included)."""
        results = [r for g in groups for r in g.results]
        rewards = np.array([x for g in groups for x in g.rewards])
        lens = np.array([len(r.tokens) for r in results])
        ents = [e for r in results for e in r.entropies]
        forwards = int(sum(r.n_forwards for r in results))
        spec = self.spec_metrics
        return {**spec,
            "reward_mean": float(rewards.mean()),
            "reward_max": float(rewards.max()),
            # absent, not 0, when the engine reports no entropies (the vLLM backend): 0 would read as collapse
            **({"entropy_mean": float(np.mean(ents))} if ents else {}),
            "response_len_mean": float(lens.mean()),
            "response_len_max": int(lens.max()),
            "response_len_p50": float(np.percentile(lens, 50)),
            "truncated_frac": float(np.mean([r.finish_reason == "length" for r in results])),
            "zero_var_groups": int(sum(len(set(g.rewards)) == 1 for g in groups)),
            "reward_errors": self.reward_errors,
            "reward_timeout_s": self.reward_timeout_s,
            "rollout_tokens": int(lens.sum()),
            "target_forwards": forwards,
            "engine_forwards": self.engine_forwards,
            # Slowest replica's tokens over the mean: 1.0 is a perfectly balanced step.
            "replica_token_imbalance": max(self.replica_tokens) / max(1e-9, float(np.mean(self.replica_tokens))),
            # Without speculation every token costs its request one forward.
            "forward_reduction": 1.0 - forwards / max(1, int(lens.sum())),
        }


def _in_uids_order(shares: list[tuple], assignment: list[list[int]], group_size: int,
                   n_uids: int) -> tuple[list[Result], list[float | None]]:
    """Every replica's ``(results, rewards, ...)`` share back in ``uids`` order: replica r
    generated ``uids[assignment[r]]``, in that order, ``group_size`` samples each."""
    g = group_size
    by_index: dict[int, tuple[list[Result], list[float]]] = {}
    for (res, rew, *_), indices in zip(shares, assignment):
        for k, j in enumerate(indices):
            by_index[j] = (res[k * g:(k + 1) * g], rew[k * g:(k + 1) * g])
    results = [x for j in range(n_uids) for x in by_index[j][0]]
    rewards = [x for j in range(n_uids) for x in by_index[j][1]]
    return results, rewards
