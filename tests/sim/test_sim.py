"""The cluster simulator (megarl/sim): distributions, the event model, the CLI."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megarl.cli import main
from megarl.sim.hardware import QWEN25_7B, LinearProfile, h100
from megarl.sim.lengths import PRESETS, ReplayLengths, StepLengths, draw, stats
from megarl.sim.rollout import run_rollout
from megarl.sim.run import parse_sweep
from megarl.sim.share import run_phase
from megarl.sim.spec import SpecModel, tokens_per_forward
from megarl.sim.step import CarryOver, StepKnobs, simulate_step, tail_share

# One second per engine iteration, nothing else: times count iterations.
UNIT = {"decode_a": 1.0, "decode_b": 0.0, "decode_c": 0.0, "prefill_a": 0.0, "prefill_b": 0.0, "overhead_per_response": 0.0,
            "cores": None, "bubble_interference": 1.0}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_preset_a_statistics(seed):
    p = PRESETS["A"]
    d = draw(p, p.prompts, np.random.default_rng(seed))
    s = stats(d.lengths)
    assert d.lengths.shape == (128, 8)
    assert 500 <= s["median"] <= 700
    assert 750 <= s["p75"] <= 1100
    assert 25 <= s["max_over_median"] <= 32
    assert s["max"] <= p.max_len


def test_preset_a_runaway_share():
    p = PRESETS["A"]
    d = draw(p, 20000, np.random.default_rng(5))
    runaway = (d.lengths >= p.runaway_low * p.max_len).any(axis=1).mean()
    assert 0.03 <= runaway <= 0.05


def test_preset_b_mean():
    p = PRESETS["B"]
    means = [draw(p, p.prompts, np.random.default_rng(s)).lengths.mean() for s in range(4)]
    assert 19000 <= np.mean(means) <= 25000


def test_baseline_step_is_rollout_plus_train_plus_sync():
    """Hand-computed: 1 replica, 1 s per iteration; train costs 1 s per micro-batch + 0.01 s per
    padded token (forward and fwd+bwd alike), optimizer 0.5 s, sync 0.25 s."""
    prof = LinearProfile(**UNIT, fwd_a=1.0, fwd_b=0.01, fwdbwd_a=1.0, fwdbwd_b=0.01, micro_batch=2,
                         finish_a=0.5, sync=0.25)
    sl = StepLengths(np.array([[3, 7]]), np.array([5]), np.array([5.0]))
    res, _ = simulate_step(sl, frozenset(), prof, StepKnobs(group=2), SpecModel(), 1, CarryOver(),
                           np.random.default_rng(0))
    assert res.rollout_s == pytest.approx(7.0)  # the longest response: 7 iterations
    # One micro-batch of 2 rows padded to 12 tokens: (1 + 0.24) forward + (1 + 0.24) fwd+bwd.
    assert res.train_s == pytest.approx(2 * 1.24 + 0.5)
    assert res.sync_s == pytest.approx(0.25)
    assert res.step_time_s == pytest.approx(7.0 + 2.98 + 0.25)


def test_single_rank_without_features_has_no_bubble():
    p = PRESETS["A"]
    sl = draw(p, 8, np.random.default_rng(0))
    res, _ = simulate_step(sl, frozenset(), h100(), StepKnobs(), SpecModel(), 1, CarryOver(), np.random.default_rng(0))
    assert res.bubble_frac == pytest.approx(0.0, abs=1e-12)
    res4, _ = simulate_step(sl, frozenset(), h100(), StepKnobs(), SpecModel(), 4, CarryOver(),
                            np.random.default_rng(0))
    assert res4.bubble_frac > 0.0  # and replicas that wait do show it


def test_speculation_cuts_decode_steps():
    prof = LinearProfile(**UNIT)
    lens = np.array([[100]])
    plain = run_rollout(lens, 0, prof, group=1, max_batch=1)
    assert plain.iterations[0] == 100
    # Acceptance length 4 (fixed: 4 tokens per forward) -> 25 forwards.
    fixed = run_rollout(lens, 0, prof, group=1, max_batch=1, fixed_tau=4.0, fixed_draft=3.0)
    assert fixed.iterations[0] == 25 and fixed.end[0] == pytest.approx(25.0)
    # Adaptive: rows are free here, so the longest draft (k=8) wins; alpha=0.5 gives
    # tau = (1 - 0.5^9) / 0.5 tokens per forward.
    tau = tokens_per_forward(0.5, 8)
    assert tau == pytest.approx((1 - 0.5 ** 9) / 0.5)
    adaptive = run_rollout(lens, 0, prof, group=1, max_batch=1, alpha_rest=np.array([[0.5]]),
                           k_choices=(0, 1, 2, 4, 8))
    assert adaptive.iterations[0] == math.ceil(100 / tau)
    # ... and above spec_max_batch speculation is off.
    off = run_rollout(lens, 0, prof, group=1, max_batch=1, alpha_rest=np.array([[0.5]]), k_choices=(0, 8),
                      spec_max_batch=0)
    assert off.iterations[0] == 100


def test_speculation_host_work_is_charged_per_running_request():
    # spec_request: drafting per running request per speculative iteration; spec_row: per draft token.
    prof = LinearProfile(**{**UNIT, "spec_request": 0.5, "spec_row": 0.25})
    lens = np.array([[2, 4]])
    plain = run_rollout(lens, 0, prof, group=2, max_batch=2)
    spec = run_rollout(lens, 0, prof, group=2, max_batch=2, fixed_tau=1.0, fixed_draft=0.0)
    assert plain.end[0] == pytest.approx(4.0)  # not speculating: no drafting
    assert spec.end[0] == pytest.approx(2 * (1 + 0.5 * 2) + 2 * (1 + 0.5 * 1))
    # Two draft rows per request per iteration, each accepted: 3 tokens per forward.
    drafts = run_rollout(np.array([[3, 6]]), 0, prof, group=2, max_batch=2, fixed_tau=3.0, fixed_draft=2.0)
    assert drafts.end[0] == pytest.approx(1 * (1 + 0.5 * 2 + 0.25 * 4) + 1 * (1 + 0.5 * 1 + 0.25 * 2))


def test_continuous_batching_admits_into_freed_slots():
    prof = LinearProfile(**UNIT)
    r = run_rollout(np.array([[10, 20, 5, 5]]), 0, prof, group=1, max_batch=2)
    # Slots: {10, 20}; at 10 the third starts (ends 15), at 15 the fourth (ends 20).
    assert r.finish[0].tolist() == [10.0, 20.0, 15.0, 20.0]


def test_tail_share_hand_built():
    assert tail_share(np.arange(1.0, 11.0), 10.0) == pytest.approx(0.1)
    f = np.array([1.0] * 18 + [10.0, 10.0])
    assert tail_share(f, 10.0) == pytest.approx(0.9)
    assert tail_share(np.array([2.0, np.nan, 4.0]), 4.0) == pytest.approx(0.0)  # NaN: aborted, ignored


def test_processor_sharing_on_two_cores():
    prof = LinearProfile(cores=2.0, slowdown={"1": 1.0, "2": 1.0}, bubble_interference=1.0)
    ph = run_phase(np.array([1.0, 1.0, 1.0, 1.0]), np.zeros(4), prof)
    assert ph.barrier == pytest.approx(2.0)  # four jobs on two cores: twice as long
    # Idle-priority work gets no CPU while two normal processes still run.
    ph = run_phase(np.array([1.0, 3.0, 3.0]), np.array([np.inf, 0, 0]), prof)
    # 3 busy on 2 cores until t=1.5 (process 0 done), then 2 on 2: the rest 2 s -> 3.5.
    assert ph.normal_end[0] == pytest.approx(1.5) and ph.barrier == pytest.approx(3.5)
    assert ph.idle_done[0] == pytest.approx(0.0) and ph.idle_busy[0] == pytest.approx(2.0)


def test_time_sharing_past_the_cores_costs_the_measured_slowdown():
    # slowdown["4"] = 1.5: four processes on two cores take 2 (the split) x 1.5; three interpolate.
    prof = LinearProfile(cores=2.0, slowdown={"1": 1.0, "2": 1.0, "4": 1.5}, bubble_interference=1.0)
    assert run_phase(np.ones(4), np.zeros(4), prof).barrier == pytest.approx(3.0)
    assert run_phase(np.ones(3), np.zeros(3), prof).barrier == pytest.approx(1.5 * 1.25)
    assert run_phase(np.ones(2), np.zeros(2), prof).barrier == pytest.approx(1.0)


def test_training_contends_by_its_own_measured_slowdown():
    # Two trainers side by side: train_slowdown["2"] = 1.25 for forward/backward work, decoding keeps
    # slowdown["2"] = 1.0; without train_slowdown, training falls back to slowdown.
    prof = LinearProfile(cores=2.0, slowdown={"1": 1.0, "2": 1.0}, train_slowdown={"1": 1.0, "2": 1.25},
                         bubble_interference=1.0)
    assert run_phase(np.ones(2), np.zeros(2), prof, work="train").barrier == pytest.approx(1.25)
    assert run_phase(np.ones(2), np.zeros(2), prof).barrier == pytest.approx(1.0)
    assert prof.speed(2, "train") == pytest.approx(0.8) and prof.speed(2) == pytest.approx(1.0)
    plain = LinearProfile(cores=2.0, slowdown={"1": 1.0, "2": 1.1}, bubble_interference=1.0)
    assert run_phase(np.ones(2), np.zeros(2), plain, work="train").barrier == pytest.approx(1.1)


def test_bubble_interference_by_kind_of_work():
    # Two generating processes (2 s of work) on two cores, two more with idle-priority bubble work:
    # stream training slows the generating ones 1.5x, pre-generation 1.1x.
    prof = LinearProfile(cores=2.0, slowdown={"1": 1.0, "2": 1.0},
                         bubble_interference={"stream_train": 1.5, "pregen": 1.1})
    normal = np.array([2.0, 2.0, 0.0, 0.0])
    train = run_phase(normal, [("stream_train", np.array([0, 0, 1.0, 1.0])), ("pregen", np.zeros(4))], prof)
    pregen = run_phase(normal, [("stream_train", np.zeros(4)), ("pregen", np.array([0, 0, np.inf, np.inf]))], prof)
    assert train.barrier == pytest.approx(3.0) and pregen.barrier == pytest.approx(2.2)
    assert (train.idle_done == 0).all()  # no free core: the idle work got nothing done
    # One generating process: the free core runs the bubble work (1 s of training, then
    # pre-generation), and the generating one is slowed only while each kind is pending.
    ph = run_phase(np.array([3.0, 0.0]), [("stream_train", np.array([0, 1.0])), ("pregen", np.array([0, np.inf]))],
                   prof)
    assert ph.wall_at(0, np.array([1.0 / 1.5]))[0] == pytest.approx(1.0)  # the training second
    assert ph.barrier == pytest.approx(1.0 + (3.0 - 1.0 / 1.5) * 1.1)
    assert ph.idle_done[1] == pytest.approx(ph.barrier)
    # A plain number is every kind's.
    flat = LinearProfile(cores=2.0, slowdown={"1": 1.0, "2": 1.0}, bubble_interference=1.5)
    assert run_phase(normal, [("pregen", np.array([0, 0, np.inf, np.inf]))], flat).barrier == pytest.approx(3.0)


def test_pregeneration_after_the_rollout_costs_a_rollout_before_training():
    # Bubble drafts not made in the bubbles (one replica, or pregen not in schedule.bubble_work): each
    # replica generates its share again, whole, between the rollout phase and training.
    prof = LinearProfile(**UNIT)
    sl = StepLengths(np.array([[4, 4], [10, 10]]), np.zeros(2, dtype=np.int64), np.array([4.0, 10.0]))
    args = (sl, frozenset({"spec"}), prof)
    kw = dict(fixed_tau=1.0, fixed_draft=0.0)
    plain, _ = simulate_step(*args, StepKnobs(group=2, max_batch=8), SpecModel(), 2, CarryOver(),
                             np.random.default_rng(0), **kw)
    after, carry = simulate_step(*args, StepKnobs(group=2, max_batch=8, pregen_after=True), SpecModel(), 2,
                                 CarryOver(), np.random.default_rng(0), **kw)
    assert after.extra["pregen_after_s"] == pytest.approx(plain.rollout_s)  # the slowest share, again
    assert after.step_time_s == pytest.approx(plain.step_time_s + plain.rollout_s)
    assert after.rollout_s == plain.rollout_s and carry.cover.tolist() == [4.0, 10.0]


def test_tail_batching_short_round_stops_at_quota():
    prof = LinearProfile(**UNIT)
    lens = np.array([[1, 1, 50, 50, 2, 2]])
    r = run_rollout(lens, 0, prof, group=2, max_batch=6, quota=np.array([2]))
    assert r.end[0] == pytest.approx(2.0) and np.isnan(r.finish[0, 2:4]).all()


def test_h100_decode_is_memory_bound_at_small_batch():
    prof = h100()
    t1 = prof.decode_s(1, 1, 0)
    assert t1 == pytest.approx(prof.iter_overhead + QWEN25_7B.weight_bytes / (prof.hbm_bw * prof.bw_eff))
    assert prof.decode_s(8, 32, 0) == pytest.approx(t1)  # 32 verify rows: still free
    assert prof.decode_s(1024, 1024, 0) > 1.5 * t1  # but not a thousand


def test_parse_sweep():
    assert parse_sweep("8,16,...,64") == [8, 16, 32, 64]
    assert parse_sweep("8,64,512") == [8, 64, 512]
    with pytest.raises(ValueError, match="--sweep"):
        parse_sweep("8,...")


def test_replay_lengths_from_timeline(tmp_path):
    path = tmp_path / "timeline.jsonl"
    path.write_text(json.dumps({"step": 1, "response_lengths": [3, 4, 10, 12]}) + "\n")
    rl = ReplayLengths(path, group=2)
    assert rl.step(0).lengths.tolist() == [[3, 4], [10, 12]]
    path.write_text(json.dumps({"step": 1, "response_lengths": [3, 4, 10]}) + "\n")
    with pytest.raises(ValueError, match="group size"):
        ReplayLengths(path, group=2)


def test_cli_writes_required_keys(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--preset", "A", "--gpus", "16", "--steps", "2", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert set(rep) == {"baseline", "megarl", "speedup", "features"}
    keys = {"step_time_s", "rollout_share", "tail_share", "bubble_frac"}
    assert set(rep["baseline"]) == keys and set(rep["megarl"]) == keys
    assert rep["speedup"] == pytest.approx(rep["baseline"]["step_time_s"] / rep["megarl"]["step_time_s"])
    assert "megarl" in rep["features"] and all(v > 0 for v in rep["features"].values())


@pytest.mark.parametrize("argv, flag", [
    (["--preset", "Z"], "--preset"),
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "12", "--gpus-per-replica", "8"], "--gpus-per-replica"),
    (["--profile", "nope"], "--profile"),
    (["--sweep", "8,x"], "--sweep"),
])
def test_cli_bad_input_names_the_flag(tmp_path, capsys, argv, flag):
    out = tmp_path / "sim.json"
    assert main(["simulate", *argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megarl: error:") and flag in err
    assert not out.exists()


def test_replay_rebuilds_tail_rounds_in_admission_order(tmp_path):
    """The replay rebuilds each tail-batching round's started prompts (completed and deferred, in
    the run's order) from the config and the prompts each step completed; a run that does not
    replay (its metrics say another round kind) is refused."""
    from megarl.config import dump_config, load_config
    from megarl.sched.prompts import PromptSchedule
    from benchmarks.sim_replay import _tail_rounds

    cfg = load_config(None, ["task.num_prompts=16", "rollout.prompts_per_step=4", "tail.enabled=true",
                             "tail.overprovision=2.0", "rl_steps=6"])
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    sched, want, steps, metrics = PromptSchedule(cfg.rollout.prompts_per_step, cfg.seed, cfg.rl_steps, cfg.tail, 16), {}, [], {}
    for step in range(1, 7):
        rnd = sched.round(step - 1)
        done = list(rnd.uids) if rnd.long else list(rnd.uids)[1::2][:4]  # a short round keeps 4, defers 4
        want[step] = (list(rnd.uids), rnd.long)
        steps.append((step, done, {u: [5] * 8 for u in done}))
        metrics[step] = {"tail_long_round": float(rnd.long)}
        sched.commit(rnd, done)
    assert any(long for _, long in want.values()) and not all(long for _, long in want.values())
    assert _tail_rounds(tmp_path, steps, metrics, 16) == want
    metrics[1] = {"tail_long_round": 1.0}
    with pytest.raises(ValueError, match="does not replay as the run played it"):
        _tail_rounds(tmp_path, steps, metrics, 16)


def test_replay_runs_deferred_prompts_as_the_stop_left_them(tmp_path):
    """A short round ends when its quota of prompts is complete; its deferred prompts held rows
    until then. Replayed from ``rollouts.jsonl``'s ``deferred`` entries (samples still running at
    the stop never finish first), the round lasts until the kept prompt with the 50-token sample
    is done; the fallback (the lengths a later long round regenerated, here 5) ends it early."""
    from megarl.config import dump_config, load_config
    from megarl.sched.prompts import PromptSchedule
    from benchmarks.sim_replay import replay_run

    cfg = load_config(None, ["task.num_prompts=16", "rollout.prompts_per_step=2", "rollout.group_size=2",
                             "tail.enabled=true", "tail.overprovision=2.0", "rl_steps=2",
                             "rollout.max_new_tokens=200", "stream_train=false"])
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    sched = PromptSchedule(cfg.rollout.prompts_per_step, cfg.seed, cfg.rl_steps, cfg.tail, 16)
    short = sched.round(0)  # 4 prompts started, the first 2 complete kept
    kept, deferred = short.uids[:2], short.uids[2:]
    sched.commit(short, kept)
    long = sched.round(1)
    assert not short.long and long.long and sorted(long.uids) == sorted(deferred)

    def sample(u, i, n, why="stop"):
        return {"uid": u, "sample_idx": i, "tokens": [3] * n, "reward": 0.0, "finish_reason": why}

    step1 = {"step": 1, "samples": [sample(kept[0], 0, 50), sample(kept[0], 1, 20),
                                    sample(kept[1], 0, 10), sample(kept[1], 1, 10)]}
    step2 = {"step": 2, "samples": [sample(u, i, 5) for u in long.uids for i in range(2)]}
    metrics = [{"step": s, "step_time_s": 1.0, "rollout_time_s": 0.5, "train_time_s": 0.5,
                "tail_long_round": float(s == 2), "bubble_frac": 0.0} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    profile = LinearProfile(cores=None)

    def replay(first_line):
        (tmp_path / "rollouts.jsonl").write_text(json.dumps(first_line) + "\n" + json.dumps(step2) + "\n")
        return replay_run(tmp_path, 1, profile)["steps"][0]["pred_gen_s"]

    old = replay(step1)  # a run dumped before the deferred entries existed
    # at the stop (the 50-token sample's end) one deferred prompt had a finished 12-token sample
    step1["deferred"] = [{"uid": deferred[0], "lengths": [12, 50], "finish_reasons": ["stop", "aborted"]},
                         {"uid": deferred[1], "lengths": [50, 50], "finish_reasons": ["aborted", "aborted"]}]
    new = replay(step1)
    assert new >= 50 * profile.decode_a  # at least the 50 iterations of the longest kept sample
    assert old < 12 * profile.decode_a + profile.prefill_a + 1e-9 < new  # the fallback stopped after ~10


def test_replay_speeds_up_each_response_by_its_own_acceptance(tmp_path):
    """A speculative run's responses are replayed at their own tokens per forward (rollouts.jsonl's
    ``forwards``): three short responses covered by bubble drafts (10 tokens a forward) do not make
    the uncovered 100-token one, the critical path, faster. With the step's mean (an older dump
    without ``forwards``) it would take 100 / 1.96 iterations."""
    from megarl.config import dump_config, load_config
    from benchmarks.sim_replay import replay_run

    cfg = load_config(None, ["rollout.prompts_per_step=2", "rollout.group_size=2", "spec.enabled=true",
                             "rl_steps=2", "stream_train=false", "rollout.max_new_tokens=200"])
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    lens, fwds = [100, 40, 40, 40], [100, 4, 4, 4]
    lines = [{"step": s, "samples": [{"uid": 2 * (s - 1) + i // 2, "sample_idx": i % 2, "tokens": [3] * n,
                                      "reward": 0.0, "finish_reason": "stop", "forwards": f}
                                     for i, (n, f) in enumerate(zip(lens, fwds))]} for s in (1, 2)]
    metrics = [{"step": s, "step_time_s": 1.0, "rollout_time_s": 0.5, "train_time_s": 0.5, "bubble_frac": 0.0,
                "rollout_tokens": sum(lens), "target_forwards": sum(fwds), "drafted_tokens": 0} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    profile = LinearProfile(**UNIT)

    def replay():
        (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        return replay_run(tmp_path, 1, profile)["steps"][0]["pred_gen_s"]

    assert replay() == pytest.approx(100.0)  # one iteration per token of the uncovered response
    for line in lines:
        for smp in line["samples"]:
            del smp["forwards"]
    assert replay() == pytest.approx(math.ceil(100 / (220 / 112)))  # the mean: too fast


def test_a_profile_at_another_speed_scales_every_time_and_no_ratio():
    # validate_sim follows the machine's drift with at_speed: a step on a 1.4x slower machine, with every
    # feature on and 4 processes sharing 2 cores (contention and interference are ratios: they stay), takes
    # 1.4x the time. Every field in seconds must be in TIME_FIELDS, or it would not follow.
    from dataclasses import fields

    seconds = {f.name for f in fields(LinearProfile) if f.type in ("float", float)}
    assert seconds == set(LinearProfile.TIME_FIELDS)
    prof = LinearProfile(decode_c=1e-6, spec_request=1e-4, spec_row=2e-5, fwd_c=1e-8, finish_b=1e-3,
                         overhead_per_response=1e-4, slowdown={"1": 1.0, "2": 1.1, "4": 1.4},
                         train_slowdown={"1": 1.0, "2": 1.3}, bubble_interference={"stream_train": 1.2, "pregen": 1.05})
    slow = prof.at_speed(1.4)
    assert slow.slowdown == prof.slowdown and slow.train_slowdown == prof.train_slowdown
    assert slow.bubble_interference == prof.bubble_interference and slow.cores == prof.cores
    assert all(getattr(slow, k) == pytest.approx(1.4 * getattr(prof, k)) for k in LinearProfile.TIME_FIELDS)
    rng = np.random.default_rng(3)
    lens = rng.integers(5, 60, (8, 4))
    sl = StepLengths(lens, np.full(8, 12), lens.mean(axis=1))
    feats = frozenset({"placement", "stream", "bubble", "spec"})

    def step(p):
        return simulate_step(sl, feats - {"spec"}, p, StepKnobs(group=4, max_batch=16), SpecModel(), 4, CarryOver(),
                             np.random.default_rng(0), fixed_tau=1.5, fixed_draft=0.8)[0]

    a, b = step(prof), step(slow)
    assert b.step_time_s == pytest.approx(1.4 * a.step_time_s) and b.rollout_s == pytest.approx(1.4 * a.rollout_s)
    assert b.bubble_frac == pytest.approx(a.bubble_frac)
    with pytest.raises(ValueError, match="valid range: > 0"):
        prof.at_speed(0.0)
