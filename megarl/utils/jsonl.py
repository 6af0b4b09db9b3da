"""The JSON-lines files a run appends to (``metrics.jsonl``, ``timeline.jsonl``, ``rollouts.jsonl``).

A run appends one line per step and, on ``--resume``, cuts each file back to the checkpoint's
step. A crash or a full disk in the middle of an append may leave the last line unfinished (a
*torn* line); that must never stop a resume or a report, so:

* :func:`append_line` writes a line with one ``write()`` on an ``O_APPEND`` descriptor and
  fsyncs it, so a line is either whole, absent, or a prefix at the very end of the file;
* :func:`read_lines` drops such a torn last line with a warning naming the file and its byte
  offset, but refuses (``ValueError`` naming ``file:line``) a malformed line anywhere else: an
  append can only tear the end, so a bad line in the middle is corruption, not a crash;
* :func:`truncate_to_step` keeps the lines of steps ``<= step`` (dropping a torn tail) and
  rewrites the file atomically.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from megarl.utils.fs import atomic_write_text, naming_path

log = logging.getLogger(__name__)


class JsonlCorrupted(ValueError):
    """A line before the last one of a run's JSONL file is not a JSON object: corruption, not a
    crash (a user error: the CLI prints it as one line, naming ``file:line``)."""


def append_line(path: str | os.PathLike, obj: Any) -> None:
    """Append ``obj`` as one JSON line (``json.dumps`` + ``"\\n"``) to ``path``, creating it.

    Why one ``write()``: a buffered text file splits a long line (a ``rollouts.jsonl`` line is
    easily megabytes) into several writes; with a single write on an ``O_APPEND`` descriptor the
    line lands contiguously at the end, so a crash leaves at most one torn line, the last one,
    which :func:`read_lines` can tell from corruption. Why ``fsync``: the checkpoint written
    after a step must not reach the disk before that step's line does; after a power loss,
    resuming from the checkpoint would otherwise leave a hole in the metrics. One fsync per
    line per step costs milliseconds against steps of seconds.
    """
    data = (json.dumps(obj) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        view = memoryview(data)
        with naming_path(path):
            while view:  # a regular file writes it all at once; a short write (disk full) continues
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
    finally:
        os.close(fd)


def _parse(path: Path, warn: bool = True) -> list[tuple[int, str, dict]]:
    """``(1-based line number, raw line with its newline, parsed object)`` of every complete
    line of ``path`` (``warn``: about a torn last line)."""
    data = path.read_bytes()
    pieces = data.split(b"\n")
    # split() gives a last piece after the last newline: b"" for a file that ends with one.
    out: list[tuple[int, str, dict]] = []
    offset = 0
    last = len(pieces) - 1
    for i, raw in enumerate(pieces):
        start, offset = offset, offset + len(raw) + 1
        if i == last:
            if raw.strip() and warn:  # bytes after the last newline: an append that did not finish
                _warn_torn(path, start, "no newline at the end")
            break
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if not any(p.strip() for p in pieces[i + 1:]):
                # The last line, newline included, yet unreadable: a crash after the file size
                # grew but before the data reached the disk leaves zeros (delayed allocation).
                if warn:
                    _warn_torn(path, start, "not valid JSON")
                break
            reason = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            raise JsonlCorrupted(f"{path}:{i + 1}: malformed JSON line ({reason}) before the last line: the file "
                                 f"is corrupted (an interrupted append only ever leaves the last line torn); "
                                 f"repair or remove that line") from None
        if not isinstance(obj, dict):
            raise JsonlCorrupted(f"{path}:{i + 1}: expected a JSON object, got {type(obj).__name__}; repair or "
                                 f"remove that line")
        out.append((i + 1, raw.decode() + "\n", obj))
    return out


def _warn_torn(path: Path, offset: int, why: str) -> None:
    log.warning("%s: dropping the torn last line at byte offset %d (%s): an append that did not finish "
                "(a crash, a full disk, or the run is still writing it)", path, offset, why)


def read_lines(path: str | os.PathLike) -> list[dict]:
    """Every complete line of ``path`` as a dict, in file order (blank lines skipped).

    A torn last line (no final newline, or not valid JSON) is dropped with a warning naming the
    file and its byte offset; a malformed line before it raises ``ValueError`` naming
    ``file:line``. A missing file raises ``FileNotFoundError``.
    """
    return [obj for _, _, obj in _parse(Path(path))]


def check_lines(path: str | os.PathLike) -> None:
    """Raise :class:`JsonlCorrupted` if :func:`read_lines` would (quietly: no torn-line warning)."""
    _parse(Path(path), warn=False)


def read_numbered_lines(path: str | os.PathLike) -> list[tuple[int, dict]]:
    """:func:`read_lines` with each object's 1-based line number, for messages naming ``file:line``."""
    return [(lineno, obj) for lineno, _, obj in _parse(Path(path))]


def truncate_to_step(path: str | os.PathLike, step: int) -> int:
    """Keep only the lines whose ``"step"`` is ``<= step`` (what ``--resume`` from the checkpoint of
    ``step`` needs: later steps run again) and drop a torn last line; returns the lines kept.

    The file is rewritten atomically (a temporary file renamed over it), byte for byte the kept
    lines, and only if something is dropped. A missing file is left missing (returns 0); a
    line without an integer ``"step"`` raises ``ValueError`` naming ``file:line``.
    """
    path = Path(path)
    if not path.exists():
        return 0
    size = path.stat().st_size
    lines = _parse(path)
    kept = []
    for lineno, raw, obj in lines:
        s = obj.get("step")
        if not isinstance(s, int) or isinstance(s, bool):
            raise ValueError(f"{path}:{lineno}: no integer \"step\" in this line (got {s!r}); cannot tell "
                             f"whether it comes before the checkpoint of step {step}")
        if s <= step:
            kept.append(raw)
    text = "".join(kept)
    if len(kept) < len(lines) or len(text.encode()) != size:
        atomic_write_text(path, text)
    return len(kept)

