"""Bubble work pieces: preemptible generation, partial bubble drafts that stay exact,
drafts shared between replicas, the per-rank timeline and its bubble fraction, the schedule
config, and the idle-priority thread."""
import threading

import pytest
import torch

from megarl.engine import Engine, EngineConfig
from megarl.sched.bubble import BubbleWorker, ScheduleConfig, lower_thread_priority
from megarl.sched.timeline import StepTimeline, bubble_fraction, replica_sum
from megarl.spec.config import SpecConfig
from megarl.spec.speculator import Speculator
from tests.engine.test_engine import engine, key, mixed_requests


def _stop_after(n: int):
    """should_stop that says yes from its (n+1)-th call on; counts the calls."""
    calls = [0]

    def stop() -> bool:
        calls[0] += 1
        return calls[0] > n

    return stop, calls


@pytest.mark.parametrize("n", [0, 1, 3])
def test_preempted_generation_returns_exact_prefixes_and_frees_the_cache(n):
    reqs = mixed_requests(16)
    full = engine(max_batch_size=4).generate(reqs, step=3)
    eng = engine(max_batch_size=4)
    stop, calls = _stop_after(n)
    part = eng.generate(reqs, step=3, should_stop=stop)
    assert eng.stats["forwards"] <= 2 * n  # admit + decode per iteration: nothing ran after the stop
    assert calls[0] == n + 1
    for p, f in zip(part, full):
        assert p.tokens == f.tokens[:len(p.tokens)]  # a prefix of the real sample
        assert p.finish_reason == (f.finish_reason if p.tokens == f.tokens and p.finish_reason != "aborted"
                                   else "aborted")
    assert any(p.finish_reason == "aborted" for p in part)
    assert eng.cache.table.n_free == eng.cache.table.max_slots  # every slot returned
    again = eng.generate(reqs, step=3)  # and the engine still works
    assert [key(r) for r in again] == [key(r) for r in full]


def _spec_engine(model):
    spec = Speculator(SpecConfig(enabled=True, sources=("bubble",), forward_cost_tokens=0))
    return Engine(model, EngineConfig(max_batch_size=4, max_seq_len=64, dtype="float64"), seed=1234, spec=spec)


def test_partial_bubble_drafts_are_used_and_exact():
    """Pre-generation stopped half way keeps the prefixes as coupled drafts; the next step's
    generation accepts them and still gives the tokens of generation without speculation."""
    reqs = mixed_requests(16)
    ref = engine(max_batch_size=4).generate(reqs, step=4)
    sp = _spec_engine(engine(max_batch_size=4).model)
    stop, _ = _stop_after(4)
    pre = sp.pregenerate(reqs, 4, should_stop=stop)
    kept = sp.spec.bubble.drafts(4)
    assert kept and all(kept[(r.uid, r.sample_idx)] == r.tokens for r in pre if r.tokens)
    assert any(r.finish_reason == "aborted" and r.tokens for r in pre)
    out = sp.generate(reqs, step=4)
    assert [key(r) for r in out] == [key(r) for r in ref]
    m = sp.spec.metrics()
    assert m["spec/bubble/accepted"] > 0


def test_merged_drafts_keep_the_longer_prefix():
    sp = _spec_engine(engine().model)
    src = sp.spec.bubble
    src.merge(2, {(1, 0): [5, 6], (1, 1): [7]})
    src.merge(2, {(1, 0): [5], (1, 1): [7, 8, 9], (2, 0): [3]})
    assert src.drafts(2) == {(1, 0): [5, 6], (1, 1): [7, 8, 9], (2, 0): [3]}
    assert src.drafts(3) == {}


def _record(rank, replica, events, end, **kw):
    return {"rank": rank, "replica": replica, "rollout_end": end,
            "events": [{"phase": p, "start": a, "end": b} for p, a, b in events], **kw}


def test_bubble_fraction_counts_idle_and_gaps_in_the_rollout_phase_only():
    recs = [_record(0, 0, [("generate", 0, 4), ("train", 4, 6)], 4.0),
            _record(1, 1, [("generate", 0, 1), ("idle", 1, 4), ("train", 4, 6)], 4.0)]
    assert bubble_fraction(recs) == pytest.approx(3 / 8)
    # bubble work and stream training in the rollout phase are not idle; a gap is
    recs[1]["events"] = [{"phase": "generate", "start": 0, "end": 1}, {"phase": "train", "start": 1, "end": 2},
                         {"phase": "bubble", "start": 2, "end": 3.5}]
    assert bubble_fraction(recs) == pytest.approx(0.5 / 8)
    assert replica_sum([{"replica": 0, "x": 3}, {"replica": 0, "x": 3}, {"replica": 1, "x": 4}], "x") == 7
    # A rank that began the step 1 s late: only its own span of the phase counts
    late = [_record(0, 0, [("generate", 0, 4)], 4.0), _record(1, 1, [("generate", 1, 2)], 4.0, start=1.0)]
    assert bubble_fraction(late) == pytest.approx(2 / 7)


def test_records_are_put_on_one_clock():
    from megarl.sched.timeline import align

    a = {**_record(0, 0, [("generate", 0, 2)], 2.5), "t0_wall": 100.0}
    b = {**_record(1, 1, [("generate", 0, 1)], 2.0), "t0_wall": 100.5}
    out = align([a, b])
    assert [r["start"] for r in out] == [0.0, 0.5]
    assert out[1]["events"] == [{"phase": "generate", "start": 0.5, "end": 1.5}] and out[1]["rollout_end"] == 2.5
    assert all("t0_wall" not in r for r in out)


def test_step_timeline_fills_gaps_around_nested_phases():
    tl = StepTimeline(rank=2, replica=1)
    t = tl.t0
    tl.add("train", t + 0.2, t + 0.3)
    tl.add("train", t + 0.5, t + 0.6)
    tl.fill("generate", t + 0.1, t + 0.8)
    tl.add("bubble", t + 0.8, t + 0.9)
    tl.rollout_end = t + 1.0
    tl.fill("idle", t, t + 1.0)
    rec = tl.record()
    got = [(e["phase"], round(e["start"], 3), round(e["end"], 3)) for e in rec["events"]]
    assert got == [("idle", 0.0, 0.1), ("generate", 0.1, 0.2), ("train", 0.2, 0.3), ("generate", 0.3, 0.5),
                   ("train", 0.5, 0.6), ("generate", 0.6, 0.8), ("bubble", 0.8, 0.9), ("idle", 0.9, 1.0)]
    assert rec["rank"] == 2 and rec["replica"] == 1 and rec["rollout_end"] == pytest.approx(1.0)
    assert bubble_fraction([rec]) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="phase 'nap'"):
        tl.add("nap", t, t + 1)


def test_schedule_config_rejects_unknown_work():
    assert ScheduleConfig(bubble_work=["pregen"]).bubble_work == ("pregen",)
    with pytest.raises(ValueError, match="bubble_work.*'drafter'.*valid entries"):
        ScheduleConfig(bubble_work=("drafter",))
    with pytest.raises(ValueError, match="each at most once"):
        ScheduleConfig(bubble_work=("pregen", "pregen"))
    with pytest.raises(ValueError, match="bubble_priority"):
        ScheduleConfig(bubble_priority="low")


def test_low_priority_thread_runs_the_work_and_raises_its_errors():
    seen = {}

    def work():
        seen["thread"] = threading.current_thread().name
        seen["sum"] = float(torch.ones(3).sum())
        return {"done": 1}

    assert BubbleWorker(work, low_priority=True, flush_denormal=True).join() == {"done": 1}
    assert seen == {"thread": "megarl-bubble", "sum": 3.0}
    assert threading.current_thread() is threading.main_thread()

    def bad():
        raise RuntimeError("bubble failed")

    with pytest.raises(RuntimeError, match="bubble failed"):
        BubbleWorker(bad, low_priority=True).join()
    assert BubbleWorker(lambda: {"x": 2}, low_priority=False).join() == {"x": 2}


def test_lower_thread_priority_only_touches_the_calling_thread():
    import os

    out = {}
    t = threading.Thread(target=lambda: out.setdefault("how", lower_thread_priority()))
    t.start()
    t.join()
    assert out["how"] in ("SCHED_IDLE", "nice 19") or out["how"].startswith("unchanged")
    if hasattr(os, "sched_getscheduler"):
        assert os.sched_getscheduler(0) != getattr(os, "SCHED_IDLE", -1)  # the main thread keeps its class


def test_autogroup_nice_is_lowered_for_the_bubble_and_restored():
    """torchrun puts each worker in its own session, hence its own autogroup, where thread
    policies do not count against the other processes: the group's nice value does."""
    from megarl.sched.bubble import AutogroupNice

    if not AutogroupNice.available():
        pytest.skip("no /proc/self/autogroup, or its nice value cannot be restored here")
    before = AutogroupNice._read()
    with AutogroupNice() as lowered:
        assert lowered and AutogroupNice._read() == 19
    assert AutogroupNice._read() == before


def test_join_gives_the_unit_in_flight_normal_priority_back():
    """Once the step waits on the bubble work, the unit in flight is on the critical path: join()
    moves the thread out of the idle class (and the autogroup back to its nice value) before
    waiting, so a busy machine cannot starve it."""
    import os

    from megarl.sched.bubble import AutogroupNice, BubbleWorker

    if not hasattr(os, "SCHED_IDLE"):
        pytest.skip("no SCHED_IDLE on this OS")
    started, go, seen = threading.Event(), threading.Event(), {}
    before = AutogroupNice._read()

    def unit():
        started.set()
        go.wait(30)  # released only once the caller is in join()
        seen["policy"], seen["group"] = os.sched_getscheduler(0), AutogroupNice._read()
        return {}

    worker = BubbleWorker(unit, low_priority=True)
    assert started.wait(30)
    if os.sched_getscheduler(worker._tid) != os.SCHED_IDLE:
        go.set()
        worker.join()
        pytest.skip("the bubble thread could not be moved to SCHED_IDLE here")
    threading.Timer(0.2, go.set).start()
    worker.join()
    assert seen["policy"] == os.SCHED_OTHER
    assert seen["group"] == before  # (restored, or never lowered where it cannot be restored)
