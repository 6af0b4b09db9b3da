"""Adaptive speculation strategy (TLT's adaptive rollout engine): per batch-size bucket, an online
bandit picks what the speculator proposes in an engine step.

Arms: ``off`` (no drafts), ``sources`` (the draft sources only), ``drafter2/4/8`` (the learned
drafter's chain of 2/4/8 tokens only), ``combined`` (sources and drafter, per request the better
proposal). The reward of a step is what it produced per second of wall time: tokens appended
over the time from proposing to the end of postprocessing (drafting, the verify forward, host
work). Buckets are powers of two of the running requests: a large batch is compute-bound and
drafts rarely pay; a small one is dominated by per-forward cost, where they do.

UCB1 with rewards scaled to [0, 1] by the bucket's largest reward seen, and discounted
(``discount`` per update of the bucket) because the best arm moves as the drafter trains. Untried
arms go first, in an order drawn from ``seed``; ties go to the earlier arm in that order: given
the seed and the rewards, choices are deterministic. Whatever it picks, output is unchanged:
it only chooses what is proposed, and verification decides what is kept.
"""
from __future__ import annotations

import math
import random
from collections import defaultdict

ARMS = ("off", "sources", "drafter2", "drafter4", "drafter8", "combined")


def bucket_of(n_rows: int) -> int:
    """The power of two at or above ``n_rows``."""
    return 1 << max(0, math.ceil(math.log2(max(1, n_rows))))


def arm_plan(arm: str, combined_k: int) -> tuple[bool, int]:
    """(use the draft sources, drafter chain length) of an arm (also the fixed strategies)."""
    if arm == "off":
        return False, 0
    if arm == "sources":
        return True, 0
    if arm == "combined":
        return True, combined_k
    if arm.startswith("drafter") and arm[7:].isdigit():
        return False, int(arm[7:])
    raise ValueError(f"unknown speculation arm {arm!r}; valid: {list(ARMS)}")


class _Bucket:
    def __init__(self, n_arms: int, order: list[int]):
        self.n = [0.0] * n_arms
        self.s = [0.0] * n_arms
        self.order = order
        self.top = 0.0


class StrategyBandit:
    def __init__(self, arms: tuple[str, ...] = ARMS, c: float = 0.2, discount: float = 0.99, seed: int = 0):
        if not arms or len(set(arms)) != len(arms):
            raise ValueError(f"bandit arms must be distinct and non-empty, got {arms}")
        self.arms, self.c, self.discount = tuple(arms), c, discount
        self._rng = random.Random(seed)
        self._buckets: dict[int, _Bucket] = {}
        self.reset_metrics()

    def reset_metrics(self) -> None:
        """Counters behind :meth:`metrics` (choices and rewards since the last reset)."""
        self.counts: dict[tuple[int, str], int] = defaultdict(int)
        self.reward_sum: dict[tuple[int, str], float] = defaultdict(float)

    def _bucket(self, b: int) -> _Bucket:
        if b not in self._buckets:
            order = list(range(len(self.arms)))
            self._rng.shuffle(order)  # buckets are met in a deterministic order, so this is too
            self._buckets[b] = _Bucket(len(self.arms), order)
        return self._buckets[b]

    def choose(self, n_rows: int) -> str:
        b = bucket_of(n_rows)
        st = self._bucket(b)
        untried = [i for i in st.order if st.n[i] == 0]
        if untried:
            i = untried[0]
        else:
            total = sum(st.n)
            scale = st.top if st.top > 0 else 1.0

            def index(i: int) -> float:
                return st.s[i] / st.n[i] / scale + self.c * math.sqrt(2.0 * math.log(max(total, 1.0)) / st.n[i])

            i = max(st.order, key=lambda j: (index(j), -st.order.index(j)))
        self.counts[(b, self.arms[i])] += 1
        return self.arms[i]

    def update(self, n_rows: int, arm: str, reward: float) -> None:
        b = bucket_of(n_rows)
        st = self._bucket(b)
        i = self.arms.index(arm)
        for j in range(len(self.arms)):
            st.n[j] *= self.discount
            st.s[j] *= self.discount
        st.n[i] += 1.0
        st.s[i] += reward
        st.top = max(st.top, reward)
        self.reward_sum[(b, arm)] += reward

    def best(self, n_rows: int) -> str | None:
        """The arm with the highest mean reward in ``n_rows``' bucket so far (None if none tried)."""
        st = self._buckets.get(bucket_of(n_rows))
        if st is None or not any(st.n):
            return None
        return self.arms[max((i for i in st.order if st.n[i] > 0), key=lambda i: st.s[i] / st.n[i])]

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """What later choices depend on: per bucket the discounted counts and reward sums, the
        largest reward, the order of first tries; and the RNG that orders the buckets not met yet.
        (The figures behind :meth:`metrics` are per step and not included.) Plain python values."""
        version, internal, gauss = self._rng.getstate()
        return {"arms": list(self.arms), "rng": [version, list(internal), gauss],
                "buckets": {b: {"n": list(st.n), "s": list(st.s), "order": list(st.order), "top": st.top}
                            for b, st in self._buckets.items()}}

    def load_state_dict(self, state: dict) -> None:
        if list(state["arms"]) != list(self.arms):
            raise ValueError(f"bandit state was saved with arms {list(state['arms'])}; this bandit has "
                             f"{list(self.arms)}")
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._buckets = {}
        for b, d in state["buckets"].items():
            st = _Bucket(len(self.arms), list(d["order"]))
            st.n, st.s, st.top = [float(x) for x in d["n"]], [float(x) for x in d["s"]], float(d["top"])
            self._buckets[int(b)] = st

    def metrics(self) -> dict[str, float]:
        """``spec_strategy/<bucket>/<arm>``: steps that chose the arm; ``.../<arm>_reward``: their
        mean reward (tokens per second)."""
        out: dict[str, float] = {}
        for (b, arm), n in sorted(self.counts.items()):
            out[f"spec_strategy/{b}/{arm}"] = n
            out[f"spec_strategy/{b}/{arm}_reward"] = self.reward_sum[(b, arm)] / n
        return out
