"""``megarl report``: the bubble-fraction measure, the PNGs it draws, and its input errors."""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest
from matplotlib import colors as mcolors
from matplotlib import image as mimage

from megarl import report
from megarl.utils import metric_curves
from megarl.report import (DPI, PHASE_COLORS, WIDTH_IN, add_report_parser, bubble_fraction, load_timeline,
                           parse_steps, render_report, run_report, timeline_height)


def _ev(phase, start, end):
    return {"phase": phase, "start": start, "end": end}


def _rank(rank, events, replica=0, tokens=100, bubble_tokens=0):
    return {"rank": rank, "replica": replica, "events": events, "tokens": tokens, "bubble_tokens": bubble_tokens}


def _step(step, ranks, rollout_end, lengths=(10, 20, 300)):
    return {"step": step, "ranks": ranks, "rollout_end": rollout_end, "response_lengths": list(lengths)}


def _synthetic_step(step, n_ranks=2):
    """Rank r generates for 1 + r seconds; the others wait (bubble work, then idle) until the
    slowest is done; then all score rewards, train and sync."""
    end = float(n_ranks) + 0.5
    ranks = []
    for r in range(n_ranks):
        gen = 1.0 + r
        events = [_ev("generate", 0.0, gen)]
        if gen < n_ranks:
            events += [_ev("bubble", gen, gen + 0.25), _ev("idle", gen + 0.25, n_ranks)]
        events += [_ev("reward", n_ranks, end), _ev("train", end, end + 1.0), _ev("sync", end + 1.0, end + 1.1)]
        ranks.append(_rank(r, events, replica=r, tokens=1000 * (r + 1), bubble_tokens=50))
    return _step(step, ranks, end, lengths=[5 * step, 40, 100 + step, 2000])


def _write_run(path, records, metrics=False):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "timeline.jsonl", "w") as f:
        f.writelines((rec if isinstance(rec, str) else json.dumps(rec)) + "\n" for rec in records)
    if metrics:
        with open(path / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps({"step": rec["step"], "response_len_mean": 50.0, "bubble_frac": 0.1}) + "\n"
                         for rec in records)
    return path


def _rgb(hex_color):
    return np.array(mcolors.to_rgb(hex_color))


def _color_pixels(img, hex_color, tol=1.5 / 255):
    return int((np.abs(img[..., :3] - _rgb(hex_color)).max(axis=-1) <= tol).sum())


def _has_color(img, hex_color, min_pixels=2000):
    """A bar of that colour is drawn: thousands of pixels (antialiased text gives a few hundred
    gray ones, so a lower bar would find "other" in any figure)."""
    return _color_pixels(img, hex_color) >= min_pixels


# ------------------------------------------------------------------------------ bubble_fraction


def test_bubble_fraction_idle_share_of_rollout():
    rec = _step(1, [_rank(0, [_ev("generate", 0, 4)]),
                    _rank(1, [_ev("generate", 0, 1), _ev("idle", 1, 4)])], rollout_end=4)
    assert bubble_fraction(rec) == pytest.approx(3 / 8)


def test_bubble_fraction_bubble_work_is_not_idle():
    rec = _step(1, [_rank(0, [_ev("generate", 0, 4)]),
                    _rank(1, [_ev("generate", 0, 1), _ev("bubble", 1, 3), _ev("idle", 3, 4)])], rollout_end=4)
    assert bubble_fraction(rec) == pytest.approx(1 / 8)


def test_bubble_fraction_ignores_idle_after_rollout_end():
    # Rank 1's idle straddles rollout_end: only the 1 s before it counts; the training-time idle does not.
    rec = _step(1, [_rank(0, [_ev("generate", 0, 4), _ev("train", 4, 6)]),
                    _rank(1, [_ev("generate", 0, 3), _ev("idle", 3, 5), _ev("train", 5, 6), _ev("idle", 6, 9)])],
                rollout_end=4)
    assert bubble_fraction(rec) == pytest.approx(1 / 8)


def test_bubble_fraction_single_rank_and_no_rollout():
    assert bubble_fraction(_step(1, [_rank(0, [_ev("generate", 0, 2)])], rollout_end=2)) == 0.0
    assert bubble_fraction(_step(1, [_rank(0, [_ev("idle", 0, 2)])], rollout_end=0)) == 0.0


# ------------------------------------------------------------------------------ render_report


def test_render_report_writes_both_pngs(tmp_path):
    records = [_synthetic_step(s) for s in (1, 2, 3)]
    records[2]["ranks"][0]["events"][-2]["phase"] = "offload"  # unknown phase (1 s): drawn as "other"
    run = _write_run(tmp_path / "run", records, metrics=True)
    paths = render_report(run)
    # (the metrics lines of _write_run hold response_len_mean only: one curve figure)
    assert [p.name for p in paths] == ["timeline.png", "lengths.png", "response_length.png"]
    assert all(p.parent == run / "report" for p in paths)
    assert sorted(os.listdir(run / "report")) == ["lengths.png", "response_length.png", "timeline.png"]  # no temp

    timeline = mimage.imread(paths[0])
    assert timeline.shape[:2] == (round(timeline_height(2) * DPI), round(WIDTH_IN * DPI))
    lengths = mimage.imread(paths[1])
    assert lengths.shape[1] == round(WIDTH_IN * DPI)
    for img in (timeline, lengths):
        assert len(np.unique(img[..., :3].reshape(-1, 3), axis=0)) > 10  # not a blank canvas
    # Every phase is drawn as bars of its own colour, the unknown one in the "other" gray.
    for phase in PHASE_COLORS:
        assert _has_color(timeline, PHASE_COLORS[phase]), phase
    # The histogram's bars use the generate colour too.
    assert _has_color(lengths, PHASE_COLORS["generate"])


def test_render_report_single_rank_steps_range_and_out_dir(tmp_path, capsys):
    run = _write_run(tmp_path / "run", [_synthetic_step(s, n_ranks=1) for s in range(1, 6)])
    parser = argparse.ArgumentParser(prog="megarl")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", str(run), "--out", str(tmp_path / "out"), "--steps", "2:3"])
    assert args.steps == (2, 3)
    assert run_report(args) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "out" / "timeline.png"), str(tmp_path / "out" / "lengths.png")]
    img = mimage.imread(tmp_path / "out" / "timeline.png")
    assert img.shape[:2] == (round(timeline_height(1) * DPI), round(WIDTH_IN * DPI))
    assert _has_color(img, PHASE_COLORS["generate"]) and not _has_color(img, PHASE_COLORS["idle"])
    assert not (run / "report").exists()


def test_default_shows_last_30_steps(tmp_path):
    records = [_synthetic_step(s) for s in range(1, 36)]
    shown, note = report.select_steps(records, None)
    assert [r["step"] for r in shown] == list(range(6, 36)) and "last 30 of 35" in note
    shown, note = report.select_steps(records, (None, 4))
    assert [r["step"] for r in shown] == [1, 2, 3, 4] and note == ""
    with pytest.raises(ValueError, match="no steps in 40:50"):
        report.select_steps(records, (40, 50))


def test_resumed_step_keeps_last_line(tmp_path):
    first, rerun = _synthetic_step(2), _synthetic_step(2)
    rerun["rollout_end"] = 2.75
    run = _write_run(tmp_path / "run", [_synthetic_step(1), first, _synthetic_step(3), rerun])
    assert [(r["step"], r["rollout_end"]) for r in load_timeline(run)] == [(1, 2.5), (2, 2.75), (3, 2.5)]


# ------------------------------------------------------------------------------------- errors


def test_missing_timeline_and_metrics(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"timeline\.jsonl not found.*from this version"):
        render_report(tmp_path)
    assert not (tmp_path / "report").exists()


def test_missing_timeline_draws_curves_only(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(_metrics_line(s)) + "\n" for s in (1, 2)))
    paths = render_report(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "entropy.png", "response_length.png", "step_time.png"]
    assert "drawing the metric curves only" in caplog.text


def test_malformed_line_names_line_number(tmp_path):
    run = _write_run(tmp_path / "run", [_synthetic_step(1), '{"step": 2, "ranks": [', _synthetic_step(3)])
    with pytest.raises(ValueError, match=r"timeline\.jsonl:2: malformed JSON"):
        render_report(run)
    assert not (run / "report").exists()  # nothing written on bad input


def test_unfinished_last_line_is_skipped(tmp_path):
    run = _write_run(tmp_path / "run", [_synthetic_step(1)])
    with open(run / "timeline.jsonl", "a") as f:
        f.write('{"step": 2, "ran')  # rank 0 still writing
    assert [r["step"] for r in load_timeline(run)] == [1]


def test_missing_key_and_bad_event(tmp_path):
    bad = _synthetic_step(2)
    del bad["rollout_end"]
    run = _write_run(tmp_path / "a", [_synthetic_step(1), bad])
    with pytest.raises(ValueError, match=r"timeline\.jsonl:2: missing key\(s\) rollout_end"):
        load_timeline(run)

    bad = _synthetic_step(1)
    bad["ranks"][1]["events"][0] = _ev("generate", 1.5, 0.5)
    run = _write_run(tmp_path / "b", [bad])
    with pytest.raises(ValueError, match=r"timeline\.jsonl:1: ranks\[1\]\.events\[0\] \(generate\): "
                                         r"end 0\.5 < start 1\.5"):
        load_timeline(run)

    bad = _synthetic_step(1)
    del bad["ranks"][0]["tokens"]
    run = _write_run(tmp_path / "c", [bad])
    with pytest.raises(ValueError, match=r":1: ranks\[0\]: missing key\(s\) tokens"):
        load_timeline(run)


@pytest.mark.parametrize("text", ["3-5", "a:b", "5:3", "0:4", "7"])
def test_bad_steps_string(text, capsys):
    with pytest.raises(ValueError, match="--steps"):
        parse_steps(text)
    parser = argparse.ArgumentParser(prog="megarl")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["report", "run", "--steps", text])
    assert e.value.code == 2 and "--steps" in capsys.readouterr().err


def test_parse_steps_open_ends():
    assert parse_steps("10:20") == (10, 20)
    assert parse_steps("10:") == (10, None)
    assert parse_steps(":20") == (None, 20)
    assert parse_steps("4:4") == (4, 4)


def test_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    run = _write_run(tmp_path / "run", [_synthetic_step(1)])
    (run / "report").mkdir()
    (run / "report" / "timeline.png").write_bytes(b"old")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        render_report(run)
    assert os.listdir(run / "report") == ["timeline.png"]
    assert (run / "report" / "timeline.png").read_bytes() == b"old"  # the old file is untouched


# ------------------------------------------------------------------------------ metric curves

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _metrics_line(step):
    """A metrics.jsonl line as train.py writes it (a subset of its keys, one string among them)."""
    return {"loss": 0.1, "weight_checksum": "73d335f8678e4d41", "step": step, "reward_mean": 0.05 * step,
            "reward_max": min(1.0, 0.2 * step), "entropy_mean": 2.7 / step, "response_len_mean": 14.0 + step,
            "response_len_max": 40 + 3 * step, "response_len_p50": 11.5 + step, "rollout_time_s": 0.1 * step,
            "bubble_time_s": 0.01, "train_time_s": 0.05, "weight_sync_s": 0.003, "step_time_s": 0.2 * step}


def _write_metrics(run, steps, extra=""):
    with open(run / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(_metrics_line(s)) + "\n" for s in steps)
        f.write(extra)


def test_metric_curves_written_and_match_metrics(tmp_path, caplog):
    run = _write_run(tmp_path / "run", [_synthetic_step(s) for s in (1, 2, 3, 4)])
    _write_metrics(run, (1, 2, 3, 4), extra='{"step": 5, "rew')  # torn: the run is still writing step 5
    paths = render_report(run)
    names = ["reward.png", "entropy.png", "response_length.png", "step_time.png"]
    assert [p.name for p in paths] == ["timeline.png", "lengths.png", *names]
    assert "metrics.jsonl: dropping the torn last line" in caplog.text
    for name in names:
        data = (run / "report" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
        img = mimage.imread(run / "report" / name)
        assert img.shape[:2] == (round(4.0 * DPI), round(WIDTH_IN * DPI))
        assert len(np.unique(img[..., :3].reshape(-1, 3), axis=0)) > 10, name  # not a blank canvas

    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()[:4]]
    data = metric_curves.curve_data(metric_curves.load_metrics(run))
    assert list(data) == names
    for name in names[:-1]:  # (no eval/ metrics in these lines: no evaluation figures)
        keys = metric_curves.LINE_CURVES[name][2]
        assert list(data[name]) == list(keys)
        for key in keys:
            assert data[name][key] == ([1, 2, 3, 4], [float(x[key]) for x in lines]), key
    split = data["step_time.png"]
    assert list(split) == ["rollout_time_s", "bubble_time_s", "train_time_s", "weight_sync_s", "other"]
    for k in ("rollout_time_s", "bubble_time_s", "train_time_s", "weight_sync_s"):
        assert split[k] == ([1, 2, 3, 4], [x[k] for x in lines])
    totals = [sum(split[k][1][i] for k in split) for i in range(4)]
    assert totals == pytest.approx([x["step_time_s"] for x in lines])  # the bars stack up to step_time_s
    # The stacked bars carry the timeline's phase colours.
    img = mimage.imread(run / "report" / "step_time.png")
    for phase in ("generate", "train"):
        assert _has_color(img, PHASE_COLORS[phase]), phase


def test_metric_curves_steps_range_missing_keys_and_resumed_steps(tmp_path):
    run = _write_run(tmp_path / "run", [_synthetic_step(s) for s in (1, 2, 3)])
    lines = [_metrics_line(1), _metrics_line(2), _metrics_line(3), {**_metrics_line(2), "reward_mean": 0.9}]
    del lines[0]["entropy_mean"]  # an older line without it: a gap, not an error
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = metric_curves.curve_data(metric_curves.load_metrics(run))
    assert data["reward.png"]["reward_mean"] == ([1, 2, 3], [0.05, 0.9, pytest.approx(0.15)])  # last line wins
    assert data["entropy.png"]["entropy_mean"][0] == [2, 3]
    paths = render_report(run, tmp_path / "out", steps=(2, 3))
    assert "reward.png" in [p.name for p in paths]
    no_entropy = [{k: v for k, v in _metrics_line(s).items() if k != "entropy_mean"} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in no_entropy))
    assert "entropy.png" not in [p.name for p in render_report(run, tmp_path / "out2")]


def test_bad_metrics_line_names_file_and_line(tmp_path):
    run = _write_run(tmp_path / "run", [_synthetic_step(1)])
    (run / "metrics.jsonl").write_text(json.dumps(_metrics_line(1)) + "\n" + '{"step": 2, "reward_mean": "high"}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: reward_mean must be a number, got 'high'"):
        render_report(run)
    (run / "metrics.jsonl").write_text('{"step": 1, "rew\n' + json.dumps(_metrics_line(2)) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:1: malformed JSON"):
        render_report(run)
    assert not (run / "report").exists()  # nothing written on bad input


def test_eval_curves_from_step_0_with_every_pass_at_k(tmp_path):
    # An evaluation before RL (a line of its own at step 0) and with steps 2 and 3 (megarl/stages/evaluate.py).
    ev = lambda s: {"eval/reward_mean": 0.1 * s, "eval/pass_at_1": 0.1 * s, "eval/pass_at_2": 0.2 * s,  # noqa: E731
                    "eval/pass_at_4": 0.3 * s, "eval/response_len_mean": 10.0 + s, "eval/response_len_max": 20.0 + s}
    lines = [{"step": 0, **ev(0)}, _metrics_line(1), {**_metrics_line(2), **ev(2)},
             {**_metrics_line(3), **ev(3), "eval/greedy/pass_at_1": 0.5}]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = metric_curves.curve_data(metric_curves.load_metrics(run))
    assert list(data["eval.png"]) == ["eval/reward_mean", "eval/pass_at_1", "eval/pass_at_2", "eval/pass_at_4",
                                      "eval/greedy/pass_at_1"]
    assert data["eval.png"]["eval/greedy/pass_at_1"] == ([3], [0.5])
    assert data["eval.png"]["eval/pass_at_4"] == ([0, 2, 3], [0.0, 0.6, pytest.approx(0.9)])
    assert data["eval_length.png"]["eval/response_len_max"] == ([0, 2, 3], [20.0, 22.0, 23.0])
    assert data["reward.png"]["reward_mean"][0] == [1, 2, 3]  # the step-0 line has no training figures
    assert {p.name for p in render_report(run)} >= {"eval.png", "eval_length.png", "reward.png"}
