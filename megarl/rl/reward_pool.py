"""Computing rewards concurrently as responses finish, without letting any of them hurt the run.

A reward is a plain function returning a float. ``RewardPool.submit`` runs it on a thread pool
and returns a ``Future[float]`` that never raises: an exception in the function gives reward
0.0 and is counted (``stats()["errors"]["exception:<Name>"]``). Threads are enough because the
heavy or dangerous work (executing model-written code) happens in ``megarl.rl.sandbox``
subprocesses, and the rest are small Python functions.

Sandboxed rewards. A function decorated with ``@sandboxed`` is called as
``fn(*args, limits=pool.current_limits(), **kwargs)`` and is expected to pass ``limits`` on to
``run_python``. The pool observes every ``run_python`` call the function makes in its worker
thread (``sandbox.recorded_results``), so it can

- count abnormal endings: a reward whose runs ended in ``timeout``, ``memory``, ``file_size``
  or ``killed`` counts one error of that kind (``error`` status, i.e. a failing program, is a
  normal 0 reward, not an error);
- adapt the timeout: programs that pass take ~50 ms, so waiting the full 5 s for each of a batch
  of hanging programs wastes minutes of rollout. The durations of recent ``ok`` runs (a bounded
  window) set ``timeout = clamp(factor * P95, min_timeout_s, max_timeout_s)``
  (``adaptive_timeout``, a pure function), once ``min_samples`` successes have been seen. Only
  the wall clock adapts; the other limits stay as given.

Why observe instead of making rewards return their ``SandboxResult``: reward functions keep the
plain ``-> float`` signature and stay callable outside the pool (``limits`` defaults to None,
i.e. ``SandboxLimits()``).

``python_tests_reward`` is the ready-made sandboxed reward: run the model's program followed by
assert-based tests.
"""
from __future__ import annotations

import functools
import math
import numbers
import re
import secrets
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from megarl.rl.sandbox import SandboxLimits, SandboxResult, recorded_results, run_python

_SANDBOXED_ATTR = "__megarl_sandboxed__"
ABNORMAL_STATUSES = ("timeout", "memory", "file_size", "killed")
"""Sandbox statuses the pool counts as errors (in this order of precedence within one reward)."""


def sandboxed(fn: Callable) -> Callable:
    """Mark ``fn`` as a sandboxed reward: ``RewardPool`` passes it ``limits=`` (the pool's current,
    adaptive limits) unless the caller gave ``limits`` explicitly."""
    setattr(fn, _SANDBOXED_ATTR, True)
    return fn


def is_sandboxed(fn: Callable) -> bool:
    """True for functions marked with ``@sandboxed``, also through ``functools.partial``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return bool(getattr(fn, _SANDBOXED_ATTR, False))


def p95(values: Sequence[float]) -> float:
    """95th percentile by the nearest-rank method: the smallest value with at least 95% of the
    values <= it (deterministic, no interpolation)."""
    if not values:
        raise ValueError("p95 of no values")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def adaptive_timeout(durations: Sequence[float], *, initial_s: float, factor: float, min_s: float, max_s: float,
                     min_samples: int) -> float:
    """The wall-clock timeout for the next sandboxed run given the durations of recent successful
    runs: ``initial_s`` until there are ``min_samples`` of them, then ``factor * p95(durations)``;
    always clamped to ``[min_s, max_s]``."""
    raw = initial_s if len(durations) < max(min_samples, 1) else factor * p95(durations)
    return min(max(raw, min_s), max_s)


class RewardPool:
    """Runs reward functions on ``workers`` threads; see the module docstring.

    ``limits``: sandbox limits handed to ``@sandboxed`` rewards (default ``SandboxLimits()``);
    with ``adaptive`` their ``timeout_s`` is replaced by ``adaptive_timeout`` over the last
    ``window`` successful run durations with ``factor``, ``min_timeout_s``, ``max_timeout_s``
    (default ``limits.timeout_s``) and ``min_samples``.
    """

    def __init__(self, workers: int, limits: SandboxLimits | None = None, adaptive: bool = True, *,
                 factor: float = 3.0, window: int = 256, min_timeout_s: float = 1.0,
                 max_timeout_s: float | None = None, min_samples: int = 8):
        limits = limits if limits is not None else SandboxLimits()
        max_timeout_s = limits.timeout_s if max_timeout_s is None else max_timeout_s
        _check_positive_int("workers", workers)
        _check_positive_int("window", window)
        _check_positive_int("min_samples", min_samples)
        for name, value in (("factor", factor), ("min_timeout_s", min_timeout_s), ("max_timeout_s", max_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"RewardPool {name} must be a finite number > 0, got {value!r}")
        if min_timeout_s > max_timeout_s:
            raise ValueError(f"RewardPool min_timeout_s={min_timeout_s} exceeds max_timeout_s={max_timeout_s}")
        self._limits = limits
        self._adaptive = adaptive
        self._factor, self._min_s, self._max_s, self._min_samples = factor, min_timeout_s, max_timeout_s, min_samples
        self._durations: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._timeout_s = self._compute_timeout()
        self._counts = Counter()
        self._errors = Counter()
        self._runs = Counter()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
        self._closed = False

    # -- submission ----------------------------------------------------------------------------

    def submit(self, fn: Callable[..., float], *args, **kwargs) -> Future:
        """Run ``fn(*args, **kwargs)`` (plus ``limits=`` for ``@sandboxed`` functions) on a worker.
        The future's result is the reward as a float, or 0.0 when ``fn`` raised or returned
        something that is not a finite number; it never raises."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool.submit after close()")
            self._counts["submitted"] += 1
        return self._executor.submit(self._call, fn, args, kwargs)

    def current_limits(self) -> SandboxLimits:
        """The limits the next sandboxed reward gets: the given ones with the current timeout."""
        with self._lock:
            return replace(self._limits, timeout_s=self._timeout_s)

    def _call(self, fn: Callable, args: tuple, kwargs: dict) -> float:
        if is_sandboxed(fn) and "limits" not in kwargs:
            kwargs = {**kwargs, "limits": self.current_limits()}
        error = None
        value = 0.0
        with recorded_results() as runs:
            try:
                value = _as_reward(fn(*args, **kwargs))
            except NonFiniteReward:
                error = "non_finite"
            except BaseException as e:   # a reward must never take the run down (SystemExit included)
                error = f"exception:{type(e).__name__}"
        self._record(runs, error)
        return value

    def _record(self, runs: list[SandboxResult], error: str | None) -> None:
        statuses = {r.status for r in runs}
        if error is None:
            error = next((s for s in ABNORMAL_STATUSES if s in statuses), None)
        with self._lock:
            self._counts["completed"] += 1
            if error is None:
                self._counts["ok"] += 1
            else:
                self._errors[error] += 1
            for r in runs:
                self._runs[r.status] += 1
                if r.status == "ok":
                    self._durations.append(r.seconds)
            if any(r.status == "ok" for r in runs):
                self._timeout_s = self._compute_timeout()

    def _compute_timeout(self) -> float:
        if not self._adaptive:
            return self._limits.timeout_s
        return adaptive_timeout(list(self._durations), initial_s=self._limits.timeout_s, factor=self._factor,
                                min_s=self._min_s, max_s=self._max_s, min_samples=self._min_samples)

    # -- reporting and lifetime ----------------------------------------------------------------

    def stats(self) -> dict:
        """Counts so far: ``submitted``, ``completed``, ``ok`` (rewards without error), ``errors``
        by kind (``timeout``, ``memory``, ``file_size``, ``killed``, ``exception:<Name>``,
        ``non_finite``) and their ``error_total``, ``sandbox_runs`` by status, the current
        ``timeout_s`` and the number of duration ``samples`` it is based on."""
        with self._lock:
            return {"submitted": self._counts["submitted"], "completed": self._counts["completed"],
                    "ok": self._counts["ok"], "errors": dict(self._errors), "error_total": sum(self._errors.values()),
                    "sandbox_runs": dict(self._runs), "timeout_s": self._timeout_s, "adaptive": self._adaptive,
                    "samples": len(self._durations)}

    def close(self, wait: bool = True) -> None:
        """Stop accepting work; with ``wait``, return once every submitted reward has finished
        (each is bounded by its sandbox timeout)."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=wait)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NonFiniteReward(ValueError):
    """A reward function returned NaN or an infinity."""


def _as_reward(value) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise NonFiniteReward(f"reward {value} is not finite")
    return value


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"RewardPool {name} must be an integer >= 1, got {value!r}")


# ----------------------------------------------------------------------------------------------
# ready-made sandboxed reward

_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.MULTILINE | re.DOTALL)
_PYTHON_TAGS = ("python", "python3", "py")


def extract_program(response: str) -> str:
    """The code of the last ```python (or ```py / ```python3) fenced block of ``response``; else
    of the last untagged fence; else the whole response. A final fence left open (a response cut
    at the length limit) runs to the end of the text."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE_RE.finditer(response)]
    for wanted in (lambda tag: tag in _PYTHON_TAGS, lambda tag: tag == ""):
        chosen = [code for tag, code in blocks if wanted(tag)]
        if chosen:
            return chosen[-1]
    return response


@sandboxed
def python_tests_reward(response: str, tests: str, limits: SandboxLimits | None = None) -> float:
    """1.0 when the program extracted from ``response`` (``extract_program``) followed by
    ``tests`` (assert statements) runs to the end and exits 0 in the sandbox, else 0.0.

    "Runs to the end" is checked with a random marker printed after the tests: a program that
    calls ``sys.exit(0)`` / ``os._exit(0)`` before the asserts is a known reward hack and gets
    0.0. (A program that digs the marker out of its own code object could still fake it; that is
    beyond what this guards.) A correct program that prints more than ``max_output_bytes``
    loses the marker to truncation and also gets 0.0."""
    marker = f"__megarl_tests_passed_{secrets.token_hex(16)}__"
    code = f"{extract_program(response)}\n\n{tests}\n\nprint({marker!r}, flush=True)\n"
    result = run_python(code, limits=limits)
    return 1.0 if result.ok and marker in result.stdout else 0.0


__all__ = ["ABNORMAL_STATUSES", "NonFiniteReward", "RewardPool", "adaptive_timeout", "extract_program",
           "is_sandboxed", "p95", "python_tests_reward", "sandboxed"]
