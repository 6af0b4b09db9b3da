"""The RL loop's data order (megarl/sched/prompts.py): a pure function of (seed, step)."""
from megarl.rl.data import epoch_order
from megarl.sched.prompts import prompt_uids_for_step


def test_epoch_order_is_a_seeded_permutation():
    o0, o1 = epoch_order(3, 0, 50), epoch_order(3, 1, 50)
    assert sorted(o0) == list(range(50)) and sorted(o1) == list(range(50))
    assert o0 == epoch_order(3, 0, 50) and o0 != o1 and o0 != epoch_order(4, 0, 50)


def test_steps_walk_each_epoch_without_repeats():
    seen = [u for step in range(5) for u in prompt_uids_for_step(step, 8, 3, 20)]  # 40 = 2 epochs
    assert seen[:20] == epoch_order(3, 0, 20) and seen[20:] == epoch_order(3, 1, 20)
