"""Which prompts each RL step trains on: fixed blocks of the epochs' orders, or tail batching's
rounds (megarl/sched/tail.py). A pure function of the seed and the step (plus the tail batcher's
state, which goes into checkpoints), so every process, a resumed run and a rank that works ahead
agree."""
from __future__ import annotations

from megarl.rl.data import epoch_order
from megarl.sched.tail import Round, TailBatcher, TailConfig


def prompt_uids_for_step(step: int, prompts_per_step: int, seed: int, n: int) -> list[int]:
    """The ``prompts_per_step`` prompts of step ``step`` without tail batching: consecutive blocks
    of the epochs' orders (``epoch_order``), so an epoch's prompts are all seen before the next."""
    p = prompts_per_step
    if p > n:
        raise ValueError(f"rollout.prompts_per_step={p} is larger than the prompt set ({n} prompts)")
    orders: dict[int, list[int]] = {}
    uids = []
    for i in range(step * p, (step + 1) * p):
        if i // n not in orders:
            orders[i // n] = epoch_order(seed, i // n, n)
        uids.append(orders[i // n][i % n])
    return uids


class PromptSchedule:
    """The prompts of each RL step: a fixed block per step (``prompt_uids_for_step``), or tail
    batching's rounds (:class:`TailBatcher`). Its state goes into the checkpoint."""

    def __init__(self, prompts_per_step: int, seed: int, rl_steps: int, tail: TailConfig, n_prompts: int):
        self._fixed = lambda step: prompt_uids_for_step(step, prompts_per_step, seed, n_prompts)  # noqa: E731
        self.rl_steps = rl_steps
        self.tail = TailBatcher(prompts_per_step, tail.overprovision, n_prompts, seed) if tail.enabled else None

    def round(self, step: int) -> Round:
        return self.tail.plan() if self.tail is not None else Round(long=False, uids=self._fixed(step), keep=None)

    def next_uids(self, step: int, rnd: Round) -> list[int] | None:
        """The prompts step + 1 most likely starts (for bubble drafts made ahead): exact without
        tail batching; with it, the next fresh block (the next round may be a long one instead)."""
        if step + 1 >= self.rl_steps:
            return None
        if self.tail is None:
            return self._fixed(step + 1)
        t = self.tail
        return t._fresh(t.cursor + (0 if rnd.long else len(rnd.uids)), t.short_size)

    def commit(self, rnd: Round, finished: list[int]) -> dict[str, float]:
        """Record the round's outcome; returns its metrics."""
        if self.tail is None:
            return {}
        deferred = self.tail.commit(rnd, finished)
        return {"tail_long_round": float(rnd.long), "tail_deferred": len(deferred), "tail_queue": len(self.tail.queue)}

    def state_dict(self) -> dict:
        return {"tail": self.tail.state_dict()} if self.tail is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.tail is not None:
            if "tail" not in state:
                raise ValueError("the checkpoint was written without tail batching (no 'tail' state): resume with "
                                 "tail.enabled=false, or start a new run")
            self.tail.load_state_dict(state["tail"])
