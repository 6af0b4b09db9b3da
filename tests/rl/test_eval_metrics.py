"""The held-out evaluation's figures (megarl/rl/eval_metrics.py): pass@k is the unbiased estimator."""
import itertools

import pytest

from megarl.rl.eval_metrics import eval_metrics, ks_for, pass_at_k


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_correct_one(n):
    # Chen et al. 2021: the estimator is exactly the fraction of k-subsets of the n samples with a correct one.
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-15)


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == 0.5  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


def test_ks_for():
    assert ks_for(1) == [1]
    assert ks_for(4) == [1, 2, 4]
    assert ks_for(6) == [1, 2, 4, 6]


def test_eval_metrics_by_hand():
    # two prompts of 4 samples: 1 and 2 correct; one response cut at the token limit; a partial reward
    m = eval_metrics([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0]], [[3, 4, 5, 6], [2, 2, 10, 1]],
                     [[False] * 4, [False, False, True, False]], threshold=1.0)
    assert m == {
        "eval/prompts": 2.0, "eval/samples": 4.0, "eval/reward_mean": 3.5 / 8,
        "eval/pass_at_1": (0.25 + 0.5) / 2, "eval/pass_at_2": (0.5 + 5 / 6) / 2, "eval/pass_at_4": 1.0,
        "eval/response_len_mean": 33 / 8, "eval/response_len_max": 10.0, "eval/truncated_frac": 1 / 8,
    }
    assert eval_metrics([[0.5]], [[1]], [[False]], threshold=0.5)["eval/pass_at_1"] == 1.0


def test_prefix_and_progress_line():
    from megarl.rl.eval_metrics import eval_line

    m = eval_metrics([[1.0, 0.0]], [[3, 5]], [[False, True]], 1.0)
    g = eval_metrics([[1.0]], [[3]], [[False]], 1.0, prefix="eval/greedy/")
    assert set(g) == {"eval/greedy/" + k.removeprefix("eval/") for k in m if k != "eval/pass_at_2"}
    assert eval_line("step 4", {**m, **g}) == (
        "eval step 4: 1 held-out prompts x 2: reward 0.500, pass@1 0.500, pass@2 1.000, length 4.0 (max 5), "
        "truncated 50.0%; greedy: reward 1.000")
