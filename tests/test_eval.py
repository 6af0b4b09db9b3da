"""Evaluation during training through the real CLI (megarl/stages/evaluate.py): it never changes
the training run, its figures reach metrics.jsonl, TensorBoard and ``megarl report``, a resumed run
repeats them, and ``megarl eval`` of the final export equals the run's last in-run evaluation."""
import json

import pytest

from cli_runs import SMOKE, assert_weights_change_every_step, copy_run_until, deterministic_part, megarl, read_metrics

EVAL = ("--set", "eval.prompts=8", "--set", "eval.samples=4", "--set", "eval.greedy=true")
STEPS = ("--set", "rl_steps=3")  # evaluations at steps 0, 2 (every 2nd) and 3 (the last)


def _eval_part(m: dict) -> dict:
    return {k: v for k, v in m.items() if k.startswith("eval/")}


def _train_part(m: dict) -> dict:
    return {k: v for k, v in deterministic_part(m).items() if not k.startswith("eval/")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    for name, every in (("off", 0), ("on", 2)):
        megarl("train", "--config", SMOKE, "--run-dir", str(root / name), *STEPS, *EVAL, "--set", f"eval.every={every}")
    return root


def test_training_with_eval_equals_training_without(runs):
    off, on = read_metrics(runs / "off"), read_metrics(runs / "on")
    assert [m["step"] for m in off] == [1, 2, 3] and [m["step"] for m in on] == [0, 1, 2, 3]
    assert_weights_change_every_step(off)  # (a run whose steps change nothing would make this vacuous)
    assert [_train_part(m) for m in on[1:]] == [deterministic_part(m) for m in off]
    for f in sorted((runs / "off" / "hf").glob("*.safetensors")):
        assert (runs / "on" / "hf" / f.name).read_bytes() == f.read_bytes(), f.name  # bitwise


def test_eval_metrics_in_metrics_jsonl_and_tensorboard(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = read_metrics(runs / "on")
    assert set(lines[0]) == {"step", "eval_time_s"} | set(_eval_part(lines[0]))  # step 0: before RL, eval only
    assert all(("eval_time_s" in m) == bool(_eval_part(m)) for m in lines)
    evaluated = [m["step"] for m in lines if _eval_part(m)]
    assert evaluated == [0, 2, 3]
    keys = {"eval/prompts", "eval/samples", "eval/reward_mean", "eval/pass_at_1", "eval/pass_at_2", "eval/pass_at_4",
            "eval/response_len_mean", "eval/response_len_max", "eval/truncated_frac"}
    keys |= {k.replace("eval/", "eval/greedy/") for k in keys if "pass_at_2" not in k and "pass_at_4" not in k}
    for m in lines:
        if m["step"] in evaluated:
            e = _eval_part(m)
            assert set(e) == keys and e["eval/prompts"] == 8 and e["eval/samples"] == 4
            assert e["eval/pass_at_1"] <= e["eval/pass_at_2"] <= e["eval/pass_at_4"]
            assert e["eval/greedy/samples"] == 1 and e["eval/greedy/pass_at_1"] == e["eval/greedy/reward_mean"]
    acc = EventAccumulator(str(runs / "on" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    pts = acc.Scalars("eval/pass_at_1")
    assert [p.step for p in pts] == evaluated
    assert [p.value for p in pts] == pytest.approx([m["eval/pass_at_1"] for m in lines if _eval_part(m)])
    out = runs / "report"
    megarl("report", str(runs / "on"), "--out", str(out))
    assert (out / "eval.png").is_file() and (out / "eval_length.png").is_file()


def test_megarl_eval_of_the_export_equals_the_last_in_run_eval(runs, tmp_path):
    proc = megarl("eval", "--model", str(runs / "on" / "hf"), "--config", SMOKE, *EVAL, "--json",
                  str(tmp_path / "eval.json"))
    last = _eval_part(read_metrics(runs / "on")[-1])
    assert json.loads(proc.stdout) == last  # same prompts, noise and weights: the same figures, exactly
    assert json.loads((tmp_path / "eval.json").read_text()) == last
    assert last != _eval_part(read_metrics(runs / "on")[0])  # (the figures do tell weights apart)


def test_resumed_run_repeats_its_evaluations(runs, tmp_path):
    dst = copy_run_until(runs / "on", tmp_path / "resumed", 2)
    megarl("train", "--config", SMOKE, "--run-dir", str(dst), "--resume", *STEPS, *EVAL, "--set", "eval.every=2")
    assert [deterministic_part(m) for m in read_metrics(dst)] == [deterministic_part(m) for m in
                                                                  read_metrics(runs / "on")]


def test_megarl_eval_without_a_held_out_set_is_one_error(runs):
    proc = megarl("eval", "--model", str(runs / "on" / "hf"), "--config", SMOKE, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "megarl: error: megarl eval needs a held-out set: set eval.prompts >= 1 (in --config or with --set "
        "eval.prompts=N)"]


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_two_process_run_evaluates_as_megarl_eval_of_its_export(tmp_path, placement):
    # Colocated: two rollout replicas each sample half the held-out set and gather the figures;
    # disaggregated: the generating process hands them to the trainer (rank 0), which logs them.
    import subprocess
    import sys

    from cli_runs import ROOT, cli_env

    run = tmp_path / placement
    layout = ["--set", "parallel.placement=disaggregated", "--set", "parallel.rollout_ranks=1"] \
        if placement == "disaggregated" else []
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "megarl.cli", "train", "--config", SMOKE, "--run-dir", str(run), "--set", "rl_steps=2",
                           "--set", "eval.every=2", *EVAL, *layout], cwd=ROOT,
                          env={**cli_env(), "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(run)
    assert [m["step"] for m in lines if _eval_part(m)] == [0, 2]
    proc = megarl("eval", "--model", str(run / "hf"), "--config", SMOKE, *EVAL)
    assert json.loads(proc.stdout) == _eval_part(lines[-1])
    assert _eval_part(lines[-1])["eval/reward_mean"] > 0  # (the figures are not all zeros)


def test_dataset_held_out_prompts_are_never_trained_on(tmp_path):
    # A JSONL set: the last eval.prompts rows are the held-out set; training draws only the others.
    from megarl.rl.tokenizer import CharTokenizer

    tok_dir = tmp_path / "tok"
    CharTokenizer().save_pretrained(tok_dir)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(1, 5) for b in range(1, 3)]  # 8 rows
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    megarl("train", "--config", SMOKE, "--run-dir", str(run), "--set", "data.source=jsonl", "--set",
           f"data.jsonl_path={data}", "--set", f"data.tokenizer_path={tok_dir}", "--set", "sft.steps=0",
           "--set", "rl_steps=3", "--set", "checkpoint_every=0", "--set", "rollout.dump=true",
           "--set", "eval.prompts=2", "--set", "eval.every=3")
    trained = {s["uid"] for ln in (run / "rollouts.jsonl").read_text().splitlines() for s in json.loads(ln)["samples"]}
    assert trained == set(range(6))  # 12 prompt draws over 2 epochs of the 6 training rows; rows 6, 7 never
    lines = read_metrics(run)
    assert [m["step"] for m in lines if _eval_part(m)] == [0, 3] and lines[-1]["eval/prompts"] == 2
