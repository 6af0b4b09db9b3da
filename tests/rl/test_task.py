import math
import random
import statistics
from collections import Counter

import pytest

from megarl.rl.task import (SEPARATORS, AdditionTask, Problem, TaskConfig, answer_reward, check_working,
                            estimate_entropy, parse_prompt, parse_solution)
from megarl.rl.tokenizer import CharTokenizer


def test_problems_are_deterministic_per_seed_and_uid():
    a, b = AdditionTask(TaskConfig(seed=3)), AdditionTask(TaskConfig(seed=3, num_prompts=7))
    assert len(a) == 512 and len(b) == 7
    assert [a.problem(u) for u in range(7)] == b.problems()  # independent of the set size
    assert a.problem(5) != AdditionTask(TaskConfig(seed=4)).problem(5)
    p = a.problem(11)
    terms = parse_prompt(p.prompt)
    assert p.uid == 11 and p.prompt.endswith("=") and p.answer == str(sum(terms))
    assert 2 <= len(terms) <= 24 and all(1 <= t <= 99 for t in terms)
    assert a.eval_uids(3) == [512, 513, 514]


def test_config_validation():
    with pytest.raises(ValueError, match="min_terms"):
        TaskConfig(min_terms=1)
    with pytest.raises(ValueError, match="max_terms"):
        TaskConfig(min_terms=5, max_terms=4)
    with pytest.raises(ValueError, match="tail_alpha"):
        TaskConfig(tail_alpha=0)
    with pytest.raises(ValueError, match="uid"):
        AdditionTask().problem(-1)


def test_every_solution_is_valid_and_rewarded():
    task, tok, rng = AdditionTask(), CharTokenizer(), random.Random(0)
    seps = Counter()
    for p in task.problems():
        for _ in range(3):
            text = task.solution(p, rng)
            check_working(p, text)  # parses, adds up, uses each value once, ends in the answer
            assert task.reward(p, text) == 1.0
            assert tok.decode(tok.encode(text)) == text
            steps, used, final = parse_solution(text)
            assert final == p.answer and len(steps) == len(parse_prompt(p.prompt)) - 1
            seps.update(used)
    assert set(seps) == set(SEPARATORS)


def test_reward():
    p = Problem(uid=0, prompt="12+7+40=", answer="59")
    assert answer_reward(p, "12+7=19;19+40=59;#59") == 1.0
    assert answer_reward(p, "garbage #59 ") == 1.0  # only the final answer is graded
    assert answer_reward(p, "12+7=19;19+40=58;#58") == 0.0
    assert answer_reward(p, "12+7=19;19+40=59;") == 0.0  # no marker (e.g. truncated)
    assert answer_reward(p, "#59#5") == 0.0  # the last marker counts
    with pytest.raises(ValueError, match="step 1"):
        check_working(p, "12+7=19;19+40=58;#58")
    with pytest.raises(ValueError, match="not pending"):
        check_working(p, "12+12=24;24+35=59;#59")
    with pytest.raises(ValueError, match="malformed step"):
        parse_solution("12+7=19 19+40=59#59")  # no separator after the last step
    with pytest.raises(ValueError, match="addition prompt"):
        parse_prompt("12+7")


def test_lengths_are_heavy_tailed():
    task, rng = AdditionTask(), random.Random(0)
    lengths = [len(task.solution(p, rng)) + 1 for p in task.problems()]  # tokens incl. EOS
    median = statistics.median(lengths)
    assert 15 <= median <= 35
    assert max(lengths) >= 200
    assert max(lengths) >= 6 * median


def test_solution_logprob_is_exact():
    # Duplicated values (5, 5) and a term equal to a partial sum (10 = 5+5) make some texts
    # reachable by several derivations; the exact probabilities must still sum to 1 over the
    # support (3 terms: 12 step sequences x 5^2 separators at most) and match frequencies.
    task, rng = AdditionTask(), random.Random(1)
    p = Problem(uid=0, prompt="5+5+10=", answer="20")
    counts = Counter(task.solution(p, rng) for _ in range(20000))
    probs = {t: math.exp(task.solution_logprob(p, t)) for t in counts}
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-12)
    for t, c in counts.items():
        assert c / 20000 == pytest.approx(probs[t], abs=0.01)
    assert task.solution_logprob(p, "5+5=10;10+10=21;#21") == -math.inf


def test_ideal_policy_entropy():
    est = estimate_entropy(AdditionTask(), range(512), samples_per_prompt=8, seed=0)
    assert est.nats_per_token >= 0.3
    assert est.per_prompt_mean >= 0.2
