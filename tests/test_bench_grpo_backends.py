"""benchmarks/bench_grpo_backends.py's figures from the runs' metrics lines: per backend the
median over the steps after the first (warm-up), the fastest round's, and vLLM's over megarl's."""
import pytest

from benchmarks.bench_grpo_backends import format_step, main, step_row, summary


def _metrics(step, rollout, train, sync, load=None):
    m = {"step": step, "rollout_time_s": rollout, "train_time_s": train, "weight_sync_s": sync,
         "step_time_s": rollout + train + sync, "reward_mean": 0.5, "logprob_diff_max": 1e-5,
         "response_len_mean": 40.0}
    if load is not None:
        m["vllm_load_s"] = load
    return m


def test_summary_skips_warm_up_step_and_takes_fastest_round():
    rows = [step_row("megarl", 0, _metrics(1, 99.0, 9.0, 1.0)),  # warm-up: not counted
            step_row("megarl", 0, _metrics(2, 10.0, 5.0, 1.0)),
            step_row("megarl", 0, _metrics(3, 12.0, 5.0, 1.0)),
            step_row("megarl", 0, _metrics(4, 30.0, 5.0, 1.0)),  # median of round 0: 12
            step_row("vllm", 0, _metrics(2, 20.0, 5.0, 3.0, 2.0)),
            step_row("vllm", 0, _metrics(3, 24.0, 5.0, 3.0, 2.0)),
            step_row("megarl", 1, _metrics(2, 8.0, 5.0, 1.0)),  # round 1: median 9, the fastest
            step_row("megarl", 1, _metrics(3, 10.0, 5.0, 1.0))]
    s = summary(rows)
    assert s["megarl"]["rollout_time_s"] == 9.0 and s["vllm"]["rollout_time_s"] == 22.0
    assert s["vllm"]["vllm_load_s"] == 2.0 and "vllm_load_s" not in s["megarl"]  # megarl's engine has none
    assert s["vllm_over_megarl"]["rollout_time_s"] == pytest.approx(22.0 / 9.0)
    assert s["vllm_over_megarl"]["weight_sync_s"] == pytest.approx(3.0)
    assert "vllm_load_s" not in s["vllm_over_megarl"]
    assert format_step(rows[4]).split()[:3] == ["vllm", "0", "2"]


def test_bad_flags_exit_before_any_run(capsys):
    with pytest.raises(SystemExit):
        main(["--steps", "1", "--config", "configs/smollm2.yaml"])
    assert "--steps=1 (valid: >= 2; the first is warm-up)" in capsys.readouterr().err


def test_variants_replace_the_backends_and_are_compared_with_the_first():
    from benchmarks.bench_grpo_backends import parse_variants

    v = parse_variants(["fp32=trainer.dtype=float32,rollout.dtype=float32", "bf16=trainer.dtype=bfloat16"])
    assert v == {"fp32": ["trainer.dtype=float32", "rollout.dtype=float32"], "bf16": ["trainer.dtype=bfloat16"]}
    assert parse_variants([]) == {"megarl": ["rollout.backend=megarl"], "vllm": ["rollout.backend=vllm"]}
    for bad in ["bf16", "=a=b", "x=a", "x=a=b,c"]:
        with pytest.raises(ValueError, match="--variant"):
            parse_variants([bad])
    with pytest.raises(ValueError, match="a new NAME"):
        parse_variants(["x=a=b", "x=c=d"])
    rows = [step_row("fp32", 0, _metrics(2, 10.0, 20.0, 1.0)), step_row("bf16", 0, _metrics(2, 5.0, 30.0, 1.0))]
    s = summary(rows)
    assert list(s) == ["fp32", "bf16", "bf16_over_fp32"]
    assert s["bf16_over_fp32"]["train_time_s"] == pytest.approx(1.5)
