import re

import pytest

from megarl.rl.reasoning_gym_data import (ReasoningGymConfig, ReasoningGymReward, extract_tagged_answer,
                                          load_reasoning_gym)
from megarl.rl.reward_pool import RewardPool
from megarl.rl.task import Problem

TASKS = ["basic_arithmetic", "chain_sum", "leg_counting", "count_bits", "letter_counting", "simple_equations",
         "gsm_symbolic", "number_sorting", "spell_backward", "word_sorting"]


def _load(**kw):
    kw = {"tasks": ["basic_arithmetic", "chain_sum"], "size": 8, "seed": 3, **kw}
    return load_reasoning_gym(ReasoningGymConfig(**kw))


def test_uids_are_stable_contiguous_and_laid_out_per_task():
    a, _ = _load()
    b, _ = _load()
    assert a == b
    assert [p.uid for p in a] == list(range(16))
    # uid = task_index * size + row_index: the second task's rows are that task loaded alone
    alone, _ = _load(tasks=["chain_sum"])
    assert [p.prompt for p in a[8:]] == [p.prompt for p in alone]
    assert all(p.prompt.endswith(ReasoningGymConfig().instruction) and "<answer>" in p.prompt for p in a)


def test_seed_decides_the_problems():
    same, _ = _load(seed=3)
    other, _ = _load(seed=4)
    assert [p.prompt for p in same] == [p.prompt for p in _load(seed=3)[0]]
    assert sum(p.prompt != q.prompt for p, q in zip(same, other)) >= 12


def test_unknown_task_names_it_and_close_matches():
    with pytest.raises(ValueError, match=r"unknown reasoning_gym task 'basic_arithmatic'.*'basic_arithmetic'"):
        _load(tasks=["basic_arithmatic"])


@pytest.mark.parametrize("task_config, match", [
    ({"basic_arithmetic": {"min_term": 2}}, r"\['basic_arithmetic'\] has unknown option 'min_term'.*'min_terms'"),
    ({"basic_arithmetic": {"min_terms": 0}}, r"\['basic_arithmetic'\]: option\(s\) \['min_terms'\] rejected"),
    ({"basic_arithmetic": {"min_terms": 5, "max_terms": 3}}, r"combination of options \['max_terms', 'min_terms'\]"),
])
def test_bad_task_options_name_task_and_key(task_config, match):
    with pytest.raises(ValueError, match=match):
        _load(task_config=task_config)


def test_task_options_are_applied():
    def terms(problems):
        return [len(re.findall(r"\d+", p.prompt.split("=")[0])) for p in problems]

    default, _ = _load(tasks="chain_sum", size=16)
    two, _ = _load(tasks="chain_sum", size=16, task_config={"chain_sum": {"min_terms": 2, "max_terms": 2}})
    assert terms(two) == [2] * 16 and max(terms(default)) > 2


@pytest.mark.parametrize("kw, match", [
    ({"tasks": []}, r"tasks=\[\] is invalid"),
    ({"tasks": ["chain_sum", "chain_sum"]}, "more than once"),
    ({"size": 0}, r"size=0 is invalid; valid range: an integer >= 1"),
    ({"seed": -1}, r"seed=-1 is invalid; valid range: an integer >= 0"),
    ({"task_config": {"leg_counting": {}}}, r"names 'leg_counting', which is not in tasks"),
    ({"task_config": {"chain_sum": {"seed": 1}}}, r"sets 'seed'"),
    ({"instruction": "Answer briefly."}, r"<answer></answer>"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        ReasoningGymConfig(**{"tasks": ["chain_sum"], **kw})


def test_single_task_string_is_accepted():
    assert ReasoningGymConfig(tasks="chain_sum").tasks == ["chain_sum"]


def test_extract_tagged_answer():
    assert extract_tagged_answer("so <answer> 42 \n</answer>") == "42"
    assert extract_tagged_answer("<answer>1</answer> no, <answer>2</answer> done") == "2"
    assert extract_tagged_answer("<answer>1</answer> then <answer>2") == "1"       # last COMPLETE pair
    assert extract_tagged_answer("<answer>a <answer>b</answer>") == "b"
    assert extract_tagged_answer("the answer is 42") is None
    assert extract_tagged_answer("<answer>42") is None
    assert extract_tagged_answer("42</answer>") is None
    assert extract_tagged_answer("<x>7</x>", tag="x") == "7"


def test_reference_answers_score_one_on_every_listed_task():
    problems, reward = load_reasoning_gym(ReasoningGymConfig(tasks=TASKS, size=4, seed=0))
    assert len(problems) == 40
    for p in problems:
        assert reward(p, f"Let me think.\n<answer>{p.answer}</answer>") == 1.0, p
        assert reward(p, p.answer) == 0.0                       # no tags: no answer
        assert reward(p, f"<answer>{p.answer}") == 0.0          # cut before the closing tag
        assert reward(p, "<answer></answer>") == 0.0


def test_wrong_answers_score_zero_and_last_tag_wins():
    problems, reward = _load()
    for p in problems:
        wrong = str(int(p.answer) + 1)
        assert reward(p, f"<answer>{wrong}</answer>") == 0.0
        assert reward(p, f"<answer>{wrong}</answer> wait: <answer>{p.answer}</answer>") == 1.0
        assert reward(p, f"<answer>{p.answer}</answer> wait: <answer>{wrong}</answer>") == 0.0


def test_binary_turns_partial_credit_into_zero():
    cfg = dict(tasks=["gsm_symbolic", "basic_arithmetic"], size=3, seed=0)
    problems, binary = load_reasoning_gym(ReasoningGymConfig(**cfg))
    _, raw = load_reasoning_gym(ReasoningGymConfig(**cfg, binary=False))
    gsm, arith = problems[0], problems[3]
    # gsm_symbolic gives 0.01 to any wrong number
    wrong = f"<answer>{int(gsm.answer) + 1}</answer>"
    assert raw(gsm, wrong) == 0.01 and binary(gsm, wrong) == 0.0
    # the default scorer gives len(ref)/len(answer) to an answer that contains the reference
    padded = f"<answer>1{arith.answer}</answer>"
    assert 0.5 < raw(arith, padded) < 1.0 and binary(arith, padded) == 0.0
    assert raw(arith, f"<answer>{arith.answer}</answer>") == binary(arith, f"<answer>{arith.answer}</answer>") == 1.0


def test_scorer_error_scores_zero_and_is_counted():
    class Broken:
        def score_answer(self, answer, entry):
            raise KeyError("metadata")

    reward = ReasoningGymReward({0: ("broken", Broken(), {})})
    assert reward(Problem(0, "q", "a"), "<answer>a</answer>") == 0.0
    assert reward.scorer_errors == {"broken": 1}
    with pytest.raises(ValueError, match="uid 5 is not one of the 1 problems"):
        reward(Problem(5, "q", "a"), "<answer>a</answer>")


def test_reward_runs_in_the_pool():
    problems, reward = _load()
    with RewardPool(2) as pool:
        futures = [pool.submit(reward, p, f"<answer>{p.answer}</answer>") for p in problems]
        assert [f.result() for f in futures] == [1.0] * len(problems)
        assert pool.stats()["error_total"] == 0
