"""The rollout stage of a synchronous GRPO step (docs/design.md §3, step 2): each rollout replica
generates its share of the step's prompts (megarl/sched/placement.py), G samples each, scored in a
worker pool as they finish; a replica done early does bubble work until the last one is; then the
replicas exchange their groups. Which prompts a step takes is megarl/sched/prompts.py's.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import numpy as np
import torch.distributed as dist

from megarl.rl.rewards import RewardConfig
from megarl.engine import Engine, Request, Result, SamplingParams
from megarl.engine.vllm_spec import VLLMSpecConfig
from megarl.sched.bubble import BubbleWorker, PhaseEnd
from megarl.sched.bubble_budget import BubbleBudget
from megarl.sched.placement import LengthHistory, place
from megarl.rl.reward_pool import RewardPool
from megarl.rl.task import Problem
from megarl.sched.timeline import StepTimeline


@dataclass
class RolloutConfig:
    """How responses are sampled (docs/design.md §1: counter-based Gumbel sampling)."""

    prompts_per_step: int = 8
    """Prompts (GRPO groups) per RL step."""
    group_size: int = 8
    """Samples per prompt (G)."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables."""
    max_new_tokens: int = 256
    """Longest response; longer ones are cut (finish_reason=length)."""
    max_batch_size: int = 64
    """Requests decoded together (continuous batching)."""
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    """Engine weights/activations dtype."""
    device: str = "cpu"
    """Engine device (``cpu`` or ``cuda``)."""
    kv_cache: Literal["slots", "paged"] = "slots"
    """Engine KV-cache layout (``EngineConfig.kv_cache``): ``slots`` (a max-length row per request;
    fastest on CPU) or ``paged`` (blocks freed as requests finish, a group's samples share their
    prompt's blocks, Triton decode attention on CUDA). Same tokens either way."""
    cpu_packed_linears: bool = True
    """On CPU in float32/bfloat16, run the engine's linears through oneDNN on weights reordered once
    (``EngineConfig.cpu_packed_linears``): 1.3-3x faster matmuls, one more copy of the weights."""
    placement: Literal["round_robin", "length"] = "round_robin"
    """How a step's prompts are spread over the rollout replicas (multi-process runs):
    ``round_robin`` deals them in order; ``length`` balances their predicted work (each prompt's
    response lengths when last seen; megarl/sched/placement.py). Never changes a sample; it can only
    help once prompts come back (the second epoch over the prompt set)."""

    backend: Literal["megarl", "vllm"] = "megarl"
    """What generates the rollouts: ``megarl`` (megarl's own engine: the exactness reference,
    docs/design.md §1) or ``vllm`` (an in-process ``vllm.LLM``, megarl/engine/vllm_backend.py; the
    optional extra ``make vllm``). The vLLM backend runs on cpu, in float32 or bfloat16, on one or
    several processes, colocated or disaggregated (one vLLM per generating process, rollout TP 1),
    with tail batching, placement, stream training and bubble work, and its samples at T > 0 come from vLLM's seeded sampler, not megarl's
    counter-based noise. Speculation there, at T = 0: megarl's draft sources (``spec.enabled``) or
    vLLM's own methods (``vllm_spec``), docs/rollout_backends.md."""
    vllm_spec: VLLMSpecConfig = field(default_factory=VLLMSpecConfig)
    """vLLM's own speculative methods (``ngram``, ``suffix``) on ``backend: vllm``
    (megarl/engine/vllm_spec.py); ``method: none`` by default."""

    dump: bool = False
    """Write every step's samples (prompt uid, sample index, response token ids, reward) to
    ``RUN_DIR/rollouts.jsonl``, one line per step: for inspecting what the policy generates, and
    for checking that two runs sampled the same tokens (``megarl bench schedule``)."""

    def __post_init__(self):
        import re

        from megarl.utils.dataclass_config import check_number

        for name in ("prompts_per_step", "max_new_tokens", "max_batch_size"):
            check_number(f"rollout.{name}", getattr(self, name), ge=1, integer=True)
        check_number("rollout.group_size", self.group_size, ge=2, integer=True,
                     note="GRPO learns from the differences between a prompt's samples: with one sample per prompt "
                          "every advantage is 0 and the policy never changes")
        check_number("rollout.temperature", self.temperature, ge=0, note="0 = greedy")
        check_number("rollout.top_k", self.top_k, ge=0, integer=True, note="0 = off")
        check_number("rollout.top_p", self.top_p, gt=0, le=1, note="1.0 = off")
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"rollout.device={self.device!r} is invalid; valid: cpu, cuda or cuda:N (N: a GPU index)")


    def engine_config(self, max_seq_len: int):
        """The rollout engine's ``EngineConfig`` from this section (``max_seq_len``: the model's
        context length)."""
        from megarl.engine import EngineConfig  # (the engine imports nothing of the run config)

        return EngineConfig(max_batch_size=self.max_batch_size, max_seq_len=max_seq_len, dtype=self.dtype,
                            device=self.device, kv_cache=self.kv_cache, cpu_packed_linears=self.cpu_packed_linears)

@dataclass
class Group:
    """The G samples of one prompt, with their rewards."""

    problem: Problem
    results: list[Result]
    rewards: list[float] = field(default_factory=list)


class RolloutStage:
    """Generates a step's GRPO groups. With ``replicas`` > 1 (rollout data parallelism) this
    process's rollout group generates its share of the prompts (``rollout.placement``:
    round robin, or balanced by predicted length, megarl/sched/placement.py) and the groups of all
    replicas are exchanged over ``dp_group`` (rank ``replica`` of it is this group's rank), so every
    process returns every group, in ``uids`` order."""

    def __init__(self, engine: Engine, inputs, rollout: RolloutConfig, reward: RewardConfig, replica: int = 0,
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
        self._worker: BubbleWorker | None = None  # bubble work of the last run(), until wait_bubble()
        self.bubble_budget = BubbleBudget()  # which bubble units fit (megarl/sched/bubble_budget.py)
        self._others: list[list[Result]] = []  # other replicas' results of the last run(), for share_drafts()
        self.replica_tokens: list[int] = []  # response tokens each replica generated in the last run()
        # Every process updates it from every group, so all compute the same placement.
        self.history = LengthHistory()
        self.pool = RewardPool(reward.workers, reward.sandbox, reward.adaptive_timeout)
        self.reward_errors = 0  # rewards of the last run() that crashed or hung (scored 0), all replicas
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

    def run(self, uids: list[int], step: int, on_group: Callable[[Group], None] | None = None,
            timeline: StepTimeline | None = None, bubble: Callable[[Callable[[], bool]], dict] | None = None,
            low_priority: bool = False, keep: int | None = None) -> list[Group]:
        """Every group of ``uids`` (all replicas'). ``on_group(group)`` is called, in this process,
        for each group of this replica as soon as its last sample finishes (stream training).

        With several replicas, a replica that finished its share calls ``bubble(stop)`` (bubble
        work, megarl/sched/bubble.py, in its own thread: it must return once ``stop()`` says the
        step's last replica is done; ``low_priority``: at the OS's idle priority) while it waits
        for the others; the replicas then exchange their groups, without waiting for the bubble
        work's last unit (``wait_bubble`` does, before training; ``share_drafts`` then hands the
        step + 1 bubble drafts around). ``timeline`` gets this process's generate / reward /
        train / bubble phases; the rollout phase ends after the exchange.

        ``keep`` (tail batching, megarl/sched/tail.py): stop generating once ``keep`` prompts are
        complete (each replica once its share, ``ceil(keep / replicas)``, is): only the complete
        groups are returned, in ``uids`` order, and the others are left in ``self.aborted``.
        Completion is counted in engine iterations, so which prompts make it is deterministic."""
        tl = timeline if timeline is not None else StepTimeline()
        self.engine.reset_stats()
        errors0 = self.pool.stats()["error_total"]
        assignment = self._assignment(uids)
        mine = [uids[j] for j in assignment[self.replica]]
        scoring = _Scoring(self, mine, on_group, tl)
        should_stop = None
        if keep is not None:
            quota = min(len(mine), math.ceil(keep / self.replicas))
            should_stop = lambda: len(scoring.done) >= quota  # noqa: E731
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
        self.reward_errors = self.pool.stats()["error_total"] - errors0
        if self.replicas > 1:
            results, rewards = self._exchange(uids, step, assignment, results, rewards, bubble, low_priority)
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

    def _exchange(self, uids, step, assignment, results, rewards, bubble, low_priority):
        """Bubble work until every replica is done, then every replica's results and rewards to
        every replica, in ``uids`` order. The bubble work's last unit may still run: see
        :meth:`wait_bubble`."""
        if bubble is not None:
            end = PhaseEnd(self.dp_group, self.tp_group, self.engine.device)
            end.post()
            stop = self.bubble_budget.start(end.over)
            self._worker = BubbleWorker(lambda: bubble(stop), low_priority,
                                        flush_denormal=self.engine.device.type == "cpu")
            end.wait()
            self.bubble_budget.phase_over()
        shares = [None] * self.replicas
        dist.all_gather_object(shares, (results, rewards, self.engine_forwards, self.reward_errors,
                                        dict(self.bubble_budget.unit_s)), group=self.dp_group)
        self.bubble_budget.adopt([s[4] for r, s in enumerate(shares) if r != self.replica])
        g = self.cfg.group_size
        by_index: dict[int, tuple[list[Result], list[float]]] = {}
        for (res, rew, *_), indices in zip(shares, assignment):  # replica r generated uids[indices] in order
            for k, j in enumerate(indices):
                by_index[j] = (res[k * g:(k + 1) * g], rew[k * g:(k + 1) * g])
        self._others = [s[0] for r, s in enumerate(shares) if r != self.replica]
        self.engine_forwards = sum(s[2] for s in shares)
        self.reward_errors = sum(s[3] for s in shares)
        self.replica_tokens = [sum(len(x.tokens) for x in s[0]) for s in shares]
        results = [x for j in range(len(uids)) for x in by_index[j][0]]
        rewards = [x for j in range(len(uids)) for x in by_index[j][1]]
        return results, rewards

    def wait_bubble(self) -> None:
        """After ``run``: wait for the bubble work's last unit, if one is still in flight."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def share_drafts(self, step: int) -> None:
        """After ``wait_bubble`` and any pre-generation of the step: give this replica's engine
        what the others made: their samples as history drafts and the bubble drafts they
        pre-generated for step + 1 (one more small exchange). Nothing to do with one replica."""
        if self.replicas == 1:
            return
        spec = self.engine.spec
        history = spec.source("history") if spec is not None else None
        for res in self._others:
            if history is not None:  # other replicas' samples are history drafts here too
                history.end(res, step, "rollout")
        self._others = []
        bubble_src = spec.bubble if spec is not None else None
        if bubble_src is None:
            return
        shares = [None] * self.replicas
        dist.all_gather_object(shares, bubble_src.drafts(step + 1), group=self.dp_group)
        for r, drafts in enumerate(shares):
            if r != self.replica and drafts:
                bubble_src.merge(step + 1, drafts)

    def close(self) -> None:
        """Stop the reward pool's threads (after the last ``run``)."""
        self.pool.close()

    def groups(self, uids: list[int], results: list[Result]) -> list[Group]:
        """The results of ``requests(uids)`` as GRPO groups, with their rewards scored here, one
        by one (``run`` scores them in the pool as they finish)."""
        tok, g = self.inputs.tokenizer, self.cfg.group_size
        groups = []
        for k, u in enumerate(uids):
            p, res = self.inputs.problems[u], results[k * g:(k + 1) * g]
            rewards = [float(self.inputs.reward_fn(p, tok.decode(r.tokens))) for r in res]
            groups.append(Group(problem=p, results=res, rewards=rewards))
        return groups

    def pregenerate(self, uids: list[int], step: int, should_stop: Callable[[], bool] | None = None) -> int:
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
            "reward_timeout_s": self.pool.stats()["timeout_s"],
            "rollout_tokens": int(lens.sum()),
            "target_forwards": forwards,
            "engine_forwards": self.engine_forwards,
            # Slowest replica's tokens over the mean: 1.0 is a perfectly balanced step.
            "replica_token_imbalance": max(self.replica_tokens) / max(1e-9, float(np.mean(self.replica_tokens))),
            # Without speculation every token costs its request one forward.
            "forward_reduction": 1.0 - forwards / max(1, int(lens.sum())),
        }


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


class _Scoring:
    """Rewards of one replica's share of a step, scored in the pool as each response finishes;
    with ``on_group`` (stream training) each group is handed on once its last sample is out and
    scored, strictly in the order the groups finished (the gradients are summed in that order,
    so it must not depend on how fast rewards come back)."""

    def __init__(self, stage: RolloutStage, mine: list[int], on_group, tl: StepTimeline):
        self.stage, self.mine, self.on_group, self.tl = stage, mine, on_group, tl
        self.g = stage.cfg.group_size
        self.results: list[list[Result | None]] = [[None] * self.g for _ in mine]
        self.futures: list[list] = [[None] * self.g for _ in mine]
        self.done: list[int] = []  # groups whose samples are all out, in finishing order
        self.next = 0  # done[next:] are not handed on yet

    def on_finish(self, i: int, result: Result) -> None:
        k = i // self.g  # requests are grouped by prompt: request i is sample i % g of prompt k
        st = self.stage
        self.results[k][i % self.g] = result
        problem = st.inputs.problems[self.mine[k]]
        self.futures[k][i % self.g] = st.pool.submit(st.inputs.reward_fn, problem,
                                                     st.inputs.tokenizer.decode(result.tokens))
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
            group = Group(self.stage.inputs.problems[self.mine[k]], self.results[k],
                          [f.result() for f in self.futures[k]])
            with self.tl.phase("train"):
                self.on_group(group)
            self.next += 1

    def finish(self) -> list[float | None]:
        """After generation: every complete group handed on, and this share's rewards, in
        request order (None for a request aborted by a short round: it was never scored)."""
        self._hand_on(wait=True)
        return [f.result() if f is not None else None for fs in self.futures for f in fs]
