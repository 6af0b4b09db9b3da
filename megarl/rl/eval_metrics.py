"""The figures of a held-out evaluation (megarl/stages/evaluate.py): mean reward, pass@k with the
unbiased estimator, response lengths and the truncation rate. Pure functions of the samples."""
from __future__ import annotations

import math
from collections.abc import Sequence

PREFIX = "eval/"
"""Every evaluation metric's key starts with it (metrics.jsonl, TensorBoard and W&B panels)."""
GREEDY_REWARD = PREFIX + "greedy/reward_mean"  # (with eval.greedy: the greedy pass's figures)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` correct samples out of ``n`` (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code"): ``1 - C(n-c, k) / C(n, k)``, the chance
    that k samples drawn without replacement from the n hold at least one correct one. Exact
    integer binomials, one rounding at the end."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(n: int) -> list[int]:
    """The k's reported for ``n`` samples per prompt: 1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def eval_metrics(rewards: Sequence[Sequence[float]], lengths: Sequence[Sequence[int]],
                 truncated: Sequence[Sequence[bool]], threshold: float, prefix: str = PREFIX) -> dict[str, float]:
    """``prefix``-ed figures over prompts (one row per prompt, n samples each): the mean
    reward; ``pass_at_K`` averaged over prompts, a sample counting as correct when its reward is
    at least ``threshold``; mean/max response length; the fraction of responses cut at the token
    limit."""
    if not rewards or any(len(r) != len(rewards[0]) for r in rewards):
        raise ValueError("eval_metrics needs at least one prompt and the same number of samples for each")
    n = len(rewards[0])
    flat_r = [r for row in rewards for r in row]
    flat_len = [x for row in lengths for x in row]
    flat_cut = [x for row in truncated for x in row]
    out = {"prompts": float(len(rewards)), "samples": float(n), "reward_mean": math.fsum(flat_r) / len(flat_r)}
    correct = [sum(r >= threshold for r in row) for row in rewards]
    for k in ks_for(n):
        out[f"pass_at_{k}"] = math.fsum(pass_at_k(n, c, k) for c in correct) / len(correct)
    out["response_len_mean"] = math.fsum(flat_len) / len(flat_len)
    out["response_len_max"] = float(max(flat_len))
    out["truncated_frac"] = sum(flat_cut) / len(flat_cut)
    return {prefix + k: v for k, v in out.items()}


def eval_line(what: str, m: dict[str, float]) -> str:
    """The progress line of one evaluation (``what``: of which weights, e.g. ``step 10``)."""
    n = int(m[PREFIX + "samples"])
    return (f"eval {what}: {int(m[PREFIX + 'prompts'])} held-out prompts x {n}: reward "
            f"{m[PREFIX + 'reward_mean']:.3f}, pass@1 {m[PREFIX + 'pass_at_1']:.3f}"
            + (f", pass@{n} {m[PREFIX + f'pass_at_{n}']:.3f}" if n > 1 else "")
            + f", length {m[PREFIX + 'response_len_mean']:.1f} (max {m[PREFIX + 'response_len_max']:.0f}), "
              f"truncated {m[PREFIX + 'truncated_frac']:.1%}"
            + (f"; greedy: reward {m[GREEDY_REWARD]:.3f}" if GREEDY_REWARD in m else ""))
