"""Whole GRPO runs on several processes equal the single-process run of the same seed.

Single-process runs (a dense and a Qwen3-MoE policy) and one 4-process torchrun launch (DP=4;
TP=2 x PP=2; MoE with EP=2 x DP=4; rollout TP=2 with a TP2 x PP2 trainer; interleaved PP; stream training; length
placement and bubble work; tail batching; resumed runs) of ``megarl.train.train`` (see parallel_run_worker.py): fp64, 3 RL steps with real
updates. Every layout must sample the same tokens (the exactness contract: rollout replicas see
other batches, the tokens do not change), log the same rewards and losses, and end with the same
weights (issue bound 1e-6; fp64 gives ~1e-13)."""
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megarl.checkpoint.convert import hf_to_mcore
from megarl.sched.timeline import MIN_EVENT_S
from tests.parallel_run_worker import MOE
from tests.torchrun import torchrun

WORKER = Path(__file__).parent / "parallel_run_worker.py"
# fp32 training and rollout at an RL-sized learning rate: the bound (1e-6) for stream training.
F32 = "trainer.dtype=float32,rollout.dtype=float32,trainer.lr=1e-5"
NP8 = "task.num_prompts=16,rollout.prompts_per_step=8"
L4 = "model.num_hidden_layers=4"
# Every draft source, every draft verified (no cost rule), bubble work at normal priority so that it surely runs.
BUBBLE = "spec.enabled=true,spec.bubble_pregen=true,spec.forward_cost_tokens=0,schedule.bubble_priority=normal"
# name: (overrides, the single-process run it must equal)
# One launch holds every run, so each layout costs a whole run (~8 s on 2 cores): a layout is here only if no other
# covers it. TP=2 and PP=2 alone are checked step by step in tests/trainer/test_sharding.py; here TP2xPP2 (with
# rollout TP=2 too), sharded checkpoints through the TP2xPP2xVPP2 resume, stream training at the fp32 bound
# and with TP groups as rollout groups, bubble work with stream training (both kinds of bubble work).
LAYOUTS = {
    "dp4": ("", "single"),
    "moe_ep2": (MOE + ",parallel.trainer_ep=2", "moe_single"),
    # rollout TP=2 (2 rollout groups) with a TP2xPP2 trainer (TP2xPP2 alone: from_hf_tp2pp2 below)
    "tp2pp2_rtp2": ("parallel.trainer_tp=2,parallel.trainer_pp=2,parallel.rollout_tp=2", "single"),
    "dp4_stream32": (F32 + ",stream_train=true", "single32"),
    # Stream training with a TP=2 trainer whose TP groups are the rollout groups (DP=2).
    "tp2_rtp2_stream": ("parallel.trainer_tp=2,parallel.rollout_tp=2,stream_train=true", "single"),
    # 16 prompts, 8 a step on 4 replicas: step 3 repeats step 1's prompts, so length placement has a history to
    # balance by (and round robin, the other policy, for comparison): neither changes a sample.
    "dp4_np8": ("task.num_prompts=16,rollout.prompts_per_step=8,rollout.placement=length", "single_np8"),
    # Resumed after step 2: the length history is in the checkpoint, so step 3 is placed as in dp4_np8.
    "dp4_np8_resumed": ("task.num_prompts=16,rollout.prompts_per_step=8,rollout.placement=length,resume_at=2",
                        "single_np8"),
    # ... with the paged KV cache (blocks, a group's samples sharing their prompt's blocks): a whole run's tokens
    "dp4_np8_rr_paged": ("task.num_prompts=16,rollout.prompts_per_step=8,rollout.placement=round_robin,"
                         "rollout.kv_cache=paged", "single_np8"),
    # Exactness (docs/design.md §1): length placement + bubble work (pre-generated bubble drafts used by the next step's
    # speculation; stream training of finished groups in the idle replicas) vs. none: same samples, same weights.
    "dp4_np8_bubble_stream": (NP8 + ",rollout.placement=length,stream_train=true," + BUBBLE, "single_np8"),
    # Interleaved 1F1B: 4 layers in 4 pipeline stages, 2 model chunks per pipeline rank (rank 0: layers 0 and 2);
    # with TP, resumed from its per-rank checkpoint (a list of chunks).
    "pp2vpp2": (L4 + ",parallel.trainer_pp=2,parallel.trainer_vpp=2", "single_l4"),
    "tp2pp2vpp2_resumed": (L4 + ",parallel.trainer_tp=2,parallel.trainer_pp=2,parallel.trainer_vpp=2,resume_at=2",
                           "single_l4"),
    # Starting from a HF folder (the single run's export): each trainer rank reads only its piece.
    "from_hf_tp2pp2": ("model.init_from_hf={out}/single/hf,parallel.trainer_tp=2,parallel.trainer_pp=2",
                       "from_hf_single"),
    # Starting from the 4-layer single run's export converted by `megarl convert hf-to-mcore --tp 2 --pp 2 --vpp 2`:
    # each trainer rank reads its own piece files (one per model chunk).
    "from_mcore_tp2pp2vpp2": (L4 + ",model.init_from_mcore={out}/single_l4_mcore,parallel.trainer_tp=2,"
                              "parallel.trainer_pp=2,parallel.trainer_vpp=2", "from_hf_l4"),
    # Disaggregated placement: ranks 0-1 train (DP=2; TP=2 below), ranks 2-3 only generate (2 replicas with
    # speculation and bubble drafts; 1 TP=2 replica below); the groups go to the trainers, the weights back.
    # The bubble drafts are made after each rollout (bubble_work without pregen), while the trainers train:
    # whether one of 2 replicas idles long enough within the rollout to make them depends on timing.
    "disagg_np8_bubble": (NP8 + ",parallel.placement=disaggregated,parallel.rollout_ranks=2,rollout.placement=length,"
                          + BUBBLE + ",schedule.bubble_work=[]", "single_np8"),
    "disagg_tp2_rtp2_resumed": ("parallel.placement=disaggregated,parallel.rollout_ranks=2,parallel.trainer_tp=2,"
                                "parallel.rollout_tp=2,resume_at=2", "single"),
}
# Tail batching: 8 prompts started per short round, the first 4 complete kept (1 per replica on 4), the rest
# queued for a long round. Which prompts make it depends on the replica count, so these runs are compared with
# each other: resumed (the queue is in the checkpoint) and with stream training, against the plain 4-process run.
TAIL = "tail.enabled=true,tail.overprovision=2.0"
# On 4 replicas: 8 prompts started (2 each, 1 kept each unless both finish at once), responses up to 40 tokens so
# that prompts finish apart.
TAIL4 = "tail.enabled=true,tail.overprovision=2.0,rollout.max_new_tokens=40"
# Elastic rollout TP: the long round on 2 rollout groups of TP=2 (short rounds: 4 of TP=1), same samples.
TAIL_RUNS = {"dp4_tail": TAIL4, "dp4_tail_stream_resumed": TAIL4 + ",stream_train=true,resume_at=2",
             "dp4_tail_elastic": TAIL4 + ",tail.long_rollout_tp=2"}
# Single-process runs: the references, and stream training in one process.
SINGLE = {"single": "", "single_tail": TAIL, "moe_single": MOE, "single32": F32, "stream32": F32 + ",stream_train=true", "from_hf_single": "model.init_from_hf={out}/single/hf", "single_np8": "task.num_prompts=16,rollout.prompts_per_step=8",
          "single_l4": L4, "from_hf_l4": L4 + ",model.init_from_hf={out}/single_l4/hf"}
# Tolerance on the final weights against the reference: fp64 runs differ by rounding only; the
# fp32 runs use a learning rate of RL's scale (Adam turns rounding noise in gradients that are
# ~0 in exact arithmetic, e.g. of the k bias, into updates of up to lr * noise / eps).
TOL = {"single": 1e-9, "moe_single": 1e-9, "single32": 1e-6, "from_hf_single": 1e-9, "single_np8": 1e-9, "single_l4": 1e-9, "from_hf_l4": 1e-9}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    torchrun(WORKER, 1, str(out), *(f"{name}={fields.format(out=out)}" for name, fields in SINGLE.items()))
    # 4 layers: 2 pipeline ranks x 2 virtual stages of one layer each
    hf_to_mcore(out / "single_l4" / "hf", out / "single_l4_mcore", tp=2, pp=2, vpp=2, progress=False)
    torchrun(WORKER, 4, str(out), *(f"{name}={fields.format(out=out)}" for name, (fields, _) in LAYOUTS.items()),
             *(f"{name}={fields}" for name, fields in TAIL_RUNS.items()), timeout=900)  # ~20 runs: minutes
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [*LAYOUTS, "stream32"])
def test_layout_run_equals_single_process_run(runs, layout):
    """Every layout, and stream training (which trains each group as it finishes and normalises
    by the final count), ends where the plain single-process run of the same seed ends."""
    single = LAYOUTS[layout][1] if layout in LAYOUTS else {"stream32": "single32"}[layout]
    want, got = metrics(runs / single), metrics(runs / layout)
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3]
    for g, w in zip(got, want):
        for key in ("reward_mean", "response_len_mean", "rollout_tokens", "zero_var_groups"):
            assert g[key] == w[key], (layout, g["step"], key)  # identical samples
        if "spec.enabled=true" not in LAYOUTS.get(layout, ("",))[0]:  # speculation: fewer forwards, same tokens
            assert g["target_forwards"] == w["target_forwards"], (layout, g["step"])
        assert abs(g["loss"] - w["loss"]) <= 1e-6 * max(1.0, abs(w["loss"]))
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-5 * w["grad_norm"]  # Megatron sums it in fp32
        assert g["update_ok"] == 1.0
    assert sum(w["grad_norm"] for w in want) > 0.1 and any(w["zero_var_groups"] < 4 for w in want)  # real updates
    ref = load_file(runs / single / "hf" / "model.safetensors")
    weights = load_file(runs / layout / "hf" / "model.safetensors")
    assert weights.keys() == ref.keys()
    diff = max((weights[k] - v).abs().max().item() for k, v in ref.items())
    moved = max((ref[k] - v).abs().max().item() for k, v in load_file(runs / single / "hf0.safetensors").items())
    assert moved > 10 * TOL[single], (single, moved)  # the steps changed the weights: the bound means something
    assert diff <= TOL[single], (layout, diff)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["dp4_np8_bubble_stream"])
def test_bubble_work_ran_and_is_accounted(runs, layout):
    """The equality above means something only if bubble work ran: drafts made in idle replicas
    were used (fewer forwards than tokens), stream training happened in the idle time; and every
    step's timeline has each rank's phases covering its rollout phase."""
    got = metrics(runs / layout)
    assert sum(m["bubble_tokens"] for m in got) > 0
    assert any(m["target_forwards"] < m["rollout_tokens"] for m in got[1:])
    if "stream" in layout:
        assert sum(m["bubble_groups"] for m in got) > 0
    lines = [json.loads(x) for x in (runs / layout / "timeline.jsonl").read_text().splitlines()]
    assert [t["step"] for t in lines] == [1, 2, 3]
    for t, m in zip(lines, got):
        assert [r["rank"] for r in t["ranks"]] == [0, 1, 2, 3]
        assert sorted(r["replica"] for r in t["ranks"]) == [0, 1, 2, 3]
        assert len(t["response_lengths"]) == 8 * 3  # prompts x group size
        assert sum(t["response_lengths"]) == m["rollout_tokens"]
        assert 0.0 <= m["bubble_frac"] <= 1.0
        for r in t["ranks"]:
            covered = sum(min(e["end"], r["rollout_end"]) - e["start"] for e in r["events"] if e["start"] < r["rollout_end"])
            assert covered == pytest.approx(r["rollout_end"] - r["start"], abs=1e-3)  # no gap in its rollout phase
            # the first event starts the rank's step (an idle gap shorter than MIN_EVENT_S is not recorded)
            assert min(e["start"] for e in r["events"]) == pytest.approx(r["start"], abs=MIN_EVENT_S + 2e-6)
            assert sum(e["end"] - e["start"] for e in r["events"] if e["phase"] == "generate") > 0


@pytest.mark.multiproc
@pytest.mark.parametrize("run", ["single_tail", *TAIL_RUNS])
def test_tail_batching_is_on_policy_and_repeatable(runs, run):
    """Short rounds keep the first complete prompts and queue the rest; a long round runs the queue.
    Every trained sample comes from the weights being trained (engine and trainer logprobs agree to
    fp64 rounding: a sample carried over from an older step would differ by ~1e-3, see
    tests/sched/test_tail.py); the resumed run and the stream-trained one equal the plain one."""
    got = metrics(runs / run)
    assert sum(m["tail_deferred"] for m in got) > 0
    queue = 0
    for m in got:  # a long round exactly when the queue holds a step's worth (4 prompts); it defers nothing
        assert m["tail_long_round"] == float(queue >= 4) and (m["tail_deferred"] == 0 or not m["tail_long_round"])
        queue = m["tail_queue"]
    if run == "single_tail":
        assert [m["tail_long_round"] for m in got] == [0.0, 1.0, 0.0]  # short, long (the queue), short
    if run == "dp4_tail_elastic":  # the long round ran on the TP=2 groups, the short ones on TP=1
        assert any(m["tail_long_round"] for m in got)
        assert [m["rollout_tp"] for m in got] == [1.0 + m["tail_long_round"] for m in got]
    if "stream" not in run:  # (stream training takes its old logprobs from the same forward)
        assert all(m["logprob_diff_max"] <= 1e-9 for m in got)
    if run == "single_tail":
        return
    want = metrics(runs / "dp4_tail")
    for g, w in zip(got, want):
        for key in ("reward_mean", "response_len_mean", "rollout_tokens", "tail_deferred", "tail_queue"):
            assert g[key] == w[key], (run, g["step"], key)
        assert abs(g["loss"] - w["loss"]) <= 1e-9 * max(1.0, abs(w["loss"]))
    ref = load_file(runs / "dp4_tail" / "hf" / "model.safetensors")
    weights = load_file(runs / run / "hf" / "model.safetensors")
    assert max((weights[k] - v).abs().max().item() for k, v in ref.items()) <= 1e-9


@pytest.mark.multiproc
def test_resumed_run_places_prompts_as_the_uninterrupted_one(runs):
    """Length placement after a resume uses the checkpointed history: step 3 (step 1's prompts
    again) gives each replica the same tokens as in the uninterrupted run, and the two placements
    do differ from round robin's there (so the check means something)."""
    got, want, rr = (metrics(runs / n) for n in ("dp4_np8_resumed", "dp4_np8", "dp4_np8_rr_paged"))
    assert [m["replica_token_imbalance"] for m in got] == [m["replica_token_imbalance"] for m in want]
    assert want[2]["replica_token_imbalance"] != rr[2]["replica_token_imbalance"]


@pytest.mark.multiproc
def test_disaggregated_runs_split_the_work(runs):
    """With disaggregated placement the trainers generate nothing and the generating ranks train
    nothing (their timelines say so), bubble drafts were made and used on the generating side, and
    every step's weights reached the engines (the sync's checksum, equal on all ranks, is checked
    inside each sync; here it changes every step)."""
    got = metrics(runs / "disagg_np8_bubble")
    assert sum(m["bubble_tokens"] for m in got) > 0 and any(m["target_forwards"] < m["rollout_tokens"] for m in got)
    assert len({m["weight_checksum"] for m in got}) == 3
    for line in (json.loads(x) for x in (runs / "disagg_np8_bubble" / "timeline.jsonl").read_text().splitlines()):
        phases = {r["rank"]: {e["phase"] for e in r["events"]} for r in line["ranks"]}
        assert [r["replica"] for r in line["ranks"]] == [-1, -1, 0, 1]
        assert all("generate" not in phases[r] and "train" in phases[r] for r in (0, 1)), phases
        assert all("generate" in phases[r] and "train" not in phases[r] for r in (2, 3)), phases
