"""Prompt datasets from JSONL files, and the outcome reward used with them.

File format: one JSON object per line with string fields ``prompt`` and ``answer`` (other
fields are ignored); blank lines are skipped but still counted, so a problem's ``uid`` is its
0-based line index and stays stable when the file is edited below it. Problems of the synthetic
task written out as JSONL (``{"prompt": "12+7=", "answer": "19"}``) load with ``CharTokenizer``.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

from megarl.rl.task import ANSWER_MARKER, Problem
from megarl.rl.tokenizer import Tokenizer

_EXPECTED = 'expected one JSON object per line like {"prompt": "12+7=", "answer": "19"}'


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """The order of the ``n`` prompts in epoch ``epoch`` of a run with seed ``seed``: a pure
    function of them, so every process, a resumed run and a rank that works ahead agree."""
    order = list(range(n))
    random.Random(f"megarl-data-{seed}-{epoch}").shuffle(order)
    return order


def load_jsonl_prompts(path: str | os.PathLike, tokenizer: Tokenizer | None = None) -> list[Problem]:
    """Read ``path`` into ``Problem``s (uid = line index). ValueError, naming the file and line,
    for a missing file, a line that is not UTF-8, malformed JSON, a non-object line, a missing or
    non-string ``prompt`` / ``answer``, an empty prompt, a prompt ``tokenizer`` cannot encode, or
    an empty file. With ``tokenizer``, every prompt is encoded once so a bad character fails at
    load time, not mid-rollout."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {str(path)!r} does not exist; {_EXPECTED}")
    problems = []
    with path.open("rb") as f:
        for idx, raw in enumerate(f):
            where = f"{path}:{idx + 1}"
            try:
                line = raw.decode("utf-8-sig" if idx == 0 else "utf-8")  # (a BOM some editors write)
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                 f"save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line, object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno}); {_EXPECTED}") from None
            except _DuplicateKey as e:
                raise ValueError(f"{where}: field {e.args[0]!r} appears more than once in the row (JSON keeps "
                                 f"only the last); give each field once: {_EXPECTED}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: got a JSON {type(row).__name__}, not an object; {_EXPECTED}")
            for field in ("prompt", "answer"):
                if field not in row:
                    raise ValueError(f"{where}: missing field {field!r} (has {sorted(row)}); {_EXPECTED}")
                if not isinstance(row[field], str):
                    raise ValueError(f"{where}: field {field!r} must be a string, got {row[field]!r}; {_EXPECTED}")
            if not row["prompt"].strip():
                raise ValueError(f"{where}: field 'prompt' is empty; every prompt needs text for the policy to answer")
            if tokenizer is not None:
                try:
                    tokenizer.encode(row["prompt"])
                except Exception as e:  # noqa: BLE001 - HF tokenizers raise plain Exceptions
                    if not isinstance(e, ValueError) and type(e) is not Exception:
                        raise
                    raise ValueError(f"{where}: prompt cannot be tokenized: {' '.join(str(e).split())}"
                                     f"{_first_bad_char(tokenizer, row['prompt'])}; valid: text the tokenizer "
                                     f"({getattr(tokenizer, 'path', None) or type(tokenizer).__name__}) "
                                     f"can encode") from None
            problems.append(Problem(uid=idx, prompt=row["prompt"], answer=row["answer"]))
    if not problems:
        raise ValueError(f"prompt file {str(path)!r} holds no problems; {_EXPECTED}")
    return problems


class _DuplicateKey(Exception):
    """A JSON object with a key twice (``json`` would silently keep the last value)."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _first_bad_char(tokenizer, text: str) -> str:
    """`` (the character 'é' at column 5)``: the first character that fails to encode alone, or
    ``""`` (called on a failure only)."""
    for col, ch in enumerate(text, 1):
        try:
            tokenizer.encode(ch)
        except Exception:  # noqa: BLE001 - any failure marks the character
            return f" (the character {ch!r} at column {col})"
    return ""


def extract_answer(response_text: str) -> str:
    """The final answer of a response: the text after the last answer marker ``#`` if there is
    one, else the last non-empty line; whitespace and one trailing '.' stripped."""
    if ANSWER_MARKER in response_text:
        ans = response_text.rsplit(ANSWER_MARKER, 1)[1]
    else:
        lines = [ln for ln in response_text.splitlines() if ln.strip()]
        ans = lines[-1] if lines else ""
    ans = ans.strip()
    return ans[:-1].rstrip() if ans.endswith(".") else ans


def exact_answer_reward(problem: Problem, response_text: str) -> float:
    """1.0 if ``extract_answer(response_text)`` equals ``problem.answer`` (stripped), else 0.0.
    Numbers also match by value when both sides parse as numbers ("59" vs "59.0"), so a dataset's
    formatting of its answers does not decide the reward."""
    got, want = extract_answer(response_text), problem.answer.strip()
    if got == want:
        return 1.0
    try:
        return 1.0 if got and float(got) == float(want) else 0.0
    except ValueError:
        return 0.0
