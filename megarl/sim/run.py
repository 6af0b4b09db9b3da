"""Feature combinations, steps and sweeps: what ``megarl simulate`` reports.

Every combination runs the same steps' length draws (common random numbers: step i draws from
``(seed, i)``), so the speedups compare like with like. The first step only warms up what a step
leaves the next (bubble drafts, drafter freshness) and is not averaged. Tail batching runs
short rounds of ``ceil(eta * P)`` fresh prompts that stop at P complete ones, and a long round
over the deferred prompts whenever P are queued (megarl/sched/tail.py); it is simulated over at
least one whole cycle of short rounds and a long round.
"""
from __future__ import annotations

import io
import math
from dataclasses import replace

import numpy as np

from megarl.sim.config import SimConfig
from megarl.sim.lengths import StepLengths, draw
from megarl.sim.step import CarryOver, StepResult, simulate_step
from megarl.utils.fs import atomic_write_bytes

# The plain synchronous baseline (veRL-like) is the empty set.
COMBOS: dict[str, frozenset] = {
    "placement": frozenset({"placement"}),
    "spec": frozenset({"spec"}),
    "spec+bubble": frozenset({"spec", "bubble"}),
    "spec+drafter": frozenset({"spec", "drafter"}),
    "stream": frozenset({"stream"}),
    "tail": frozenset({"tail"}),
    "megarl": frozenset({"placement", "spec", "bubble", "drafter", "stream"}),
    "megarl+tail": frozenset({"placement", "spec", "bubble", "drafter", "stream", "tail"}),
}
KEYS = ("step_time_s", "rollout_share", "tail_share", "bubble_frac")


def sources_for(features: frozenset) -> tuple:
    """Draft sources a feature set enables: history and siblings with ``spec``, coupled bubble
    drafts with ``bubble``, the learned drafter with ``drafter``."""
    if "spec" not in features:
        return ()
    return ("history", "group") + (("bubble",) if "bubble" in features else ()) + \
        (("drafter",) if "drafter" in features else ())


def summarize(results: list[StepResult]) -> dict[str, float]:
    """Means over steps: step time; rollout share of all step time; tail share and bubble
    fraction weighted by rollout time."""
    ro = np.array([r.rollout_s for r in results])
    step = np.array([r.step_time_s for r in results])
    w = ro / ro.sum()
    return {"step_time_s": float(step.mean()), "rollout_share": float(ro.sum() / step.sum()),
            "tail_share": float((w * [r.tail_share for r in results]).sum()),
            "bubble_frac": float((w * [r.bubble_frac for r in results]).sum())}


def simulate(cfg: SimConfig, features: frozenset, profile=None) -> dict[str, float]:
    """Mean figures of ``cfg.steps`` steps (the first not counted) with ``features`` on."""
    return summarize(simulate_steps(cfg, features, profile))


def simulate_steps(cfg: SimConfig, features: frozenset, profile=None) -> list[StepResult]:
    profile = profile or cfg.make_profile()
    spec = replace(cfg.spec, sources=sources_for(features))
    P, R = cfg.step_prompts(), cfg.replicas
    preset = cfg.length_preset
    carry = CarryOver()
    out: list[StepResult] = []
    if "tail" not in features:
        for i in range(cfg.steps):
            sl = draw(preset, P, np.random.default_rng([cfg.seed, i]))
            res, carry = simulate_step(sl, features, profile, cfg.knobs, spec, R, carry,
                                       np.random.default_rng([cfg.seed, i, 1]))
            if i > 0:
                out.append(res)
        return out
    eta = cfg.tail_overprovision
    cycle = math.ceil(1.0 / (eta - 1.0)) + 1  # short rounds until P are deferred, then a long one
    queue: list[StepLengths] = []
    for i in range(max(cfg.steps, cycle + 1)):
        rng = np.random.default_rng([cfg.seed, i, 1])
        if sum(q.prompts for q in queue) >= P:
            sl, queue = _take(queue, P)
            keep = None
        else:
            sl = draw(preset, math.ceil(eta * P), np.random.default_rng([cfg.seed, i]))
            keep = P
        res, carry = simulate_step(sl, features, profile, cfg.knobs, spec, R, carry, rng, keep=keep)
        if keep is not None and not res.complete.all():
            a = ~res.complete
            queue.append(StepLengths(sl.lengths[a], sl.prompt_len[a], sl.expected[a]))
        if i > 0:
            out.append(res)
    return out


def _take(queue: list[StepLengths], n: int) -> tuple[StepLengths, list[StepLengths]]:
    cat = StepLengths(*(np.concatenate([getattr(q, k) for q in queue]) for k in ("lengths", "prompt_len", "expected")))
    rest = StepLengths(cat.lengths[n:], cat.prompt_len[n:], cat.expected[n:])
    return StepLengths(cat.lengths[:n], cat.prompt_len[:n], cat.expected[:n]), ([rest] if rest.prompts else [])


def report(cfg: SimConfig, sweep: list[int] | None = None, progress: bool = False) -> dict:
    """``{"baseline", "megarl", "speedup", "features"[, "sweep"]}`` for ``cfg`` (see megarl/sim/cli.py)."""
    profile = cfg.make_profile()
    base = simulate(cfg, frozenset(), profile)
    figures = {name: simulate(cfg, f, profile) for name, f in COMBOS.items()}
    out = {"baseline": base, "megarl": figures["megarl"],
           "speedup": base["step_time_s"] / figures["megarl"]["step_time_s"],
           "features": {name: base["step_time_s"] / f["step_time_s"] for name, f in figures.items()}}
    if sweep:
        rows = []
        bar = _progress(sweep, progress)
        for g in bar:
            c = replace(cfg, gpus=g, prompts=None if cfg.prompts is None else cfg.prompts * g // cfg.gpus,
                        knobs=replace(cfg.knobs), spec=replace(cfg.spec))
            p = c.make_profile()
            b, m = simulate(c, frozenset(), p), simulate(c, COMBOS["megarl"], p)
            rows.append({"gpus": g, "prompts": c.step_prompts(), "baseline": b, "megarl": m,
                         "speedup": b["step_time_s"] / m["step_time_s"]})
        out["sweep"] = rows
    return out


def _progress(items, on: bool):
    if not on:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc="simulate sweep", unit="size")


def parse_sweep(text: str) -> list[int]:
    """``8,16,32`` or with an ellipsis, ``8,16,...,8192`` (the first two give the ratio)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        if "..." in parts:
            i = parts.index("...")
            if i < 2 or i != len(parts) - 2:
                raise ValueError
            a, b, last = int(parts[i - 2]), int(parts[i - 1]), int(parts[-1])
            if a < 1 or b <= a or b % a:
                raise ValueError
            vals = [int(p) for p in parts[:i]]
            while vals[-1] * (b // a) <= last:
                vals.append(vals[-1] * (b // a))
            if vals[-1] != last:
                vals.append(last)
        else:
            vals = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"--sweep={text!r} is invalid; valid: comma-separated GPU counts, e.g. 8,64,512 or "
                         f"8,16,...,8192") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"--sweep={text!r} is invalid; valid: GPU counts >= 1")
    return vals


def format_table(rep: dict) -> str:
    lines = [f"{'combination':<14} {'speedup':>8}",
             (f"{'baseline':<14} {1.0:>8.2f}   step {rep['baseline']['step_time_s']:.1f}s, rollout "
             f"{rep['baseline']['rollout_share']:.0%}, tail {rep['baseline']['tail_share']:.0%}, bubble "
             f"{rep['baseline']['bubble_frac']:.0%}")]
    lines += [f"{name:<14} {s:>8.2f}" for name, s in rep["features"].items()]
    m = rep["megarl"]
    lines.append(f"megarl: step {m['step_time_s']:.1f}s, rollout {m['rollout_share']:.0%}, tail {m['tail_share']:.0%}, "
                 f"bubble {m['bubble_frac']:.0%}; speedup {rep['speedup']:.2f}x")
    for row in rep.get("sweep", []):
        b, mm = row["baseline"], row["megarl"]
        lines.append(f"gpus {row['gpus']:>5}  prompts {row['prompts']:>6}  baseline {b['step_time_s']:7.1f}s "
                     f"(rollout {b['rollout_share']:.0%}, tail {b['tail_share']:.0%}, bubble {b['bubble_frac']:.0%})  "
                     f"megarl {mm['step_time_s']:7.1f}s (bubble {mm['bubble_frac']:.0%})  speedup {row['speedup']:.2f}x")
    return "\n".join(lines)


def write_plot(rep: dict, path: str, title: str) -> None:
    """Speedup per combination (left) and, with a sweep, step time and speedup vs GPUs (right);
    drawn on an Agg canvas and written atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sweep = rep.get("sweep")
    fig = Figure(figsize=(12 if sweep else 6.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2 if sweep else 1, 1)
    names = list(rep["features"])
    ax.barh(names, [rep["features"][n] for n in names], color="tab:blue")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("step-time speedup vs. synchronous baseline")
    ax.set_title(title, fontsize=9)
    if sweep:
        ax2 = fig.add_subplot(1, 2, 2)
        g = [r["gpus"] for r in sweep]
        ax2.plot(g, [r["baseline"]["step_time_s"] for r in sweep], "o-", label="baseline step (s)")
        ax2.plot(g, [r["megarl"]["step_time_s"] for r in sweep], "s-", label="megarl step (s)")
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("GPUs")
        ax2.set_ylabel("step time (s)")
        ax3 = ax2.twinx()
        ax3.plot(g, [r["speedup"] for r in sweep], "^--", color="tab:green", label="speedup")
        ax3.set_ylabel("speedup")
        ax3.set_ylim(bottom=0)
        ax2.legend(loc="lower left", fontsize=8)
        ax3.legend(loc="lower right", fontsize=8)
        ax2.set_title("weak scaling (same responses per GPU)", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())
