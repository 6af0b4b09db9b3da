"""``megarl train --config configs/smoke.yaml --set rollout.backend=vllm`` end to end: SFT, RL
steps whose rollouts vLLM generates from the weights synced after every step, export."""
from tests.cli_runs import SMOKE, megarl, read_metrics
from tests.vllm_marks import needs_vllm

pytestmark = needs_vllm


def test_smoke_run_on_the_vllm_backend(tmp_path):
    """With truncated importance sampling on, as a run on an inexact engine would use it: its ratio
    metrics come from vLLM's logprobs of the sampled tokens."""
    run_dir = tmp_path / "run"
    megarl("train", "--config", SMOKE, "--run-dir", str(run_dir), "--set", "rollout.backend=vllm",
           "--set", "rl_steps=3", "--set", "checkpoint_every=0", "--set", "grpo.rollout_correction=tis")
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        # every sample came from the weights being trained (docs/design.md §1.3): fp32 rounding only
        assert 0 <= m["logprob_diff_max"] < 1e-4, m
        assert m["rollout_tokens"] > 0 and m["vllm_load_s"] >= 0
        # pi_old / pi_vllm of the sampled tokens: 1 up to that rounding, so nothing is truncated
        assert abs(m["is_ratio"] - 1) < 1e-4 and 1 <= m["is_ratio_max"] < 1 + 1e-4, m
        assert m["is_clip_frac"] == 0, m
        assert "entropy_mean" not in m  # vLLM reports no entropies: absent, not a collapse to 0
    assert len({m["weight_checksum"] for m in metrics}) == 3  # every step changed the weights vLLM ran
    assert (run_dir / "hf" / "model.safetensors").is_file()
