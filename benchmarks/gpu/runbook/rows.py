"""The GPU runbook's figures as they are measured: one ``PART.jsonl`` per part under the out folder.

A part appends one line per finished unit of work (an engine batch row, a KV cache's identity
step, a GRPO step, a test file), flushed and synced before it goes on, and its whole figures as a
last ``{"result": ...}`` line. A part killed at any moment (its time limit, a CUDA error, the whole
command cut off from outside) therefore leaves every row it finished; the report is assembled
from the rows when the result line is missing, and says where the part stopped. A line cut in the
middle of its write (a kill during ``write``) is ignored when read.

Each row carries the seconds since the part's writer opened (``t_s``) and, once the process has
used CUDA, its peak GPU memory so far (``peak_gib``, ``torch.cuda.max_memory_allocated``).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def cuda_peak_gib() -> float | None:
    """Peak GPU memory of this process so far (GiB), or None if it never initialised CUDA (the
    check must not initialise it: a CPU part stays off the device)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return round(torch.cuda.max_memory_allocated() / 2 ** 30, 3)


class Rows:
    """Appends a part's rows to its JSONL file, each flushed and synced before returning."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a stale file must not pass for this run's rows
        self._t0 = time.perf_counter()
        self.count = 0

    def _append(self, obj: dict) -> None:
        line = json.dumps(obj, default=str) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def add(self, label: str, **figures) -> None:
        """One finished unit of work: ``label`` says which (``batch 64 paged``, ``step 3``)."""
        row = {"row": label, "t_s": round(time.perf_counter() - self._t0, 3), **figures}
        peak = cuda_peak_gib()
        if peak is not None and "peak_gib" not in row:
            row["peak_gib"] = peak
        self._append(row)
        self.count += 1

    def result(self, figures: dict) -> None:
        """The part's whole figures, last: its presence means the part finished."""
        peak = cuda_peak_gib()
        if peak is not None:
            figures = {**figures, "peak_gib": figures.get("peak_gib", peak)}
        self._append({"result": figures})


def read_rows(path: str | Path) -> tuple[list[dict], dict | None]:
    """(rows, result) of a part's JSONL file; ([], None) if there is none. A line that does not
    parse (cut by a kill in the middle of its write) is skipped."""
    path = Path(path)
    if not path.is_file():
        return [], None
    rows, result = [], None
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if "result" in obj:
            result = obj["result"]
        elif "row" in obj:
            rows.append(obj)
    return rows, result


def rows_peak_gib(rows: list[dict], result: dict | None) -> float | None:
    """The highest peak GPU memory any row (or the result) recorded."""
    peaks = [r["peak_gib"] for r in [*rows, result or {}] if isinstance(r.get("peak_gib"), (int, float))]
    return max(peaks) if peaks else None
