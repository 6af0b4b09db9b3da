"""megarl.utils.jsonl: a torn last line (crash or full disk mid-append) never blocks a resume;
a bad line in the middle is corruption and is refused, naming the line."""
from __future__ import annotations

import json
import logging
import os

import pytest

from megarl.utils.jsonl import append_line, read_lines, truncate_to_step

TORN = '{"step": 3, "rew'  # what a crash in the middle of step 3's append leaves


def _steps(path):
    return [r["step"] for r in read_lines(path)]


def test_append_then_read_roundtrip(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "reward_mean": 0.5, "weight_checksum": "73d3"}, {"step": 2, "reward_mean": float("nan")},
            {"step": 3, "text": "line\nbreak é"}]
    for r in rows:
        append_line(path, r)
    assert path.read_text().count("\n") == 3  # one line each: newlines inside strings are escaped
    got = read_lines(path)
    assert got[0] == rows[0] and got[2] == rows[2] and got[1]["step"] == 2


def test_append_is_one_write_and_fsynced(tmp_path, monkeypatch):
    """The whole line goes out in one write() (an interrupted append can only tear the end), then fsync."""
    calls = []
    real_write, real_fsync = os.write, os.fsync
    monkeypatch.setattr(os, "write", lambda fd, b: calls.append(("write", bytes(b))) or real_write(fd, b))
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync",)) or real_fsync(fd))
    big = {"step": 1, "tokens": list(range(20000))}  # ~130 kB: a buffered file would split it
    append_line(tmp_path / "r.jsonl", big)
    assert [c[0] for c in calls] == ["write", "fsync"]
    assert calls[0][1] == (json.dumps(big) + "\n").encode()


def test_torn_last_line_dropped_with_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    for s in (1, 2):
        append_line(path, {"step": s, "reward_mean": s / 10})
    offset = path.stat().st_size
    with open(path, "a") as f:
        f.write(TORN)
    with caplog.at_level(logging.WARNING, logger="megarl.utils.jsonl"):
        assert _steps(path) == [1, 2]
    assert f"{path}: dropping the torn last line at byte offset {offset}" in caplog.text


def test_unreadable_last_line_with_newline_is_torn(tmp_path, caplog):
    """A crash after the size grew but before the data landed leaves zeros, newline or not."""
    path = tmp_path / "metrics.jsonl"
    append_line(path, {"step": 1})
    with open(path, "ab") as f:
        f.write(b"\0\0\0\0\n")
    with caplog.at_level(logging.WARNING):
        assert _steps(path) == [1]
    assert "torn last line at byte offset 12 (not valid JSON)" in caplog.text


def test_truncate_to_step_drops_torn_tail_and_later_steps(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    for s in (1, 2, 3, 4):
        append_line(path, {"step": s, "x": s})
    with open(path, "a") as f:
        f.write(TORN)
    with caplog.at_level(logging.WARNING):
        assert truncate_to_step(path, 2) == 2
    assert "torn last line" in caplog.text
    assert path.read_text() == '{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n'  # byte for byte the kept lines
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # no temporary file left
    append_line(path, {"step": 3, "x": 30})  # the resumed run appends after a clean end
    assert _steps(path) == [1, 2, 3]


def test_truncate_keeps_everything_when_only_the_tail_is_torn(tmp_path):
    path = tmp_path / "timeline.jsonl"
    append_line(path, {"step": 1})
    with open(path, "a") as f:
        f.write(TORN)
    assert truncate_to_step(path, 5) == 1
    assert path.read_text() == '{"step": 1}\n'


def test_truncate_untouched_file_is_not_rewritten(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    append_line(path, {"step": 1})
    monkeypatch.setattr("megarl.utils.jsonl.atomic_write_text", lambda *a: pytest.fail("rewritten"))
    assert truncate_to_step(path, 1) == 1


def test_truncate_missing_file(tmp_path):
    assert truncate_to_step(tmp_path / "rollouts.jsonl", 3) == 0
    assert not (tmp_path / "rollouts.jsonl").exists()


def test_bad_middle_line_is_corruption(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: malformed JSON line .*corrupted"):
        read_lines(path)
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: malformed JSON"):
        truncate_to_step(path, 1)
    assert path.read_text().count("\n") == 3  # untouched


def test_bad_line_followed_by_torn_tail_is_corruption(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"ste\n' + TORN)
    with pytest.raises(ValueError, match=r":2: malformed"):
        read_lines(path)


def test_non_object_and_missing_step(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"a\.jsonl:2: expected a JSON object, got list"):
        read_lines(path)
    path.write_text('{"step": 1}\n\n{"reward": 2}\n')
    with pytest.raises(ValueError, match=r"a\.jsonl:3: no integer \"step\""):
        truncate_to_step(path, 1)
