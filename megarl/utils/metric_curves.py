"""The metric curves of ``megarl report``: how a run learned and where each step's time went,
drawn from ``RUN_DIR/metrics.jsonl`` (one line per RL step; see README's run directory table).

``reward.png``
    ``reward_mean`` and ``reward_max`` per step: learning shows as the mean rising toward the max.
``entropy.png``
    ``entropy_mean``, the policy's mean sampling entropy per token: a collapse to ~0 means the
    policy stopped exploring (and GRPO groups stop having reward variance).
``response_length.png``
    ``response_len_mean``, ``response_len_p50`` and ``response_len_max``: the max pulling away
    from the median is the long tail that makes synchronous rollouts wait.
``eval.png`` and ``eval_length.png``
    With evaluation on (the ``eval`` section, megarl/stages/evaluate.py): the held-out set's
    ``eval/reward_mean``, ``eval/pass_at_K`` for each K logged (and ``eval/greedy/pass_at_1``
    with ``eval.greedy``), and its response lengths
    (``eval/response_len_mean``, ``eval/response_len_max``), at the evaluated steps; step 0 is
    the policy before RL.
``step_time.png``
    Per step, stacked bars of ``rollout_time_s``, ``bubble_time_s`` (work after the rollout
    that the bubble schedule left), ``train_time_s`` and ``weight_sync_s``, plus ``other``: what
    remains of ``step_time_s`` (gathering the timeline, logging). Bar heights sum to
    ``step_time_s``. Colours are the timeline's phase colours.

A figure whose metrics appear in no line is not drawn (older runs lack some keys); a step missing
one key has a gap in that curve (a missing part of the step time counts as 0 s).
:func:`curve_data` returns exactly the plotted numbers.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from megarl.utils.figures import new_figure
from megarl.utils.jsonl import read_numbered_lines

METRICS_FILE = "metrics.jsonl"

LINE_CURVES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "reward.png": ("Reward", "reward", ("reward_mean", "reward_max")),
    "entropy.png": ("Policy entropy (mean per sampled token)", "nats", ("entropy_mean",)),
    "response_length.png": ("Response length", "tokens", ("response_len_mean", "response_len_p50",
                                                          "response_len_max")),
    "eval.png": ("Held-out evaluation: reward and pass@k", "score", ("eval/reward_mean",)),
    "eval_length.png": ("Held-out evaluation: response length", "tokens", ("eval/response_len_mean",
                                                                          "eval/response_len_max")),
}
"""PNG name -> (title, y label, metrics drawn as lines); ``eval.png`` also draws every
``eval/pass_at_K`` key the lines hold (:func:`_keys`: K depends on ``eval.samples``)."""
EVAL_PASS_PREFIX = "eval/pass_at_"
GREEDY_PASS_1 = "eval/greedy/pass_at_1"  # (with eval.greedy: the greedy responses' accuracy)

STEP_TIME_FILE = "step_time.png"
STEP_TIME_PARTS: dict[str, str] = {"rollout_time_s": "generate", "bubble_time_s": "bubble",
                                   "train_time_s": "train", "weight_sync_s": "sync", "other": "other"}
"""Stacked parts of ``step_time.png`` (bottom first) -> timeline phase whose colour they take."""

Series = tuple[list[int], list[float]]


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def load_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The lines of ``RUN_DIR/metrics.jsonl`` sorted by step, the last line of a repeated step
    winning (the one a resumed run continued from). Errors name ``file:line``; a torn last line
    is dropped with a warning (:func:`megarl.utils.jsonl.read_lines`)."""
    path = Path(run_dir) / METRICS_FILE
    by_step: dict[int, dict] = {}
    for lineno, rec in read_numbered_lines(path):
        step = rec.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:  # 0: the evaluation before RL
            raise ValueError(f"{path}:{lineno}: step must be an integer >= 0, got {step!r}")
        for key in (*{k for _, _, keys in LINE_CURVES.values() for k in keys}, *STEP_TIME_PARTS, "step_time_s"):
            if key in rec and not (_is_num(rec[key]) or rec[key] is None):
                raise ValueError(f"{path}:{lineno}: {key} must be a number, got {rec[key]!r}")
        by_step[step] = rec
    return [by_step[s] for s in sorted(by_step)]


def _series(records: list[dict], key: str) -> Series:
    points = [(r["step"], float(r[key])) for r in records if _is_num(r.get(key))]
    return [s for s, _ in points], [v for _, v in points]


def step_time_split(records: list[dict]) -> dict[str, Series]:
    """The stacked parts of ``step_time.png`` over the steps that have any of them."""
    keys = [k for k in STEP_TIME_PARTS if k != "other"]
    rows = [r for r in records if any(_is_num(r.get(k)) for k in keys)]
    steps = [r["step"] for r in rows]
    out = {k: (steps, [float(r[k]) if _is_num(r.get(k)) else 0.0 for r in rows]) for k in keys}
    parts = [sum(out[k][1][i] for k in keys) for i in range(len(rows))]
    out["other"] = (steps, [max(0.0, float(r["step_time_s"]) - p) if _is_num(r.get("step_time_s")) else 0.0
                            for r, p in zip(rows, parts)])
    return out


def _keys(name: str, keys: tuple[str, ...], records: list[dict]) -> tuple[str, ...]:
    if name != "eval.png":
        return keys
    passes = {k for r in records for k in r if k.startswith(EVAL_PASS_PREFIX)}
    greedy = tuple(k for k in (GREEDY_PASS_1,) if any(k in r for r in records))
    return keys + tuple(sorted(passes, key=lambda k: int(k.removeprefix(EVAL_PASS_PREFIX)))) + greedy


def curve_data(records: list[dict]) -> dict[str, dict[str, Series]]:
    """PNG name -> metric -> (steps, values): exactly what each drawn figure plots."""
    data = {}
    for name, (_, _, keys) in LINE_CURVES.items():
        series = {k: _series(records, k) for k in _keys(name, keys, records)}
        if any(steps for steps, _ in series.values()):
            data[name] = series
    split = step_time_split(records)
    if split["other"][0]:
        data[STEP_TIME_FILE] = split
    return data


def _steps_label(records: list[dict]) -> str:
    a, b = records[0]["step"], records[-1]["step"]
    return f"step {a}" if a == b else f"steps {a}-{b}"


def draw_curves(records: list[dict], colors: dict[str, str], run_name: str = "") -> dict:
    """PNG name -> figure, for the figures :func:`curve_data` has data for. ``colors``: the timeline's
    phase colours (``step_time.png``)."""
    from matplotlib.ticker import MaxNLocator

    figures = {}
    where = f"{run_name}, " if run_name else ""
    for name, series in curve_data(records).items():
        fig = new_figure(4.0)
        ax = fig.add_subplot()
        if name == STEP_TIME_FILE:
            steps = series["other"][0]
            bottom = [0.0] * len(steps)
            for key, (_, values) in series.items():
                ax.bar(steps, values, bottom=bottom, width=0.9, color=colors[STEP_TIME_PARTS[key]], label=key,
                       linewidth=0)
                bottom = [b + v for b, v in zip(bottom, values)]
            title, ylabel = "Step time by phase (stacked; total = step_time_s)", "seconds"
        else:
            title, ylabel, _ = LINE_CURVES[name]
            for key, (steps, values) in series.items():
                if steps:
                    last = values[-1]
                    ax.plot(steps, values, marker="o" if len(steps) <= 60 else None, ms=3,
                            label=f"{key} (last {last:.3g})" if math.isfinite(last) else key)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if name == STEP_TIME_FILE:  # legend top to bottom as the bars stack
            handles, labels = handles[::-1], labels[::-1]
        ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
        ax.set_title(f"{title}, {where}{_steps_label(records)}", fontsize=10)
        figures[name] = fig
    return figures
