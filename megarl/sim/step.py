"""One synchronous RL step: placement -> rollout (+ bubble work) -> train -> weight sync.

The step of megarl/train.py, as events on every rank:

1. **Placement** of the step's prompts on the R rollout replicas: megarl's own algorithm
   (megarl/sched/placement.py: round robin, or LPT) on noisy history predictions
   (megarl/sim/lengths.py ``noisy_prediction``). A group stays on one replica.
2. **Rollout**: every replica runs its share (megarl/sim/rollout.py), with speculation when on
   (acceptance per source, bubble-draft prefixes from the previous step: megarl/sim/spec.py).
   A replica that is done does *bubble work* until the last one is: stream training of its own
   finished groups, then drafter training, then pre-generation of the next step's responses
   (bubble drafts), in that order (``schedule.bubble_work``). On CPU, bubble work runs at idle
   priority on shared cores (megarl/sim/share.py). The rollout phase ends when the last replica
   is done, plus the exchange of the step's samples.
3. **Train**: without stream training, every trainer DP rank trains its strided share of the
   step's sequences (old-logprob forward + forward/backward); with it, each replica trains the
   groups it generated that its bubbles did not get to (``stream_balance='own'``, megarl's rule;
   ``'pooled'`` spreads the leftovers over every rank instead, a what-if). Then the gradient
   all-reduce and optimizer step, and the weight sync.

Figures: ``step_time_s``; ``rollout_share`` = rollout phase / step; ``tail_share`` = time the
last 10% of the step's responses took to finish, over the rollout phase (90% of the responses
are done at t90; (last finish - t90) / rollout phase); ``bubble_frac`` = idle rank-seconds over
rank-seconds of the rollout phase (megarl/sched/timeline.py's definition: bubble work counts as
busy while it has work to do).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from megarl.sched.placement import lpt, round_robin
from megarl.sim.hardware import Profile
from megarl.sim.lengths import StepLengths, noisy_prediction
from megarl.sim.rollout import run_rollout
from megarl.sim.share import run_phase
from megarl.sim.spec import SpecModel

FEATURES = ("placement", "spec", "bubble", "drafter", "stream", "tail")


@dataclass
class StepKnobs:
    """The model's parameters that are not the device's (``SimConfig`` fills them)."""

    group: int = 8
    """Samples per prompt (G)."""
    max_batch: int = 256
    """KV-cache slots per replica (running requests at most)."""
    tp: int = 1
    """GPUs per rollout replica; the trainer uses the same TP (stream training's constraint)."""
    predictor_sigma: float = 0.5
    """Log-std of the history length predictor's error (LPT placement)."""
    drafter_need_s: float = 5.0
    """Bubble work seconds per replica per step that keep the learned drafter fresh."""
    stream_balance: str = "own"
    """Stream-training leftovers after the rollout: ``own`` (each replica its own groups: megarl) or
    ``pooled`` (spread over all ranks)."""
    pregen_after: bool = False
    """Bubble drafts made after the rollout phase instead of in its bubbles (``spec.bubble_pregen``
    with ``pregen`` not in ``schedule.bubble_work``, or one replica: megarl/train.py): every
    replica generates its share of the next step in full, at normal priority, before training."""
    coarsen: float = 0.0
    """Event merging of the rollout model (megarl/sim/rollout.py); 0 is exact."""

    def __post_init__(self) -> None:
        if self.stream_balance not in ("own", "pooled"):
            raise ValueError(f"stream_balance={self.stream_balance!r} is invalid; valid choices: ['own', 'pooled']")


@dataclass
class StepResult:
    """What one simulated step took (seconds) and its shape."""

    step_time_s: float
    rollout_s: float
    train_s: float
    sync_s: float
    bubble_frac: float
    tail_share: float
    responses: int
    complete: np.ndarray
    """Per prompt of the step: all samples finished (False: aborted by a short round)."""
    extra: dict = field(default_factory=dict)


@dataclass
class CarryOver:
    """What a step leaves the next: bubble-draft prefix tokens per replica share, drafter
    freshness, and length history by prompt uid (replays)."""

    cover: np.ndarray | None = None
    drafter_fresh: float = 0.0


def to_matrix(values: np.ndarray, assignment: list[np.ndarray], fill=0) -> np.ndarray:
    """Per-prompt rows ``values[p]`` (shape [P, ...]) laid out as [replicas, max prompts per
    replica, ...], padded with ``fill``."""
    width = max((len(a) for a in assignment), default=0)
    out = np.full((len(assignment), width, *values.shape[1:]), fill, dtype=values.dtype)
    for r, a in enumerate(assignment):
        out[r, :len(a)] = values[a]
    return out


def tail_share(finish: np.ndarray, rollout_s: float) -> float:
    """(last finish - time by which 90% of the responses finished) / rollout phase."""
    f = np.sort(np.asarray(finish, dtype=np.float64).ravel())
    f = f[~np.isnan(f)]
    if f.size == 0 or rollout_s <= 0:
        return 0.0
    t90 = f[math.ceil(0.9 * f.size) - 1]
    return float((f[-1] - t90) / rollout_s)


def simulate_step(sl: StepLengths, features: frozenset, profile: Profile, knobs: StepKnobs, spec: SpecModel,
                  replicas: int, carry: CarryOver, rng: np.random.Generator, *, pred: np.ndarray | None = None,
                  seen: np.ndarray | None = None, keep: int | None = None, fixed_tau: float | np.ndarray | None = None,
                  fixed_draft: float | None = None) -> tuple[StepResult, CarryOver]:
    """One step of ``sl``'s prompts with ``features`` on. ``keep``: tail batching's short round
    (stop once ``keep`` prompts are complete, ``ceil(keep / replicas)`` per replica). Replays
    pass the run's own ``pred`` (length history), ``seen`` and measured ``fixed_tau`` /
    ``fixed_draft`` (tokens and draft rows per target forward; ``fixed_tau`` a number, or one
    per response, shaped as ``sl.lengths``)."""
    G, R, P = knobs.group, replicas, sl.prompts
    _check_step(features, P, R)
    # 1. placement
    assign = _placement(sl, features, knobs, spec, R, rng, pred)
    lens = to_matrix(sl.lengths, assign).reshape(R, -1)
    prompt = to_matrix(np.repeat(sl.prompt_len[:, None], G, axis=1), assign).reshape(R, -1)
    # 2. rollout
    speculating = "spec" in features or fixed_tau is not None
    kw = _speculation(features, spec, carry, assign, lens, P, G, rng, seen, fixed_tau, fixed_draft)
    quota = None if keep is None else np.full(R, math.ceil(keep / R))
    res = run_rollout(lens, prompt, profile, group=G, max_batch=knobs.max_batch, quota=quota,
                      coarsen=knobs.coarsen, **kw)
    # Bubble work, in schedule order: stream training, drafter training, pre-generation.
    real = lens > 0
    done_groups = (~np.isnan(res.finish) | ~real).reshape(R, -1, G).all(axis=2) & real[:, ::G]
    own = _stream_units_s(lens + prompt, done_groups, profile, knobs) if "stream" in features else np.zeros(R)
    drafter = knobs.drafter_need_s if "drafter" in features and speculating else 0.0
    pregen = "bubble" in features and speculating and R > 1
    phase = run_phase(res.end, [("stream_train", own), ("drafter_train", np.full(R, drafter)),
                                ("pregen", np.full(R, np.inf if pregen else 0.0))], profile)
    rollout_s = phase.barrier + profile.overhead_s(int(real.sum()))
    wall_finish = np.stack([phase.wall_at(r, res.finish[r]) for r in range(R)]) if R else res.finish
    busy = phase.normal_end + phase.idle_busy
    bubble_frac = float(max(0.0, 1.0 - busy.sum() / (R * rollout_s))) if rollout_s > 0 else 0.0
    stream_done = np.minimum(own, phase.idle_done)
    drafter_done = np.clip(phase.idle_done - own, 0.0, drafter)
    pregen_s = np.maximum(0.0, phase.idle_done - own - drafter) if pregen else np.zeros(R)
    new = CarryOver(cover=_pregen_cover(lens, prompt, pregen_s, profile, knobs) if pregen else None,
                    drafter_fresh=float(min(1.0, drafter_done.sum() / (drafter * R))) if drafter else 0.0)
    after_s = 0.0
    if knobs.pregen_after and speculating and not pregen:
        after_s, new.cover = _pregen_after(lens, prompt, profile, knobs)
    # 3. train, gradient all-reduce + optimizer, weight sync (every rank at once).
    complete = np.zeros(P, dtype=bool)
    for r, a in enumerate(assign):
        complete[a] = done_groups[r, :len(a)]
    train = _train_s(sl, features, profile, knobs, complete, own, stream_done, phase, done_groups)
    all_speed = profile.speed(R, "train") if profile.cores is not None else 1.0
    train += profile.finish_s(R) / all_speed
    sync = profile.sync_s(R) / all_speed
    out = StepResult(step_time_s=rollout_s + after_s + train + sync, rollout_s=rollout_s, train_s=train, sync_s=sync,
                     bubble_frac=bubble_frac, tail_share=tail_share(wall_finish, rollout_s),
                     responses=int(real.sum()), complete=complete,
                     extra={"gen_end": phase.normal_end, "forwards": float(res.forwards.sum()),
                            "stream_in_bubble_s": float(stream_done.sum()), "pregen_s": float(pregen_s.sum()),
                            "pregen_after_s": after_s})
    return out, new


def _check_step(features: frozenset, prompts: int, replicas: int) -> None:
    bad = sorted(set(features) - set(FEATURES))
    if bad:
        raise ValueError(f"features {bad} are invalid; valid choices: {list(FEATURES)}")
    if prompts < replicas:
        raise ValueError(f"{prompts} prompts cannot give each of {replicas} rollout replicas one; more prompts or "
                         f"fewer GPUs")


def _stream_units_s(seq_lens: np.ndarray, done_groups: np.ndarray, profile: Profile, knobs: StepKnobs) -> np.ndarray:
    """Each replica's seconds of stream training: its complete groups' forward/backward passes
    (``seq_lens`` [R, responses], prompt + response tokens)."""
    R, G = len(seq_lens), knobs.group
    seqs = seq_lens.reshape(R, -1, G)
    return np.array([sum(profile.train_s(seqs[r, q], stream=True) for q in np.flatnonzero(done_groups[r]))
                     for r in range(R)]) / knobs.tp


def _pregen_after(lens: np.ndarray, prompt: np.ndarray, profile: Profile, knobs: StepKnobs
                  ) -> tuple[float, np.ndarray]:
    """Bubble drafts made after the rollout when no replica was idle: their seconds and cover.
    This step's shares stand in for the next step's (same distribution), generated whole."""
    full = run_rollout(lens, prompt, profile, group=knobs.group, max_batch=knobs.max_batch, coarsen=knobs.coarsen)
    return run_phase(full.end, np.zeros(len(lens)), profile).barrier, full.iterations.copy()


def _placement(sl: StepLengths, features: frozenset, knobs: StepKnobs, spec: SpecModel, R: int,
               rng: np.random.Generator, pred: np.ndarray | None) -> list[np.ndarray]:
    """Each replica's prompt indices: longest-predicted-first with ``placement``, else round robin."""
    if "placement" in features:
        p = pred if pred is not None else noisy_prediction(sl.expected, rng, knobs.predictor_sigma,
                                                            spec.history_coverage)
        placed = lpt(np.asarray(p, dtype=np.float64).tolist(), R)
    else:
        placed = round_robin(sl.prompts, R)
    return [np.asarray(a, dtype=np.int64) for a in placed]


def _speculation(features: frozenset, spec: SpecModel, carry: CarryOver, assign: list[np.ndarray],
                 lens: np.ndarray, P: int, G: int, rng: np.random.Generator, seen: np.ndarray | None,
                 fixed_tau: float | np.ndarray | None, fixed_draft: float | None) -> dict:
    """:func:`run_rollout`'s speculation arguments: a replay's measured tokens per forward, or the
    modelled acceptance (fresh and bubble-covered) with ``spec``; none without speculation."""
    kw: dict = {}
    R = len(assign)
    if fixed_tau is not None:
        tau = np.asarray(fixed_tau, dtype=np.float64)
        if tau.ndim == 2:  # per response ([P, G]), laid out as the lengths are
            tau = to_matrix(tau, assign, fill=1.0).reshape(R, -1)
        kw.update(fixed_tau=tau, fixed_draft=fixed_draft or 0.0)
    elif "spec" in features:
        s = seen if seen is not None else rng.random(P) < spec.history_coverage
        rest = spec.rest_alpha(s, carry.drafter_fresh)
        rest = np.repeat(to_matrix(rest, assign), G, axis=1)
        kw.update(alpha_rest=rest, alpha_cover=spec.cover_alpha(rest), k_choices=spec.k_choices,
                  spec_max_batch=spec.max_batch)
        if "bubble" in spec.sources and carry.cover is not None:
            kw["cover"] = np.minimum(lens, carry.cover[:, None])
    return kw


def _train_s(sl: StepLengths, features: frozenset, profile: Profile, knobs: StepKnobs, complete: np.ndarray,
             own: np.ndarray, stream_done: np.ndarray, phase, done_groups: np.ndarray) -> float:
    """The train phase's seconds after the rollout: what stream training left over (pooled or per
    replica), or every complete group's rows split over the DP ranks."""
    R = len(own)
    if "stream" in features:
        left = own - stream_done
        if knobs.stream_balance == "pooled":
            left = np.full(R, left.sum() / R)
    else:
        # DP rank r trains rows r::R of the step's sequences in prompt order (megarl/rl/batching.py).
        flat = (sl.lengths + sl.prompt_len[:, None])[complete].ravel()
        left = np.array([profile.train_s(flat[r::R], stream=False) for r in range(R)]) / knobs.tp
    train = run_phase(left, np.zeros(R), profile, work="train").barrier
    if "stream" in features and R > 1 and (phase.idle_done < own - 1e-12).any():
        # The replicas exchange without waiting for the stream-training unit in flight; training
        # waits for it (megarl/rollout/stage.py wait_bubble): half a group's forward/backward on average.
        # (An upper bound: the bubble budget, megarl/sched/bubble_budget.py, starts no unit it expects
        # to overrun the bubble; at GPU unit lengths the two agree.)
        unit = own[own > 0].sum() / max(1, int(done_groups[own > 0].sum()))
        train += 0.5 * unit / (profile.speed(R, "train") if profile.cores is not None else 1.0)
    return train


def _pregen_cover(lens: np.ndarray, prompt: np.ndarray, budget: np.ndarray, profile: Profile, knobs: StepKnobs
                  ) -> np.ndarray:
    """Bubble-draft prefix (tokens per request) of each replica share of the next step, from
    each replica's pre-generation seconds. Replica r pre-generates share r (no speculation; this
    step's share r stands in for the next one's lengths, same distribution) and, once that is
    complete, share r + 1 with what is left (megarl/rollout/stage.py pregenerate goes on cyclically; one hop
    is modelled)."""
    R = lens.shape[0]
    first = run_rollout(lens, prompt, profile, group=knobs.group, max_batch=knobs.max_batch, budget=budget,
                        coarsen=knobs.coarsen)
    cover = first.iterations.copy()
    left = np.where(first.end < budget - 1e-12, budget - first.end, 0.0)
    if (left > 0).any() and R > 1:
        nxt = np.roll(np.arange(R), -1)
        second = run_rollout(lens[nxt], prompt[nxt], profile, group=knobs.group, max_batch=knobs.max_batch,
                             budget=left, coarsen=knobs.coarsen)
        cover[nxt] = np.maximum(cover[nxt], np.where(left > 0, second.iterations, 0.0))
    return cover
