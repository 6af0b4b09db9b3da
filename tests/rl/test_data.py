import json

import pytest

from megarl.rl.data import exact_answer_reward, extract_answer, load_jsonl_prompts
from megarl.rl.task import Problem
from megarl.rl.tokenizer import CharTokenizer


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_ok(tmp_path):
    f = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": "1+2=", "answer": "3", "extra": 1}), "",
                                      json.dumps({"prompt": "4+5=", "answer": "9"})])
    probs = load_jsonl_prompts(f, CharTokenizer())
    assert probs == [Problem(0, "1+2=", "3"), Problem(2, "4+5=", "9")]


@pytest.mark.parametrize("lines, match", [
    (['{"prompt": "1+2=", "answer": "3"}', '{"prompt": "1+2="'], r"d\.jsonl:2: malformed JSON"),
    (['{"answer": "3"}'], r"d\.jsonl:1: missing field 'prompt'"),
    (['{"prompt": "1+2="}'], r"d\.jsonl:1: missing field 'answer'"),
    (['{"prompt": "1+2=", "answer": 3}'], r"d\.jsonl:1: field 'answer' must be a string"),
    (['["1+2=", "3"]'], r"d\.jsonl:1: got a JSON list"),
    (['{"prompt": "what is 1+2?", "answer": "3"}'], r"d\.jsonl:1: prompt cannot be tokenized.*'w'"),
    ([""], "holds no problems"),
])
def test_load_errors(tmp_path, lines, match):
    f = _write(tmp_path / "d.jsonl", lines)
    with pytest.raises(ValueError, match=match) as e:
        load_jsonl_prompts(f, CharTokenizer())
    assert "expected" in str(e.value) or "tokenized" in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="nope.jsonl.*does not exist"):
        load_jsonl_prompts(tmp_path / "nope.jsonl")


def test_exact_answer_reward():
    p = Problem(0, "q", "59")
    assert extract_answer("12+7=19;19+40=59;#59") == "59"
    assert extract_answer("some working\nThe answer is\n 59.\n\n") == "59"
    assert exact_answer_reward(p, "x#59") == 1.0
    assert exact_answer_reward(p, "working\n59.0") == 1.0  # numeric match
    assert exact_answer_reward(p, "working\n58") == 0.0
    assert exact_answer_reward(p, "") == 0.0
    assert exact_answer_reward(Problem(0, "q", "Paris"), "thinking\nParis") == 1.0
