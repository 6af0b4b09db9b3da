"""The long-tail schedulers and disaggregated placement on the vLLM backend in whole GRPO runs, on
2 and 3 processes (tests/vllm_run_worker.py), fp32.

- ``dp2``: length placement, stream training, bubble work (each replica trains its finished
  groups while the other still generates). It samples token for token what the single-process
  run samples and ends at its weights (fp32 rounding); each replica generated the share length
  placement gives it; the idle replica trained groups in its bubble; the timeline, ``bubble_frac``
  and ``megarl report`` read it as any run's.
- ``dp2_tail``: tail batching with stream training: short rounds keep each replica's first
  complete prompts and queue the rest, a long round runs the queue once it holds a step's worth,
  every trained sample comes from the weights being trained, and a kept prompt's samples are the
  ones the plain run sampled for it from the same weights.
- ``disagg`` (1 trainer, 1 generating process) and ``disagg3`` (2 trainers, DP=2, 1 generating
  process): the trainers start no vLLM but join its process groups (megarl/engine/vllm_groups.py);
  the groups go to the trainers, the weights back into the generating process's vLLM every step.
  Each samples token for token what the single-process run samples, on-policy, and ends at its
  weights; the trainers' timelines have no generation, the generating process's no training.

The launches run at once (each generating process starts its own vLLM)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megarl import report
from megarl.sched.placement import LengthHistory, place
from tests.torchrun import ROOT
from tests.vllm_marks import needs_vllm

pytestmark = [needs_vllm, pytest.mark.multiproc]

WORKER = Path(__file__).parent / "vllm_run_worker.py"
RUNS = {  # name: (processes, overrides)
    "single": (1, ""),
    "dp2": (2, "rollout.placement=length,stream_train=true,schedule.bubble_work=[stream_train]"),
    # responses up to 40 tokens, so that prompts finish apart (a short round then has a tail to cut)
    "dp2_tail": (2, "tail.enabled=true,tail.overprovision=2.0,stream_train=true,rollout.max_new_tokens=40"),
    # the last process generates, the others train
    "disagg": (2, "parallel.placement=disaggregated,parallel.rollout_ranks=1"),
    "disagg3": (3, "parallel.placement=disaggregated,parallel.rollout_ranks=1"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_runs")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    procs = {name: subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                     str(n), str(WORKER), str(out / name), sets], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
             for name, (n, sets) in RUNS.items()}
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}:\n{log[-4000:]}"
    return out


def _lines(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (run_dir / name).read_text().splitlines()]


def _same_run_as_single(runs, name: str) -> list[dict]:
    """Run ``name`` sampled every token and reward the single-process run sampled, on-policy, and
    ended at its weights (fp32 rounding); its metrics."""
    got, want = _lines(runs / name, "metrics.jsonl"), _lines(runs / "single", "metrics.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3]
    for a, b in zip(_lines(runs / name, "rollouts.jsonl"), _lines(runs / "single", "rollouts.jsonl"), strict=True):
        assert a["samples"] == b["samples"]  # every sample: uid, index, tokens, reward, finish reason
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=1e-7)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5) and w["grad_norm"] > 0.1
        assert g["logprob_diff_max"] < 1e-5 and w["logprob_diff_max"] < 1e-5  # fp32 rounding (design.md §1.3)
    ref, weights = (load_file(runs / n / "hf" / "model.safetensors") for n in ("single", name))
    moved = max((ref[k] - v).abs().max().item() for k, v in load_file(runs / "single" / "hf0.safetensors").items())
    diff = max((weights[k] - v).abs().max().item() for k, v in ref.items())
    assert diff < 2e-7 and moved > 1e-5, (diff, moved)  # the steps moved the weights: the bound means something
    return got


def test_placement_and_stream_training_in_bubbles_equal_the_single_process_run(runs):
    _same_run_as_single(runs, "dp2")


@pytest.mark.parametrize("name,trainers", [("disagg", 1), ("disagg3", 2)])
def test_disaggregated_run_equals_the_single_process_run(runs, name, trainers):
    """Trainer-only processes and one generating process: the samples, the update and the final
    weights of the single-process run; each step's weights reached vLLM (the samples of steps 2-3
    and ``logprob_diff_max`` say so; the sync's checksum, checked inside each sync, changes every
    step); the trainers generated nothing and the generating process trained nothing."""
    got = _same_run_as_single(runs, name)
    assert len({m["weight_checksum"] for m in got}) == 3
    for line in _lines(runs / name, "timeline.jsonl"):
        phases = {r["rank"]: {e["phase"] for e in r["events"]} for r in line["ranks"]}
        assert [r["replica"] for r in line["ranks"]] == [-1] * trainers + [0]
        assert all("generate" not in phases[r] and "train" in phases[r] for r in range(trainers)), phases
        assert "generate" in phases[trainers] and "train" not in phases[trainers], phases


def test_each_replica_generated_its_length_placed_share(runs):
    """Each rank's generated tokens are those of the prompts length placement gives its replica,
    from the history of every earlier step; at step 3 (step 1's prompts again, now seen) the
    placement differs from round robin's, so the check means something."""
    history, differs = LengthHistory(), False
    for line, tl in zip(_lines(runs / "dp2", "rollouts.jsonl"), _lines(runs / "dp2", "timeline.jsonl")):
        lengths: dict[int, list[int]] = {}
        for s in line["samples"]:
            lengths.setdefault(s["uid"], []).append(len(s["tokens"]))
        uids = list(lengths)
        tokens = {r["replica"]: r["tokens"] for r in tl["ranks"]}
        for policy in ("length", "round_robin"):
            share = [sum(sum(lengths[uids[j]]) for j in idx) for idx in place(uids, 2, policy, history)]
            if policy == "length":
                assert [tokens[0], tokens[1]] == share, (line["step"], tokens, share)
            else:
                differs |= [tokens[0], tokens[1]] != share
        for u, n in lengths.items():
            history.update(u, n)
    assert differs


def test_bubble_work_ran_and_the_timeline_reads_as_any_runs(runs, tmp_path):
    got = _lines(runs / "dp2", "metrics.jsonl")
    assert sum(m["bubble_groups"] for m in got) > 0  # the idle replica trained finished groups in its bubble
    records = report.load_timeline(runs / "dp2")  # (checks the format)
    for t, m in zip(records, got):
        assert sorted((r["rank"], r["replica"]) for r in t["ranks"]) == [(0, 0), (1, 1)]
        assert sum(t["response_lengths"]) == m["rollout_tokens"] == sum(r["tokens"] for r in t["ranks"])
        assert 0.0 <= m["bubble_frac"] <= 1.0 and report.bubble_fraction(t) == pytest.approx(m["bubble_frac"])
        for r in t["ranks"]:
            covered = sum(min(e["end"], r["rollout_end"]) - e["start"] for e in r["events"]
                          if e["start"] < r["rollout_end"])
            assert covered == pytest.approx(r["rollout_end"] - r["start"], abs=1e-3)  # no gap in its rollout phase
            assert sum(e["end"] - e["start"] for e in r["events"] if e["phase"] == "generate") > 0
    assert any(e["phase"] == "train" and e["start"] < r["rollout_end"]
               for t in records for r in t["ranks"] for e in r["events"])  # trained inside the rollout phase
    names = {p.name for p in report.render_report(runs / "dp2", tmp_path)}
    assert {"timeline.png", "lengths.png", "reward.png"} <= names


def test_tail_batching_with_stream_training_is_on_policy(runs):
    got = _lines(runs / "dp2_tail", "metrics.jsonl")
    assert [m["tail_long_round"] for m in got] == [0.0, 1.0, 0.0]  # short, long (the queue), short
    queue = 0
    for m in got:  # a long round exactly when the queue holds a step's worth (4 prompts); it defers nothing
        assert m["tail_long_round"] == float(queue >= 4) and (m["tail_deferred"] == 0 or not m["tail_long_round"])
        assert m["logprob_diff_max"] < 1e-5  # every trained sample from the weights being trained
        queue = m["tail_queue"]
    assert got[0]["tail_deferred"] > 0
    # Step 1 starts from the same weights as the plain run, and its 8 prompts include the plain run's 4:
    # a kept prompt has the very samples the plain run has; a deferred one, each sample cut or whole.
    plain = {(s["uid"], s["sample_idx"]): s for s in _lines(runs / "single", "rollouts.jsonl")[0]["samples"]}
    first = _lines(runs / "dp2_tail", "rollouts.jsonl")[0]
    kept = [s for s in first["samples"] if (s["uid"], s["sample_idx"]) in plain]
    for s in kept:
        _same_sample(len(s["tokens"]), s["finish_reason"], plain[(s["uid"], s["sample_idx"])])
        assert s["tokens"][:16] == plain[(s["uid"], s["sample_idx"])]["tokens"]
    cut = 0
    for d in first["deferred"]:
        for i, (n, why) in enumerate(zip(d["lengths"], d["finish_reasons"])):
            if (d["uid"], i) in plain:
                cut += 1
                _same_sample(n, why, plain[(d["uid"], i)])
    assert len(kept) + cut == 12 and cut > 0  # the plain run's 4 prompts, 3 samples each


def _same_sample(n: int, why: str, p: dict) -> None:
    """A step-1 sample of the tail run, ``n`` tokens long (responses up to 40; "aborted": cut by the
    short round's stop), is the plain run's sample ``p`` (up to 16 tokens) of the same prompt and
    index: the same tokens as far as both go."""
    full, stopped = len(p["tokens"]), p["finish_reason"] == "stop"
    if why == "aborted":
        assert n < full or not stopped, (n, p)
    else:
        assert (n, why) == (full, "stop") if stopped else n >= full, (n, why, p)
