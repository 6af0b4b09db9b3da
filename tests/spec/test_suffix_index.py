"""Suffix index: hand-computed semantics, a brute-force oracle that reads the spec literally, and
parity between the C++ index and its Python twin (skipped only when the extension is not built)."""
import importlib.util
import logging
import random
import sys
from collections import defaultdict

import pytest

import megarl.spec.suffix_index as si
from megarl.spec.suffix_index import NativeSuffixIndex, PySuffixIndex, make_suffix_index, native_available

BACKENDS = [PySuffixIndex] + ([NativeSuffixIndex] if native_available() else [])
needs_native = pytest.mark.skipif(not native_available(),
                                  reason="C++ suffix index not built (python setup.py build_ext --inplace)")


@pytest.fixture(params=BACKENDS, ids=lambda c: "native" if c is NativeSuffixIndex else "python")
def cls(request):
    return request.param


# ---- brute-force oracle: every substring with its occurrence count and latest end stamp ----------

class Oracle:
    def __init__(self, max_depth):
        self.d, self.seqs, self.clock = max_depth, {}, 0

    def add(self, seq_id, tokens):
        seq = self.seqs.setdefault(seq_id, [])
        for t in tokens:
            self.clock += 1
            seq.append((t, self.clock))

    def table(self):
        tab = {}
        for seq in self.seqs.values():
            for i in range(len(seq)):
                for k in range(1, min(self.d, len(seq) - i) + 1):
                    e = tab.setdefault(tuple(t for t, _ in seq[i:i + k]), [0, 0])
                    e[0] += 1
                    e[1] = max(e[1], seq[i + k - 1][1])
        kids = defaultdict(list)
        for s, (c, last) in tab.items():
            kids[s[:-1]].append((c, last, s[-1]))
        return tab, kids

    def draft(self, tk, ctx, max_tokens, max_match=16, min_match=1, min_prob=0.0):
        tab, kids = tk
        L = min(max_match, len(ctx), self.d - 1)
        for m in range(L, min_match - 1, -1):  # the spec, literally: longest m first
            s = tuple(ctx[len(ctx) - m:])
            if s in tab and kids[s]:
                break
        else:
            return [], 0
        out, p = [], 1.0
        for _ in range(min(max_tokens, self.d - m)):
            if not kids[s]:
                break
            c, _, t = max(kids[s])  # largest count, then largest last (unique among siblings)
            p *= c / tab[s][0]
            if p < min_prob:
                break
            out.append(t)
            s = s + (t,)
        return out, m


# ---- hand-computed semantics ------------------------------------------------------------------

def test_counts_and_last(cls):
    s = cls(3)
    s.add(0, [1, 2, 1, 2, 3])  # clock 1..5
    assert s.node_stats([1, 2]) == (2, 4)
    assert s.node_stats([2, 1]) == (1, 3)
    assert s.node_stats([1, 2, 3]) == (1, 5)
    assert s.node_stats([2, 1, 2]) == (1, 4)
    assert s.node_stats([1, 2, 1, 2]) == (0, 0)  # longer than max_depth: not stored
    assert s.node_stats([3, 1]) == (0, 0)
    assert s.node_stats([]) == (5, 5)
    # distinct substrings of length <= 3: 1 2 3 | 12 21 23 | 121 212 123
    assert (s.n_nodes, s.n_tokens, s.n_sequences) == (9, 5, 1)
    s.add(7, [])  # an unseen id starts an empty sequence
    assert (s.n_nodes, s.n_tokens, s.n_sequences) == (9, 5, 2)
    s.add(7, [2, 1])
    assert s.node_stats([2, 1]) == (2, 7)
    assert s.node_stats([1, 2, 1]) == (1, 3)  # [2, 1] in seq 7 does not continue seq 0


def test_longest_match_and_recency_tie_break(cls):
    s = cls()
    s.add(0, [5, 1, 2, 3, 4])
    s.add(1, [7, 2, 3, 9])
    assert s.draft([1, 2, 3], 8) == ([4], 3)
    assert s.draft([8, 2, 3], 8) == ([9], 2)  # "23" -> 4 or 9, one each: 9 is more recent
    s.add(0, [2, 3, 4])  # now "234" twice: the count wins over recency
    assert s.draft([8, 2, 3], 8) == ([4, 2, 3, 4], 2)  # 4 (2x), then "234" -> 2 (from seq 0)...
    assert s.draft([0, 0], 8) == ([], 0)
    assert s.draft([], 8) == ([], 0)


def test_match_needs_a_child(cls):
    s = cls()
    s.add(0, [1, 2, 3])
    assert s.draft([1, 2, 3], 4) == ([], 0)  # "123", "23", "3" are all leaves
    assert s.draft([0, 1, 2], 4) == ([3], 2)
    assert s.draft([2], 4) == ([3], 1)


def test_match_bounds(cls):
    s = cls()
    s.add(0, [1, 2, 3, 4, 5, 6])
    assert s.draft([1, 2, 3], 8, max_match=2) == ([4, 5, 6], 2)
    assert s.draft([1, 2, 3], 8, min_match=4) == ([], 0)  # context shorter than min_match
    assert s.draft([9, 2, 3], 8, min_match=3) == ([], 0)
    assert s.draft([9, 2, 3], 8, min_match=2) == ([4, 5, 6], 2)
    assert s.draft([1, 2, 3], 2) == ([4, 5], 3)


def test_max_depth_bound(cls):
    s = cls(3)
    s.add(0, [1, 2, 3, 4, 5])
    assert s.draft([1, 2], 8) == ([3], 2)  # match + draft <= max_depth
    assert s.draft([2], 8) == ([3, 4], 1)
    assert s.draft([1, 2, 3], 8) == ([4], 2)  # match <= max_depth - 1
    s2 = cls(2)
    s2.add(0, [1, 2, 3])
    assert s2.draft([5, 1], 8) == ([2], 1)


def test_min_prob(cls):
    s = cls()
    s.add(0, [1, 2, 1, 2, 1, 3])
    # "1"(3) -> "12"(2): p=2/3; "12" -> "121"(2): p=2/3; "121" -> "1212"/"1213" one each, "1213" more recent: p=1/3
    assert s.draft([1], 8) == ([2, 1, 3], 1)
    assert s.draft([1], 8, min_prob=0.5) == ([2, 1], 1)
    assert s.draft([1], 8, min_prob=2 / 3) == ([2, 1], 1)  # the bound is inclusive
    assert s.draft([1], 8, min_prob=0.7) == ([], 1)
    assert s.draft([1], 8, min_prob=1.0) == ([], 1)


def test_max_tokens_zero_reports_the_match(cls):
    s = cls()
    s.add(0, [1, 2, 3])
    assert s.draft([1, 2], 0) == ([], 2)
    assert s.draft([3], 0) == ([], 0)


def test_incremental_add_is_equivalent(cls):
    rng = random.Random(0)
    seqs = {sid: [rng.randrange(4) for _ in range(60)] for sid in range(3)}
    whole, steps = cls(6), cls(6)
    for sid, toks in seqs.items():
        whole.add(sid, toks)
        i = 0
        while i < len(toks):  # same global order, random chunks (incl. empty ones)
            n = rng.randrange(0, 5)
            steps.add(sid, toks[i:i + n])
            i += n
    assert (whole.n_nodes, whole.n_tokens, whole.n_sequences) == (steps.n_nodes, steps.n_tokens, steps.n_sequences)
    for toks in seqs.values():
        for i in range(len(toks)):
            for k in range(1, 7):
                assert whole.node_stats(toks[i:i + k]) == steps.node_stats(toks[i:i + k])
            ctx = toks[:i + 1]
            assert whole.draft(ctx, 8) == steps.draft(ctx, 8)


def test_invalid_context_tokens_match_nothing(cls):
    s = cls()
    s.add(0, [1, 2, 3])
    assert s.draft([-1, 1], 4) == ([2, 3], 1)
    assert s.draft([1, -1], 4) == ([], 0)
    assert s.draft([1, 2**40], 4) == ([], 0)
    with pytest.raises(TypeError):
        s.draft([1, 2.0], 4)


ERRORS = [
    (lambda c: c(1), "max_depth must be an int >= 2, got 1"),
    (lambda c: c().add(-1, [1]), r"seq_id must be an int in \[0, 9223372036854775807\], got -1"),
    (lambda c: c().add(0, [1, -2]), r"token id must be an int in \[0, 2147483647\], got -2"),
    (lambda c: c().add(0, [2**31]), r"token id must be an int in \[0, 2147483647\], got 2147483648"),
    (lambda c: c().draft([1], -1), "max_tokens must be an int >= 0, got -1"),
    (lambda c: c().draft([1], 4, min_match=0), "min_match must be an int >= 1, got 0"),
    (lambda c: c().draft([1], 4, max_match=2, min_match=3), r"max_match must be an int >= min_match \(3\), got 2"),
    (lambda c: c().draft([1], 4, min_prob=-0.5), r"min_prob must be a float in \[0, 1\], got -0.5"),
    (lambda c: c().draft([1], 4, min_prob=1.5), r"min_prob must be a float in \[0, 1\], got 1.5"),
    (lambda c: c().draft([1], 4, min_prob=float("nan")), r"min_prob must be a float in \[0, 1\], got nan"),
]


@pytest.mark.parametrize("call,msg", ERRORS)
def test_errors(cls, call, msg):
    with pytest.raises(ValueError, match=f"^{msg}$"):
        call(cls)


def test_failed_add_changes_nothing(cls):
    s = cls()
    s.add(0, [1, 2])
    with pytest.raises(ValueError):
        s.add(0, [3, 4, -1])
    with pytest.raises(TypeError):
        s.add(0, [3, 1.5])
    with pytest.raises(ValueError):
        s.add(5, [3, -1])
    assert (s.n_tokens, s.n_nodes, s.n_sequences) == (2, 3, 1)
    assert s.draft([1], 4) == ([2], 1)


# ---- random streams: Python twin == oracle, C++ == Python twin ------------------------------------

CASES = [(3, 2), (3, 6), (8, 5), (8, 24), (50, 12), (50, 24)]


def random_stream(vocab, max_depth, seed, backends, oracle=None, n_rounds=60, n_queries=120):
    """Interleaved appends to 5 sequences (repeated motifs, mutated copies and noise); at 4
    checkpoints, random queries must give the same (tokens, m) on every backend and the oracle."""
    rng = random.Random(seed)
    motifs = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 12))] for _ in range(4)]
    idx = [b(max_depth) for b in backends]
    seqs = defaultdict(list)
    for rnd in range(n_rounds):
        sid = rng.randrange(5)
        r = rng.random()
        if r < 0.4:
            chunk = list(rng.choice(motifs))
        elif r < 0.6 and seqs[sid]:
            i = rng.randrange(len(seqs[sid]))
            chunk = [t if rng.random() > 0.1 else rng.randrange(vocab) for t in seqs[sid][i:i + 15]]
        else:
            chunk = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        seqs[sid] += chunk
        if rng.random() < 0.5:
            for x in idx:
                x.add(sid, chunk)
        else:  # one token at a time, as the group source appends
            for t in chunk:
                for x in idx:
                    x.add(sid, [t])
        if oracle is not None:
            oracle.add(sid, chunk)
        if rnd % 15 != 14:
            continue
        stats = {(x.n_nodes, x.n_tokens, x.n_sequences) for x in idx}
        assert len(stats) == 1, stats
        tk = oracle.table() if oracle is not None else None
        if tk is not None:
            assert idx[0].n_nodes == len(tk[0])
        all_seqs = [s for s in seqs.values() if s]
        for _ in range(n_queries):
            q = rng.random()
            if q < 0.6:  # a prefix of a sequence, maybe with a mutated or foreign tail
                s = rng.choice(all_seqs)
                ctx = s[:rng.randrange(1, len(s) + 1)]
                if q < 0.15:
                    ctx = ctx + [rng.randrange(vocab)]
            elif q < 0.9:
                ctx = [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
            else:
                ctx = rng.choice(motifs) * 3
            args = {"max_tokens": rng.choice([0, 1, 3, 8, 40]), "max_match": rng.randrange(1, 30)}
            args["min_match"] = rng.randrange(1, args["max_match"] + 1) if rng.random() < 0.3 else 1
            args["min_prob"] = rng.choice([0.0, 0.0, 0.05, 0.2, 0.5, 0.9, 1.0])
            got = [x.draft(ctx, **args) for x in idx]
            if tk is not None:
                got.append(oracle.draft(tk, ctx, **args))
            assert all(g == got[0] for g in got), (ctx, args, got)


@pytest.mark.parametrize("vocab,max_depth", CASES)
def test_python_twin_matches_oracle(vocab, max_depth):
    random_stream(vocab, max_depth, seed=vocab * 100 + max_depth, backends=[PySuffixIndex],
                  oracle=Oracle(max_depth))


@needs_native
@pytest.mark.parametrize("vocab,max_depth", CASES)
def test_native_matches_python_twin(vocab, max_depth):
    for seed in range(6):  # the twin is checked against the oracle above
        random_stream(vocab, max_depth, seed=seed, backends=[NativeSuffixIndex, PySuffixIndex], n_rounds=150)


@needs_native
def test_native_matches_python_twin_on_a_large_index():
    # ~100k nodes (many table growths), token ids up to the int32 limit, long contexts.
    rng = random.Random(7)
    vocab = [rng.randrange(2**31) for _ in range(200)] + [0, 2**31 - 1]
    motifs = [[rng.choice(vocab) for _ in range(rng.randrange(3, 30))] for _ in range(20)]
    a, b = NativeSuffixIndex(24), PySuffixIndex(24)
    seqs = []
    for sid in range(8):
        seq = []
        while len(seq) < 600:
            seq += rng.choice(motifs) if rng.random() < 0.6 else [rng.choice(vocab) for _ in range(5)]
        seqs.append(seq)
        a.add(sid, seq)
        b.add(sid, seq)
    assert a.n_nodes == b.n_nodes > 50_000
    for _ in range(500):
        s = rng.choice(seqs)
        ctx = s[:rng.randrange(1, len(s) + 1)] + ([rng.choice(vocab)] if rng.random() < 0.3 else [])
        kw = {"max_match": rng.choice([4, 16, 23, 40]), "min_prob": rng.choice([0.0, 0.3])}
        assert a.draft(ctx, 30, **kw) == b.draft(ctx, 30, **kw)
        assert a.node_stats(ctx[-5:]) == b.node_stats(ctx[-5:])


def test_accepts_arrays_tensors_and_tuples(cls):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    s = cls(8)
    s.add(np.int64(3), np.array([1, 2, 3, 1, 2, 4]))
    s.add(4, torch.tensor([1, 2, 3]))
    s.add(5, (2, 3))
    for ctx in ([9, 1, 2], (9, 1, 2), np.array([9, 1, 2]), torch.tensor([0, 9, 1, 2])[1:], range(9, 10)):
        assert s.draft(ctx, 4) == s.draft(list(ctx), 4)
    assert s.draft(torch.tensor([9, 1, 2]), 4) == ([3, 1, 2, 4], 2)
    assert s.node_stats((1, 2)) == s.node_stats(np.array([1, 2])) == (3, 8)
    assert s.node_stats(torch.tensor([2, 3])) == (3, 11)


# ---- loader ---------------------------------------------------------------------------------

def test_make_suffix_index_backends():
    assert isinstance(make_suffix_index(5, "python"), PySuffixIndex)
    auto = make_suffix_index(5)
    assert auto.max_depth == 5
    if native_available():
        assert isinstance(auto, NativeSuffixIndex) and si.SuffixIndex is NativeSuffixIndex
        assert isinstance(make_suffix_index(5, "native"), NativeSuffixIndex)
    with pytest.raises(ValueError, match="backend='gpu' is invalid; valid: auto, native, python"):
        make_suffix_index(5, "gpu")


def test_fallback_warns_once_and_native_errors(monkeypatch, caplog):
    # A fresh copy of the module, imported with the extension blocked (None in sys.modules makes
    # the import raise ImportError); the real module is left alone.
    monkeypatch.setitem(sys.modules, "megarl._suffix_index", None)
    spec = importlib.util.spec_from_file_location("_si_fallback", si.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert not mod.native_available()
    with caplog.at_level(logging.WARNING, logger="megarl"):
        a = mod.make_suffix_index(6)
        b = mod.SuffixIndex(6)
        mod.make_suffix_index(6, "python")
    warnings = [r for r in caplog.records if "suffix index" in r.getMessage()]
    assert len(warnings) == 1
    assert "build_ext --inplace" in warnings[0].getMessage()
    assert isinstance(a, mod.PySuffixIndex) and isinstance(b, mod.PySuffixIndex)
    with pytest.raises(RuntimeError, match="not built"):
        mod.make_suffix_index(6, "native")
