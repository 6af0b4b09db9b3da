"""``megarl report RUN_DIR``: where a run's time went, how long its responses were, and how it
learned, as PNGs.

Reads ``RUN_DIR/timeline.jsonl`` (one line per RL step, written by rank 0; format below) and
``RUN_DIR/metrics.jsonl``, and writes into ``RUN_DIR/report/`` (or ``--out``) the two figures
below and the metric curves ``reward.png``, ``entropy.png``, ``response_length.png`` and
``step_time.png`` (megarl/utils/metric_curves.py). A run without ``timeline.jsonl`` (made
before it existed) gets the curves only, one without ``metrics.jsonl`` the two figures only.

``timeline.png``
    One row per rank (rank 0 on top; the tick label gives its rollout replica and the response
    tokens it generated over the shown steps, with the share generated as bubble work). The steps
    are laid end to end along the x axis: step k starts where step k-1's longest rank ended, plus
    a small gap, at a thin vertical line labelled with the step number; a dotted line marks each
    step's ``rollout_end``. Every event is a bar coloured by its phase (:data:`PHASE_COLORS`):
    ``generate`` (rollout decoding), ``reward`` (scoring responses), ``bubble`` (useful pre-generation done while waiting),
    ``idle`` (waiting, nothing to do), ``train``, ``sync`` (weight sync); unknown phases are
    drawn gray as ``other``. The title gives the mean over the shown steps of
    :func:`bubble_fraction`: the share of rank-seconds of the rollout phase that were idle, i.e.
    what the slowest replica cost the others. By default the last 30 steps are shown.

``lengths.png``
    Left: histogram of every response length (count axis log-scaled, so a handful of very long
    responses stays visible next to thousands of short ones), with the median, P90 and max
    marked. Right: per step, the P50 / P90 / max response length, so a growing long tail (which
    is what makes ranks wait) shows up as the max line pulling away from the median.

These two come from ``timeline.jsonl``. Its format::

    {"step": 3,                                  1-based, as in metrics.jsonl
     "ranks": [{"rank": 0, "replica": 0,         replica: rollout data-parallel group index
                "start": 0.02,                   when this rank began the step (0 = the first rank)
                "events": [{"phase": "generate", "start": 0.0, "end": 1.73}, ...],
                                                 seconds from the step's start (earliest
                                                 rank), sorted and non-overlapping
                "tokens": 5230,                  response tokens this rank generated
                "bubble_tokens": 800}, ...],     of which generated as bubble work
     "rollout_end": 2.55,                        end of the rollout phase (max over ranks)
     "response_lengths": [12, 40, 300, ...]}     every response of the step (all ranks)

Figures are drawn with :class:`matplotlib.figure.Figure` on an Agg canvas (no pyplot, no global
backend state) and written atomically: all rendered to memory first, then each to a temporary
file in the output folder renamed over the final name, so bad input writes nothing and a failure
leaves no partial or temporary file.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megarl.sched import timeline
from megarl.utils import metric_curves
from megarl.utils.figures import DPI, WIDTH_IN, new_figure, png_bytes  # noqa: F401 (DPI, WIDTH_IN: re-exported)
from megarl.utils.fs import atomic_write_bytes
from megarl.utils.jsonl import read_numbered_lines

log = logging.getLogger(__name__)

TIMELINE_FILE = "timeline.jsonl"
REPORT_DIR = "report"
DEFAULT_MAX_STEPS = 30
"""Steps drawn in ``timeline.png`` when no ``steps`` range is given (the last ones)."""

PHASE_COLORS: dict[str, str] = {
    "generate": "#1f77b4",  # blue
    "reward": "#17becf",    # cyan: scoring the responses
    "bubble": "#2ca02c",    # green: useful work done in what would otherwise be idle time
    "idle": "#d62728",      # red: the waste the timeline is meant to expose
    "train": "#ff7f0e",     # orange
    "sync": "#9467bd",      # purple
    "other": "#7f7f7f",     # gray: any phase name not above
}
"""Bar colour of each phase in ``timeline.png`` (hex RGB, drawn fully opaque)."""

# Sortedness/overlap check tolerance: event times are floats from separate clock reads.
_EPS = 1e-6

_RANK_KEYS = ("rank", "replica", "events", "tokens", "bubble_tokens")
_STEP_KEYS = ("step", "ranks", "rollout_end", "response_lengths")


# ------------------------------------------------------------------------------------- loading


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


def _check_event(ev: Any, where: str, prev_end: float | None) -> float:
    """Validate one event; returns its end (for the order check of the next one)."""
    if not isinstance(ev, dict):
        raise ValueError(f"{where}: expected an object, got {type(ev).__name__}")
    missing = [k for k in ("phase", "start", "end") if k not in ev]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
    if not isinstance(ev["phase"], str):
        raise ValueError(f"{where}: phase must be a string, got {ev['phase']!r}")
    start, end = ev["start"], ev["end"]
    if not (_is_num(start) and _is_num(end)):
        raise ValueError(f"{where} ({ev['phase']}): start/end must be finite numbers, got {start!r}/{end!r}")
    if start < 0:
        raise ValueError(f"{where} ({ev['phase']}): start {start} < 0 (times are seconds from the step's start)")
    if end < start:
        raise ValueError(f"{where} ({ev['phase']}): end {end} < start {start}")
    if prev_end is not None and start < prev_end - _EPS:
        raise ValueError(f"{where} ({ev['phase']}): starts at {start}, before the previous event's end "
                         f"{prev_end} (events must be sorted and non-overlapping)")
    return end


def _check_rank(r: Any, where: str) -> None:
    if not isinstance(r, dict):
        raise ValueError(f"{where}: expected an object, got {type(r).__name__}")
    missing = [k for k in _RANK_KEYS if k not in r]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
    for k in ("rank", "replica", "tokens", "bubble_tokens"):
        if not _is_int(r[k]) or r[k] < 0:
            raise ValueError(f"{where}: {k} must be an integer >= 0, got {r[k]!r}")
    if not isinstance(r["events"], list):
        raise ValueError(f"{where}: events must be a list, got {type(r['events']).__name__}")
    prev_end = None
    for i, ev in enumerate(r["events"]):
        prev_end = _check_event(ev, f"{where}.events[{i}]", prev_end)


def _check_step(rec: Any) -> None:
    """Raise ValueError (message without the file/line prefix) if ``rec`` is not a step record."""
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in _STEP_KEYS if k not in rec]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)}")
    if not _is_int(rec["step"]) or rec["step"] < 1:
        raise ValueError(f"step must be an integer >= 1, got {rec['step']!r}")
    if not _is_num(rec["rollout_end"]) or rec["rollout_end"] < 0:
        raise ValueError(f"rollout_end must be a number >= 0, got {rec['rollout_end']!r}")
    if not isinstance(rec["ranks"], list) or not rec["ranks"]:
        raise ValueError(f"ranks must be a non-empty list, got {rec['ranks']!r:.60}")
    seen = set()
    for i, r in enumerate(rec["ranks"]):
        _check_rank(r, f"ranks[{i}]")
        if r["rank"] in seen:
            raise ValueError(f"ranks[{i}]: rank {r['rank']} appears twice")
        seen.add(r["rank"])
    lengths = rec["response_lengths"]
    if not isinstance(lengths, list) or not all(_is_num(x) and x >= 0 for x in lengths):
        raise ValueError("response_lengths must be a list of numbers >= 0")


def load_timeline(run_dir: str | os.PathLike) -> list[dict]:
    """The validated step records of ``RUN_DIR/timeline.jsonl``, sorted by step.

    Errors name the file, the line and what is wrong. If a step appears more than once (a resumed
    run re-ran it), the last line wins, as it is the one the run continued from. A torn last line
    is skipped with a warning (megarl/utils/jsonl.py): it is the line rank 0 is still writing
    when the report is made during training, or what a crash left.
    """
    path = Path(run_dir) / TIMELINE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: runs write {TIMELINE_FILE} (one line per RL step) from this "
                                f"version of megarl on; a run made before has no timeline to report")
    by_step: dict[int, dict] = {}
    for lineno, rec in read_numbered_lines(path):
        try:
            _check_step(rec)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from None
        by_step[rec["step"]] = rec
    if not by_step:
        raise ValueError(f"{path} holds no steps")
    return [by_step[s] for s in sorted(by_step)]


# ----------------------------------------------------------------------------------- measures


def bubble_fraction(step_record: dict) -> float:
    """Share of the rollout phase's rank-seconds spent idle in one step.

    Idle seconds inside ``[start, rollout_end]`` (a rank's ``start`` of the step: 0 if absent)
    summed over ranks, divided by the summed lengths of those spans (megarl/sched/timeline.py, what
    ``metrics.jsonl``'s ``bubble_frac`` is): ``bubble`` work and stream training in the wait are not idle, and idle time after
    ``rollout_end`` belongs to training, not to rollout imbalance.
    A step without a rollout phase (``rollout_end == 0``) has fraction 0.
    """
    return timeline.bubble_fraction(step_record["ranks"], float(step_record["rollout_end"]))


def step_span(step_record: dict) -> float:
    """Seconds the step took on its longest rank (at least its rollout phase)."""
    ends = [r["events"][-1]["end"] for r in step_record["ranks"] if r["events"]]
    return max([float(step_record["rollout_end"]), *ends])


def _percentiles(lengths: Sequence[float]) -> tuple[float, float, float]:
    """(median, P90, max) of a non-empty list of lengths."""
    import numpy as np

    a = np.asarray(lengths, dtype=float)
    return float(np.median(a)), float(np.percentile(a, 90)), float(a.max())


# ----------------------------------------------------------------------------------- selection


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """``"A:B"`` -> ``(A, B)``, 1-based and inclusive; either side may be empty (open end)."""
    first, sep, last = text.partition(":")
    try:
        if not sep:
            raise ValueError
        a = int(first) if first.strip() else None
        b = int(last) if last.strip() else None
    except ValueError:
        raise ValueError(f"--steps {text!r} is invalid: expected FIRST:LAST (1-based, inclusive; "
                         f"either may be left out), e.g. 10:20, 10: or :20") from None
    _check_steps((a, b), f"--steps {text!r}")
    return a, b


def _check_steps(steps: tuple[int | None, int | None], what: str) -> None:
    a, b = steps
    if (a is not None and a < 1) or (b is not None and b < 1):
        raise ValueError(f"{what} is invalid: steps are numbered from 1")
    if a is not None and b is not None and a > b:
        raise ValueError(f"{what} is invalid: first step {a} is after last step {b}")


def select_steps(records: list[dict], steps: tuple[int | None, int | None] | None,
                 max_default: int = DEFAULT_MAX_STEPS, source: str = TIMELINE_FILE) -> tuple[list[dict], str]:
    """The records to draw and a note for the title on how they were chosen (``source``: the file
    they come from, for the error message)."""
    if steps is None:
        if len(records) > max_default:
            return records[-max_default:], f"last {max_default} of {len(records)} steps"
        return records, ""
    if not (isinstance(steps, tuple) and len(steps) == 2):
        raise ValueError(f"steps must be a (first, last) tuple, got {steps!r}")
    _check_steps(steps, f"steps {steps}")
    a, b = steps
    chosen = [r for r in records if (a is None or r["step"] >= a) and (b is None or r["step"] <= b)]
    if not chosen:
        raise ValueError(f"no steps in {a or ''}:{b or ''}; {source} has steps "
                         f"{records[0]['step']}..{records[-1]['step']}")
    return chosen, ""


def _steps_label(records: list[dict]) -> str:
    a, b = records[0]["step"], records[-1]["step"]
    return f"step {a}" if a == b else f"steps {a}-{b}"


# ------------------------------------------------------------------------------------ figures


def timeline_height(n_ranks: int) -> float:
    """Figure height (inches) of ``timeline.png``: a fixed frame plus a row per rank."""
    return min(2.2 + 0.45 * n_ranks, 60.0)


def _rank_label(rank: int, records: list[dict]) -> str:
    """``rank r · replica k`` and the rank's token total over ``records`` (bubble share)."""
    entries = [r for rec in records for r in rec["ranks"] if r["rank"] == rank]
    tokens = sum(r["tokens"] for r in entries)
    bubble = sum(r["bubble_tokens"] for r in entries)
    share = f" ({bubble / tokens:.0%} bubble)" if tokens else ""
    tok = f"{tokens / 1000:.1f}k" if tokens >= 1000 else str(tokens)
    return f"rank {rank} · replica {entries[-1]['replica']}\n{tok} tok{share}"


def draw_timeline(records: list[dict], note: str = ""):
    """The timeline figure of ``records`` (see the module docstring)."""
    from matplotlib.patches import Patch

    ranks = sorted({r["rank"] for rec in records for r in rec["ranks"]})
    row = {rank: i for i, rank in enumerate(ranks)}
    spans = [step_span(rec) for rec in records]
    gap = 0.02 * max(sum(spans) / len(spans), 1e-3)  # visible at any time scale

    # Collect bars per (row, phase) across all steps: one broken_barh call each, not one per event.
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    offsets = []
    t0 = 0.0
    for rec, span in zip(records, spans):
        offsets.append(t0)
        for r in rec["ranks"]:
            for ev in r["events"]:
                phase = ev["phase"] if ev["phase"] in PHASE_COLORS else "other"
                bars.setdefault((row[r["rank"]], phase), []).append((t0 + ev["start"], ev["end"] - ev["start"]))
        t0 += span + gap

    fig = new_figure(timeline_height(len(ranks)))
    ax = fig.add_subplot()
    for (i, phase), xs in bars.items():
        ax.broken_barh(xs, (i - 0.4, 0.8), facecolors=PHASE_COLORS[phase], edgecolor="none", alpha=1.0)
    for rec, x in zip(records, offsets):
        ax.axvline(x, color="black", lw=0.6)
        ax.axvline(x + rec["rollout_end"], color="black", lw=0.6, ls=":")
    # Step numbers on a top axis (not free text) so the layout engine keeps them clear of the title.
    top = ax.secondary_xaxis("top")
    top.set_xticks([x + span / 2 for x, span in zip(offsets, spans)], [str(rec["step"]) for rec in records],
                   fontsize=8 if len(records) <= 15 else 7)
    top.tick_params(length=0)
    top.set_xlabel("step", fontsize=8)

    ax.set_yticks(range(len(ranks)), [_rank_label(rank, records) for rank in ranks], fontsize=8)
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, max(t0 - gap, 1e-3))
    ax.set_xlabel("seconds, steps laid end to end (solid line: step start; dotted: end of its rollout)")
    shown = [p for p in PHASE_COLORS if any(ph == p for _, ph in bars)]
    ax.legend(handles=[Patch(color=PHASE_COLORS[p], label=p) for p in shown],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    mean_bubble = sum(bubble_fraction(rec) for rec in records) / len(records)
    extra = f" ({note})" if note else ""
    ax.set_title(f"Per-rank timeline, {_steps_label(records)}{extra}\n"
                 f"mean bubble fraction {mean_bubble:.1%} (idle rank-seconds during rollout)", fontsize=10)
    return fig


def draw_lengths(records: list[dict]):
    """The response-length figure of ``records`` (see the module docstring)."""
    fig = new_figure(4.5)
    hist, tail = fig.subplots(1, 2)
    every = [x for rec in records for x in rec["response_lengths"]]
    if every:
        med, p90, top = _percentiles(every)
        hist.hist(every, bins=min(60, max(10, len(set(every)))), color=PHASE_COLORS["generate"])
        hist.set_yscale("log")
        for value, name, style in ((med, "median", "-"), (p90, "P90", "--"), (top, "max", ":")):
            hist.axvline(value, color="black", ls=style, lw=1.2, label=f"{name} = {value:.0f}")
        hist.legend(fontsize=8)
    else:
        hist.text(0.5, 0.5, "no responses", transform=hist.transAxes, ha="center", va="center")
    hist.set_xlabel("response length (tokens)")
    hist.set_ylabel("responses (log scale)")
    hist.set_title(f"Response lengths, {_steps_label(records)} ({len(every)} responses)", fontsize=10)

    with_len = [rec for rec in records if rec["response_lengths"]]
    xs = [rec["step"] for rec in with_len]
    per_step = [_percentiles(rec["response_lengths"]) for rec in with_len]
    for k, (name, style) in enumerate((("P50", "-"), ("P90", "--"), ("max", ":"))):
        tail.plot(xs, [p[k] for p in per_step], ls=style, marker="o", ms=3, label=name)
    if with_len:
        tail.legend(fontsize=8)
    else:
        tail.text(0.5, 0.5, "no responses", transform=tail.transAxes, ha="center", va="center")
    tail.set_xlabel("step")
    tail.set_ylabel("response length (tokens)")
    tail.set_title("Per step: P50 / P90 / max", fontsize=10)
    tail.grid(alpha=0.3)
    return fig


# ------------------------------------------------------------------------------------- writing


def render_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                  steps: tuple[int | None, int | None] | None = None) -> list[Path]:
    """Write the PNGs of a run (module docstring); returns their paths.

    ``steps``: ``(first, last)``, 1-based and inclusive (``None`` on a side: open), limiting every
    figure; ``None``: ``timeline.png`` shows the last 30 steps (saying so in its title), the
    others all of them (a per-step line stays readable over any number of steps). Every figure
    is rendered before anything is written, so bad input writes nothing.
    """
    run_dir = Path(run_dir)
    has_timeline = (run_dir / TIMELINE_FILE).is_file()
    has_metrics = (run_dir / metric_curves.METRICS_FILE).is_file()
    if not has_metrics:
        if not has_timeline:
            load_timeline(run_dir)  # nothing to draw: the timeline's own FileNotFoundError
        log.warning("%s not found: no metric curves", run_dir / metric_curves.METRICS_FILE)
    images = {}
    if has_timeline:
        records = load_timeline(run_dir)
        shown, note = select_steps(records, steps)
        images["timeline.png"] = png_bytes(draw_timeline(shown, note))
        images["lengths.png"] = png_bytes(draw_lengths(records if steps is None else shown))
    else:
        log.warning("%s not found (the run predates it): drawing the metric curves only", run_dir / TIMELINE_FILE)
    if has_metrics:
        metrics = metric_curves.load_metrics(run_dir)
        if steps is not None and metrics:
            metrics, _ = select_steps(metrics, steps, source=metric_curves.METRICS_FILE)
        if metrics:
            for name, fig in metric_curves.draw_curves(metrics, PHASE_COLORS, run_dir.resolve().name).items():
                images[name] = png_bytes(fig)
    out = Path(out_dir) if out_dir is not None else run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in images.items():
        atomic_write_bytes(out / name, data)
        paths.append(out / name)
    return paths


# ----------------------------------------------------------------------------------------- CLI


def _steps_arg(text: str) -> tuple[int | None, int | None]:
    try:
        return parse_steps(text)
    except ValueError as e:  # argparse prints an ArgumentTypeError's message as is
        raise argparse.ArgumentTypeError(str(e)) from None


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    """``report RUN_DIR [--out DIR] [--steps A:B]`` under a ``megarl`` subparsers object."""
    p = subparsers.add_parser("report", help="draw a run's per-rank timeline, response lengths and metric curves "
                                             "(reward, entropy, response length, step time by phase) as PNGs")
    p.add_argument("run_dir", help=f"run directory holding {TIMELINE_FILE} and/or {metric_curves.METRICS_FILE}")
    p.add_argument("--out", default=None, help=f"output folder (default: RUN_DIR/{REPORT_DIR})")
    p.add_argument("--steps", type=_steps_arg, default=None, metavar="A:B",
                   help=f"1-based inclusive step range, either end optional (default: all; the timeline "
                        f"shows the last {DEFAULT_MAX_STEPS})")
    return p


def run_report(args: argparse.Namespace) -> int:
    steps = parse_steps(args.steps) if isinstance(args.steps, str) else args.steps
    for path in render_report(args.run_dir, args.out, steps):
        print(path)
    return 0
