"""Length-aware placement: every prompt placed once, balanced by predicted work, deterministic.
The simulator (megarl/sim/step.py) places with the same ``lpt`` / ``round_robin``."""
import numpy as np
import pytest

from megarl.sched.placement import LengthHistory, lpt, place, round_robin


def work(assign, uids, hist):
    return [sum(hist.predict(uids[j]) for j in idx) for idx in assign]


def test_round_robin_deals_in_order():
    assert place([5, 6, 7, 8, 9], 2, "round_robin") == [[0, 2, 4], [1, 3]]


def test_length_placement_balances_predicted_work():
    hist = LengthHistory()
    uids = list(range(8))
    for uid, n in zip(uids, [100, 10, 90, 10, 10, 10, 10, 10]):  # both long ones even: round robin pairs them
        hist.update(uid, [n - 1, n + 1])  # mean n
    rr = place(uids, 2, "round_robin")
    lp = place(uids, 2, "length", hist)
    assert sorted(j for idx in lp for j in idx) == list(range(8))  # each prompt exactly once
    assert max(work(rr, uids, hist)) == 210 and max(work(lp, uids, hist)) == 130  # of 250: 210/40 vs 130/120
    assert lp == place(uids, 2, "length", hist)  # a pure function of (uids, history)


def test_unseen_prompts_get_the_mean_and_ties_keep_order():
    hist = LengthHistory()
    assert hist.predict(3) == 1.0  # nothing seen: all equal, placement by position
    assert place([1, 2, 3, 4], 2, "length", hist) == [[0, 2], [1, 3]]
    hist.update(1, [10, 30])
    hist.update(2, [40])
    assert hist.predict(1) == 20 and hist.predict(7) == 30  # unseen: mean of the seen prompts


def test_bad_policy():
    with pytest.raises(ValueError, match=r"placement policy 'random' is invalid; valid choices: \['round_robin', 'length'\]"):
        place([1], 1, "random")


def test_length_history_state_round_trips_through_json():
    """The history goes into the run checkpoint's state.json: after a JSON round trip it predicts,
    and so places, exactly as before (seen and unseen prompts)."""
    import json

    from megarl.sched.placement import LengthHistory, place

    h = LengthHistory()
    for uid, lengths in [(3, [10, 13]), (7, [40]), (11, [1, 2, 2])]:
        h.update(uid, lengths)
    back = LengthHistory()
    back.load_state_dict(json.loads(json.dumps(h.state_dict())))
    assert back.last == h.last
    uids = [3, 7, 11, 20, 21]
    assert [back.predict(u) for u in uids] == [h.predict(u) for u in uids]
    assert place(uids, 2, "length", back) == place(uids, 2, "length", h)


@pytest.mark.parametrize("seed", range(20))
def test_lpt_never_worse_than_round_robin(seed):
    """On the simulator's inputs (numpy work, log-normal): the slowest replica's predicted work is
    never above round robin's, and every prompt is placed exactly once."""
    rng = np.random.default_rng(seed)
    work = np.exp(rng.normal(6, 1.2, int(rng.integers(8, 200))))
    replicas = int(rng.integers(2, 9))
    load = lambda a: max(work[x].sum() for x in a)  # noqa: E731
    placed = lpt(work.tolist(), replicas)
    assert load(placed) <= load(round_robin(len(work), replicas)) + 1e-9
    assert sorted(j for idx in placed for j in idx) == list(range(len(work)))
