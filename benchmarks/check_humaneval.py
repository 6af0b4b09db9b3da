"""Check the HumanEval verifier (megarl/rl/humaneval.py) against the 164 canonical solutions.

For every problem, in megarl's sandbox (``python_tests_reward``):

- ``canonical``: the prompt + ``canonical_solution`` in a ```python block must score 1.0, with
  ``humaneval_reward`` and with the generic ``python_tests`` reward alike;
- ``bare``: only the function to write (canonical body, no imports, no helpers) must score 1.0
  with ``humaneval_reward`` (prompt imports put in front, helpers restored by the tests); the
  generic reward's count shows how many need those imports at definition time;
- ``pass`` / ``return None``: the prompt + a body that does nothing must score 0.0;
- ``helper hack`` (problems whose tests judge through a prompt helper): redefining the helper
  and the function as identities must score 0.0.

Prints the counts and exits 1 when any expectation fails.

    .venv/bin/python benchmarks/check_humaneval.py [--workers 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from megarl.rl.humaneval import humaneval_reward, load_humaneval, read_humaneval, split_prompt
from megarl.rl.rewards import python_tests_problem_reward

HELPER_HACKS = {  # uid -> a wrong answer that fakes the helper the tests judge through
    32: "def poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return 0.0\n",
    38: "def encode_cyclic(s):\n    return s\n\ndef decode_cyclic(s):\n    return s\n",
    50: "def encode_shift(s):\n    return s\n\ndef decode_shift(s):\n    return s\n",
}


def fenced(code: str) -> str:
    return f"Here is the function.\n\n```python\n{code}```\n"


def cases() -> list[tuple[str, str, int, str, float]]:
    """(case, reward name, uid, response, expected reward) for every check."""
    rows, out = read_humaneval(), []
    for uid, row in enumerate(rows):
        _, _, function = split_prompt(row["prompt"], row["entry_point"])
        for reward in ("humaneval", "python_tests"):
            out.append(("canonical", reward, uid, fenced(row["prompt"] + row["canonical_solution"]), 1.0))
            out.append(("bare", reward, uid, fenced(function + row["canonical_solution"]),
                        1.0 if reward == "humaneval" else -1.0))  # -1: counted, not required
        out.append(("pass", "humaneval", uid, fenced(row["prompt"] + "    pass\n"), 0.0))
        out.append(("return None", "humaneval", uid, fenced(row["prompt"] + "    return None\n"), 0.0))
    for uid, code in HELPER_HACKS.items():
        out.append(("helper hack", "humaneval", uid, fenced(code), 0.0))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="sandbox runs at a time")
    args = ap.parse_args()
    problems = load_humaneval()
    rewards = {"humaneval": humaneval_reward, "python_tests": python_tests_problem_reward}
    todo = cases()
    start = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as ex:
        got = list(ex.map(lambda c: rewards[c[1]](problems[c[2]], c[3]), todo))
    seconds = time.perf_counter() - start
    failures = 0
    summary: dict[tuple[str, str], list[int]] = {}
    for (case, reward, uid, _, want), value in zip(todo, got):
        s = summary.setdefault((case, reward), [0, 0, []])
        s[0] += value == 1.0
        s[1] += 1
        if want >= 0 and value != want:
            s[2].append(uid)
            failures += 1
    print(f"{len(todo)} sandbox runs in {seconds:.1f} s ({args.workers} workers)")
    for (case, reward), (passed, total, bad) in summary.items():
        print(f"  {case:12s} {reward:13s} scored 1.0: {passed:3d} / {total:3d}"
              + (f"   UNEXPECTED for uids {bad}" if bad else ""))
    print("all as expected" if failures == 0 else f"{failures} unexpected results")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
