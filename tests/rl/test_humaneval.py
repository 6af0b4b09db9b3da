import pytest

from megarl.rl.humaneval import (INSTRUCTION, NUM_PROBLEMS, humaneval_reward, load_humaneval, read_humaneval,
                                 split_prompt, with_imports)
from megarl.rl.reward_pool import is_sandboxed, python_tests_reward
from megarl.rl.rewards import python_tests_problem_reward

# typing imports (0, 12), a helper using an import (32), a helper the tests call (38), an import
# inside the function (115), hashlib (162)
SUBSET = [0, 12, 32, 38, 115, 162]


@pytest.fixture(scope="module")
def data():
    return read_humaneval(), load_humaneval()


def _fenced(code: str) -> str:
    return f"Sure.\n```python\n{code}```\nDone."


def test_load(data):
    rows, problems = data
    assert len(problems) == NUM_PROBLEMS == len(rows)
    assert [p.uid for p in problems] == list(range(NUM_PROBLEMS))
    assert load_humaneval(limit=5) == problems[:5]
    for p, row in zip(problems, rows):
        assert p.prompt.startswith(INSTRUCTION) and row["prompt"].strip("\n") in p.prompt
        assert p.answer.rstrip().endswith(f"check({row['entry_point']})")
    assert is_sandboxed(humaneval_reward)


@pytest.mark.parametrize("limit", [0, 165, 2.0, True])
def test_bad_limit(limit):
    with pytest.raises(ValueError, match=r"limit=.* is invalid; valid: None \(all\) or an integer in 1..164"):
        load_humaneval(limit)


@pytest.mark.parametrize("uid", SUBSET)
def test_canonical_passes_and_wrong_bodies_fail(data, uid):
    rows, problems = data
    row, p = rows[uid], problems[uid]
    canonical = _fenced(row["prompt"] + row["canonical_solution"])
    assert humaneval_reward(p, canonical) == 1.0
    assert python_tests_problem_reward(p, canonical) == 1.0
    assert humaneval_reward(p, _fenced(row["prompt"] + "    pass\n")) == 0.0
    assert humaneval_reward(p, _fenced(row["prompt"] + "    return None\n")) == 0.0
    assert humaneval_reward(p, "no code here, just words") == 0.0


def test_function_without_prompt_imports_passes(data):
    """A correct answer that omits ``from typing import List`` fails at ``def`` time (annotations)
    unless the prompt's imports are put in front of it, which humaneval_reward does."""
    rows, problems = data
    row, p = rows[0], problems[0]
    _, imports, function = split_prompt(row["prompt"], row["entry_point"])
    assert imports == ["from typing import List"] and function.startswith("def has_close_elements(numbers: List")
    bare = _fenced(function + row["canonical_solution"])
    assert humaneval_reward(p, bare) == 1.0
    assert python_tests_problem_reward(p, bare) == 0.0


def test_helpers_are_restored_after_the_answer(data):
    """find_zero is judged through poly and decode_cyclic through encode_cyclic: redefining the
    helper must not pass, as it would if the tests did not restore the prompt's helpers."""
    rows, problems = data
    hack_32 = "def poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return 0.0\n"
    hack_38 = "def encode_cyclic(s):\n    return s\n\ndef decode_cyclic(s):\n    return s\n"
    for uid, hack in ((32, hack_32), (38, hack_38)):
        raw_tests = f"{rows[uid]['test']}\ncheck({rows[uid]['entry_point']})\n"
        assert python_tests_reward(_fenced(hack), raw_tests) == 1.0          # the hack is real
        assert humaneval_reward(problems[uid], _fenced(hack)) == 0.0
    # and a bare function that relies on the prompt's helper still passes
    bare_38 = "def decode_cyclic(s: str):\n    return encode_cyclic(encode_cyclic(s))\n"
    assert humaneval_reward(problems[38], _fenced(bare_38)) == 1.0


def test_future_import_stays_first():
    program = "from __future__ import annotations\nx: List[int] = []\n"
    out = with_imports(program, ["from typing import List"])
    assert out.splitlines()[:2] == ["from __future__ import annotations", "from typing import List"]
    compile(out, "main.py", "exec")
    assert with_imports("print(1)\n", []) == "print(1)\n"


def test_future_import_answer_passes(data):
    rows, problems = data
    row = rows[12]
    _, _, function = split_prompt(row["prompt"], row["entry_point"])
    answer = _fenced("from __future__ import annotations\n\n" + function + row["canonical_solution"])
    assert humaneval_reward(problems[12], answer) == 1.0
