"""Suffix index of the speculative draft sources: a bounded-depth suffix trie with counts
(SuffixDecoding-style) over several token sequences, and the loader that picks its implementation.

``megarl._suffix_index.SuffixIndex`` (C++, ``csrc/suffix_index.cpp``) and :class:`PySuffixIndex`
(pure Python, below) implement the same algorithm and give identical results, ValueErrors and
their messages included (for ints beyond int64 or odd types both raise, the exception type may
differ); ``tests/spec/test_suffix_index.py`` checks parity on random streams against each other
and a brute-force oracle. Contexts may be lists, tuples, arrays or tensors; lists are fastest.
The C++ one is optional: :data:`SuffixIndex` is it when it is built, else the twin, with one
logged warning.

Semantics
---------
The trie holds every substring of length ``<= max_depth`` of every sequence. A node's ``count``
is the number of occurrences (start positions) of its string; its ``last`` is the value of a
per-index clock (incremented once per appended token, starting at 1) at the most recent append
that passed through it. Appends are incremental and cost O(max_depth): each sequence keeps the
nodes of its current suffixes (``active[k]`` = suffix of length k, k < max_depth).

``draft(context, max_tokens, max_match, min_match, min_prob)`` finds ``m``, the longest length in
``[min_match, min(max_match, len(context), max_depth - 1)]`` such that ``context[-m:]`` is in the
trie and its node has a child (none: ``([], 0)``), then extends greedily by at most
``min(max_tokens, max_depth - m)`` tokens: the child with the largest count, ties broken by the
larger ``last``; it stops at a leaf or when the running product of ``child.count / parent.count``
(float64, multiplied in order) drops below ``min_prob`` (the token that would take it below is
not drafted; equality is kept). It returns ``(tokens, m)``; with ``max_tokens=0`` that is
``([], m)``, so callers still learn the match length. Context items that are not valid token
ids (negative, > 2**31 - 1) match nothing.

Valid arguments (``ValueError`` naming the argument otherwise): ``max_depth >= 2``;
``0 <= seq_id <= 2**63 - 1``; token ids in ``[0, 2**31 - 1]`` (``add`` is all-or-nothing);
``max_tokens >= 0``; ``min_match >= 1``; ``max_match >= min_match``; ``0 <= min_prob <= 1``.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from operator import index as _index

logger = logging.getLogger("megarl")

MAX_TOKEN = 2**31 - 1  # token ids are int32 in the C++ index
_MAX_SEQ_ID = 2**63 - 1


def _check_int(x, lo: int, hi: int, what: str) -> int:
    v = _index(x)  # TypeError for non-ints, as in C++
    if not lo <= v <= hi:
        raise ValueError(f"{what} must be an int in [{lo}, {hi}], got {x!r}")
    return v


class PySuffixIndex:
    """Pure-Python twin of the C++ ``SuffixIndex``: same algorithm, same results (see module doc)."""

    def __init__(self, max_depth: int = 24):
        max_depth = _index(max_depth)
        if max_depth < 2:
            raise ValueError(f"max_depth must be an int >= 2, got {max_depth}")
        self._max_depth = max_depth
        self._clock = 0
        # Node arrays indexed by node id (0 = root), as in C++. _kids[n] maps token -> child id;
        # _best[n] is the child the greedy draft takes (largest count, then most recent), or -1.
        self._kids: list[dict[int, int]] = [{}]
        self._count: list[int] = [0]
        self._last: list[int] = [0]
        self._best: list[int] = [-1]
        self._tok: list[int] = [-1]
        self._seqs: dict[int, list[int]] = {}  # seq_id -> active suffix nodes

    @property
    def max_depth(self) -> int:
        return self._max_depth

    @property
    def n_sequences(self) -> int:
        return len(self._seqs)

    @property
    def n_tokens(self) -> int:
        return self._clock

    @property
    def n_nodes(self) -> int:
        return len(self._count) - 1  # root excluded

    def __repr__(self) -> str:
        return (f"SuffixIndex(max_depth={self._max_depth}, n_sequences={self.n_sequences}, "
                f"n_tokens={self.n_tokens}, n_nodes={self.n_nodes})")

    def add(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (an unseen id starts an empty sequence).
        All tokens are validated before any is added."""
        seq_id = _check_int(seq_id, 0, _MAX_SEQ_ID, "seq_id")
        toks = [_check_int(t, 0, MAX_TOKEN, "token id") for t in tokens]
        active = self._seqs.setdefault(seq_id, [0])
        for t in toks:
            self._append(active, t)

    def _append(self, active: list[int], t: int) -> None:
        # Same steps as SuffixIndex::append in csrc/suffix_index.cpp; comments there.
        self._clock += 1
        clock, count, kids, best = self._clock, self._count, self._kids, self._best
        count[0] += 1
        self._last[0] = clock
        for k in range(len(active) - 1, -1, -1):
            parent = active[k]
            c = kids[parent].get(t)
            if c is None:
                c = len(count)
                kids[parent][t] = c
                kids.append({})
                count.append(0)
                self._last.append(0)
                best.append(-1)
                self._tok.append(t)
            count[c] += 1
            self._last[c] = clock
            b = best[parent]
            if b != c and (b < 0 or count[c] >= count[b]):
                best[parent] = c
            if k + 1 < self._max_depth:
                if k + 1 == len(active):
                    active.append(c)
                else:
                    active[k + 1] = c

    def _walk(self, tail: list[int], m: int) -> int:
        node, kids = 0, self._kids
        for t in tail[len(tail) - m:]:
            node = kids[node].get(t, -1)
            if node < 0:
                return -1
        return node

    def draft(self, context: Sequence[int], max_tokens: int, max_match: int = 16, min_match: int = 1,
              min_prob: float = 0.0) -> tuple[list[int], int]:
        """Draft continuation of ``context``: ``(tokens, match length)``; see the module doc."""
        max_tokens, max_match, min_match = _index(max_tokens), _index(max_match), _index(min_match)
        min_prob = float(min_prob)
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens}")
        if min_match < 1:
            raise ValueError(f"min_match must be an int >= 1, got {min_match}")
        if max_match < min_match:
            raise ValueError(f"max_match must be an int >= min_match ({min_match}), got {max_match}")
        if not 0.0 <= min_prob <= 1.0:  # also rejects NaN
            raise ValueError(f"min_prob must be a float in [0, 1], got {min_prob!r}")
        n = len(context)
        L = min(max_match, n, self._max_depth - 1)
        if L < min_match:
            return [], 0
        # Invalid ids become -1, which no edge carries; _index keeps TypeErrors equal to C++.
        tail = [v if 0 <= v <= MAX_TOKEN else -1 for v in (_index(context[i]) for i in range(n - L, n))]
        # Binary search for the longest match with a child (downward closed in m; see the C++).
        best = self._best
        m, node, lo, hi = 0, -1, min_match, L
        v = self._walk(tail, L)  # fast path: the full tail usually matches in repetitive text
        if v >= 0 and best[v] >= 0:
            m, node, lo = L, v, L + 1
        else:
            hi = L - 1
        while lo <= hi:
            mid = lo + (hi - lo) // 2
            v = self._walk(tail, mid)
            if v >= 0 and best[v] >= 0:
                m, node, lo = mid, v, mid + 1
            else:
                hi = mid - 1
        if m == 0:
            return [], 0
        out: list[int] = []
        count, tok = self._count, self._tok
        prob = 1.0
        for _ in range(min(max_tokens, self._max_depth - m)):
            c = best[node]
            if c < 0:
                break
            prob *= count[c] / count[node]  # int / int is correctly rounded, as double(a) / double(b)
            if prob < min_prob:
                break
            out.append(tok[c])
            node = c
        return out, m

    def node_stats(self, path: Iterable[int]) -> tuple[int, int]:
        """``(count, last)`` of the node of ``path`` (``(0, 0)`` if absent); the root (empty path)
        counts every appended token. For tests and debugging."""
        node = 0
        for x in path:
            v = _index(x)
            node = self._kids[node].get(v, -1) if 0 <= v <= MAX_TOKEN else -1
            if node < 0:
                return 0, 0
        return self._count[node], self._last[node]


try:
    from megarl._suffix_index import SuffixIndex as NativeSuffixIndex
    _NATIVE_ERROR: str | None = None
except ImportError as e:  # not built (no compiler / no pybind11) or built for another Python
    NativeSuffixIndex = None
    _NATIVE_ERROR = str(e)

_warned = False


def native_available() -> bool:
    """Whether the C++ suffix index (``megarl._suffix_index``) is built and importable."""
    return NativeSuffixIndex is not None


def _warn_fallback() -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(
            "The C++ suffix index (megarl._suffix_index) is not built (%s); using the slower Python twin "
            "PySuffixIndex, which gives identical drafts. Build it with `pip install --no-build-isolation -e .` "
            "or `python setup.py build_ext --inplace` (needs pybind11 and a C++17 compiler).", _NATIVE_ERROR)


if NativeSuffixIndex is not None:
    SuffixIndex = NativeSuffixIndex
else:
    class SuffixIndex(PySuffixIndex):  # type: ignore[no-redef]
        """The Python twin, chosen because the C++ index is not built (warns once)."""

        def __init__(self, max_depth: int = 24):
            _warn_fallback()
            super().__init__(max_depth)


def make_suffix_index(max_depth: int = 24, backend: str = "auto"):
    """A suffix index: ``backend`` is ``auto`` (C++ if built, else the Python twin with one
    warning), ``native`` (C++; error if not built) or ``python`` (the twin)."""
    if backend == "auto":
        return SuffixIndex(max_depth)
    if backend == "native":
        if NativeSuffixIndex is None:
            raise RuntimeError(
                f"suffix_backend='native' but the C++ suffix index is not built ({_NATIVE_ERROR}); build it "
                "with `pip install --no-build-isolation -e .` or `python setup.py build_ext --inplace`, "
                "or use backend 'auto' or 'python'")
        return NativeSuffixIndex(max_depth)
    if backend == "python":
        return PySuffixIndex(max_depth)
    raise ValueError(f"backend={backend!r} is invalid; valid: auto, native, python")
