"""The rollout engine of every replica at once: continuous batching as a discrete-event fluid.

Each replica runs megarl's engine loop (megarl/engine/engine.py): requests are admitted into
``max_batch`` slots in order, a group's prompt is cached by one prefill forward, and every engine
iteration decodes one row per running request (plus its draft rows with speculation). Between
two *events* (a request finishes, a slot frees and the next request is admitted, a request
leaves its bubble-draft prefix, a short round reaches its quota) the batch is constant, so the
iterations in between are costed in one go: ``delta`` iterations cost
``delta * decode_s(batch, rows, mean context)`` (exact for a linear profile, whose cost is linear
in the context that grows by the same tokens every iteration). Requests advance ``tau`` tokens
per iteration (1 without speculation, megarl/sim/spec.py's expectation with it).

All replicas advance together, one event each per loop turn, on ``[replicas, requests]`` arrays:
thousands of replicas cost a few hundred numpy passes. Times are *work* seconds of the replica's
own device; megarl/sim/share.py turns them into wall time where processes share CPU cores.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megarl.sim.hardware import Profile

_EPS = 1e-9


@dataclass
class RolloutResult:
    """Per request ``finish`` (work seconds from the replica's start; NaN: aborted or never
    started) and ``done`` (tokens generated); per replica ``end`` (its last iteration),
    ``iterations`` and ``forwards`` (target forwards summed over its requests)."""

    finish: np.ndarray
    done: np.ndarray
    end: np.ndarray
    iterations: np.ndarray
    forwards: np.ndarray


def run_rollout(lens: np.ndarray, prompt: np.ndarray, profile: Profile, *, group: int, max_batch: int,
                alpha_cover: np.ndarray | None = None, cover: np.ndarray | None = None,
                alpha_rest: np.ndarray | None = None, k_choices=(0,), spec_max_batch: int = 1 << 30,
                fixed_tau: np.ndarray | None = None, fixed_draft: np.ndarray | None = None,
                quota: np.ndarray | None = None, budget: np.ndarray | None = None, coarsen: float = 0.0
                ) -> RolloutResult:
    """Simulate ``lens[r, j]`` response tokens (0: no request) on replica ``r``.

    Requests ``j`` of a replica are in admission order, ``group`` consecutive ones per prompt.
    Speculation: either adaptive (``alpha_*``, ``cover``: per-request acceptance inside and past
    its bubble-draft prefix of ``cover`` tokens; the draft length is picked from ``k_choices`` per
    replica per event window to maximise tokens per second, 0 above ``spec_max_batch`` running
    requests), or fixed (``fixed_tau`` tokens and ``fixed_draft`` draft rows per forward: replays
    of measured runs). ``quota[r]``: stop replica ``r`` once that many of its groups are complete
    (tail batching's short round; the rest are aborted). ``budget[r]``: stop once ``r`` has spent
    that many work seconds (bubble pre-generation, preempted at the end of the rollout phase).

    ``coarsen`` > 0 merges events closer than that share of the iterations run so far into one
    window (requests finishing inside it are charged to its end): 0.02 makes thousands of replicas
    ~3x faster to simulate for well under 1% on the rollout time; 0 is exact."""
    lens = np.asarray(lens, dtype=np.float64)
    R, K = lens.shape
    if K % group:
        raise ValueError(f"requests per replica ({K}) must be whole groups of {group}")
    full = lambda x, fill=0.0: np.broadcast_to(np.asarray(fill if x is None else x, dtype=np.float64),
                                               lens.shape).copy()
    s = {"lens": lens, "prompt": full(prompt), "cover": full(cover), "a_rest": full(alpha_rest)}
    s["a_cov"] = s["a_rest"] if alpha_cover is None else full(alpha_cover)
    if fixed_tau is not None:
        s["tau"], s["draft"] = full(fixed_tau), full(fixed_draft)
    real = lens > 0
    s.update(real=real, qpos=np.cumsum(real, axis=1) - 1,  # admission order among a replica's requests
             done=np.zeros((R, K)), fin=~real, started=np.zeros((R, K), dtype=bool), finish=np.full((R, K), np.nan),
             stopped=np.zeros(R, dtype=bool), t=np.zeros(R), iters=np.zeros(R), forwards=np.zeros(R),
             budget=np.full(R, np.inf) if budget is None else np.asarray(budget, dtype=np.float64).copy(),
             quota=None if quota is None else np.asarray(quota).copy())
    out = {k: s[k].copy() for k in ("done", "finish", "t", "iters", "forwards")}
    rows_of = np.arange(R)  # the replicas still simulated: finished ones are dropped as they go
    ks = np.asarray(sorted(set(k_choices)), dtype=np.float64)
    while rows_of.size:
        live = _advance(s, profile, group, max_batch, ks, spec_max_batch, coarsen)
        if live.all():
            continue
        for k, arr in out.items():  # write back the replicas that are done, keep simulating the others
            arr[rows_of[~live]] = s[k][~live]
        rows_of = rows_of[live]
        s = {k: (v[live] if isinstance(v, np.ndarray) else v) for k, v in s.items()}
    return RolloutResult(out["finish"], out["done"], out["t"], out["iters"], out["forwards"])


def _draft_length(alpha: np.ndarray, active: np.ndarray, b: np.ndarray, ctx0: np.ndarray, profile: Profile,
                  ks: np.ndarray, spec_max_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The draft length of ``ks`` that maximises each replica's accepted tokens per second at
    acceptance rates ``alpha``: tokens per forward of each request, and target rows per forward."""
    act = active.astype(np.float64)
    tau, rows = np.ones(alpha.shape), b.astype(np.float64)
    if (alpha > 0).any() and ks.size > 1:
        # tau(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha), the powers built up by products
        # (np.power over every request for every k was most of the run time).
        inv = 1.0 / (1.0 - alpha)
        best = act.sum(axis=1) / profile.decode_s(b, rows, ctx0)  # k = 0
        q, k_prev = alpha.copy(), 0
        for k in ks[ks > 0]:
            for _ in range(int(k) - k_prev):
                q *= alpha
            k_prev = int(k)
            tk = (1.0 - q) * inv
            rk = b * (1.0 + k)
            score = np.einsum("ij,ij->i", act, tk) / (profile.decode_s(b, rk, ctx0) + profile.spec_s(b, rk - b))
            take = (score > best * (1 + 1e-9)) & (b <= spec_max_batch)
            if take.any():
                best = np.where(take, score, best)
                tau = np.where(take[:, None], tk, tau)
                rows = np.where(take, rk, rows)
    return tau, rows


def _advance(s: dict, profile: Profile, group: int, max_batch: int, ks: np.ndarray, spec_max_batch: int,
             coarsen: float) -> np.ndarray:
    """One event window of every replica in ``s`` (updated in place); returns which replicas
    still have work."""
    lens, prompt, real, fin, done = s["lens"], s["prompt"], s["real"], s["fin"], s["done"]
    R, K = lens.shape
    n_fin = (fin & real).sum(axis=1)
    newly = real & ~s["started"] & (s["qpos"] < (max_batch + n_fin)[:, None]) & ~s["stopped"][:, None]
    if newly.any():  # prefill: one forward caching the new prompts (shared by a group's samples)
        s["t"] += profile.prefill_s((prompt * newly).sum(axis=1) / group)
        s["started"] |= newly
    active = s["started"] & ~fin & ~s["stopped"][:, None]
    b = active.sum(axis=1)
    live = b > 0
    if not live.any():
        return live
    ctx0 = (active * (prompt + done)).sum(axis=1)
    cover = s["cover"]
    in_cover = done < cover - _EPS
    if "tau" in s:
        tau = s["tau"]
        rows = (active * (1.0 + s["draft"])).sum(axis=1)
        boundary = lens
    else:
        alpha = np.where(in_cover, s["a_cov"], s["a_rest"])
        tau, rows = _draft_length(alpha, active, b, ctx0, profile, ks, spec_max_batch)
        boundary = np.where(in_cover, cover, lens)
    dist = np.where(active, (boundary - done) / tau, np.inf)
    step = np.ceil(dist.min(axis=1) - 1e-6)
    if coarsen > 0:  # never past the last running request's end: that would charge idle iterations
        last = np.ceil(np.where(active, dist, 0.0).max(axis=1) - 1e-6)
        step = np.minimum(np.maximum(step, np.ceil(coarsen * s["iters"])), last)
    delta = np.where(live, np.maximum(1.0, step), 0.0)
    rate = (active * tau).sum(axis=1)
    per_iter = profile.decode_s(b, rows, ctx0 + rate * np.maximum(delta - 1, 0) / 2)
    # Drafting costs host work per request (replays: every iteration of a speculative run).
    per_iter = np.where(live, per_iter + profile.spec_s(b, rows - b) * (("tau" in s) | (rows > b)), 0.0)
    t = s["t"]
    # Preempted bubble work stops mid-window, after the iterations its budget pays for.
    over = live & (t + delta * per_iter > s["budget"])
    delta = np.where(over, np.maximum(0.0, (s["budget"] - t) / np.maximum(per_iter, _EPS)), delta)
    t += delta * per_iter
    s["iters"] += delta
    s["forwards"] += delta * b
    s["done"] = done = np.where(active, np.minimum(done + tau * delta[:, None], lens), done)
    newly_fin = active & (done >= lens - 1e-6)
    s["finish"] = np.where(newly_fin, t[:, None], s["finish"])
    fin |= newly_fin
    s["stopped"] |= over
    if s["quota"] is not None:
        complete = (fin & real).reshape(R, K // group, group).all(axis=2) & real[:, ::group]
        s["stopped"] |= complete.sum(axis=1) >= s["quota"]
    # Still work: running or waiting requests, and not stopped.
    return ~s["stopped"] & ((real & ~fin).any(axis=1))
