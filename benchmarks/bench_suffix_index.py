"""Suffix index speed: C++ (megarl._suffix_index) vs the Python twin, per lookup and per append.

Workload: a GRPO-group-like set of responses (8 x 300 tokens, vocab 30) built from shared
motifs with mutations plus random noise; lookups use contexts that are prefixes of those
responses (what a request's own tokens look like), with max_tokens=8, max_match=16, max_depth=24.
Times are CPU time (time.process_time, so a busy shared machine's preemptions do not count),
best of --repeats runs, Python call overhead included. Prints figures only; no asserts on timing.

    .venv/bin/python benchmarks/bench_suffix_index.py [--lookups 20000] [--repeats 5]
"""
import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from megarl.spec.suffix_index import NativeSuffixIndex, PySuffixIndex, native_available


def workload(rng, n_seqs=8, length=300, vocab=30):
    motifs = [[rng.randrange(vocab) for _ in range(rng.randrange(4, 16))] for _ in range(6)]
    seqs = []
    for _ in range(n_seqs):
        s = []
        while len(s) < length:
            if rng.random() < 0.7:  # a motif, sometimes with a substituted token
                s += [t if rng.random() > 0.05 else rng.randrange(vocab) for t in rng.choice(motifs)]
            else:
                s += [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        seqs.append(s[:length])
    return seqs


def best_of(repeats, fn):
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def bench(cls, seqs, contexts, max_depth, repeats):
    """Per-token append times (us) one token at a time and in bulk, per-lookup time (us), drafts."""
    def build_one_token_at_a_time():  # as the group source appends decoded tokens, interleaved
        idx = cls(max_depth)
        for i in range(max(map(len, seqs))):
            for sid, s in enumerate(seqs):
                if i < len(s):
                    idx.add(sid, [s[i]])
        return idx

    def build_bulk():  # as the history source adds finished responses
        idx = cls(max_depth)
        for sid, s in enumerate(seqs):
            idx.add(sid, s)

    idx = build_one_token_at_a_time()
    draft = idx.draft

    def lookups():
        for c in contexts:
            draft(c, 8)

    n_tok = sum(map(len, seqs))
    return {"inc": best_of(repeats, build_one_token_at_a_time) / n_tok * 1e6,
            "bulk": best_of(repeats, build_bulk) / n_tok * 1e6,
            "look": best_of(repeats, lookups) / len(contexts) * 1e6,
            "drafts": [draft(c, 8) for c in contexts], "n_nodes": idx.n_nodes}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lookups", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-depth", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    seqs = workload(rng)
    # Contexts: prefixes of the responses (the whole prefix is passed; only its tail is read).
    contexts = []
    for _ in range(args.lookups):
        s = rng.choice(seqs)
        contexts.append(s[:rng.randrange(1, len(s) + 1)])

    backends = {"python": PySuffixIndex}
    if native_available():
        backends["c++"] = NativeSuffixIndex
    else:
        print("C++ suffix index not built (python setup.py build_ext --inplace): Python twin only")
    res = {}
    for name, cls in backends.items():
        r = res[name] = bench(cls, seqs, contexts, args.max_depth, args.repeats)
        mean = sum(len(d) for d, _ in r["drafts"]) / len(contexts)
        print(f"{name:>6}: {r['n_nodes']} nodes over {sum(map(len, seqs))} tokens, mean draft {mean:.2f} tokens; "
              f"lookup {r['look']:.2f} us; append {r['inc']:.2f} us/token one at a time, {r['bulk']:.2f} in bulk")
    if len(res) == 2:
        p, c = res["python"], res["c++"]
        same = "identical" if p["drafts"] == c["drafts"] else "DIFFERENT"
        print(f"python/c++: lookup {p['look'] / c['look']:.1f}x, append one at a time {p['inc'] / c['inc']:.1f}x, "
              f"in bulk {p['bulk'] / c['bulk']:.1f}x ({same} drafts)")


if __name__ == "__main__":
    main()
