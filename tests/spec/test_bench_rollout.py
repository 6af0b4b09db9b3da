"""`megarl bench rollout` on the smoke config: every variant token-identical, the documented keys."""
import json

from megarl.bench.rollout import bench_rollout
from megarl.config import load_config


def test_bench_rollout_smoke(tmp_path):
    cfg = load_config("configs/smoke.yaml", ["rl_steps=3"])
    out = tmp_path / "bench.json"
    report = bench_rollout(cfg, steps=3, out_json=out, progress=False)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["exact_match"] is True
    assert all(r["exact_match"] for r in report["steps"])
    for k in ("forward_reduction", "speedup", "accept_len_mean", "entropy_mean", "by_source", "bubble_uncoupled"):
        assert k in report, k
    assert set(report["by_source"]) == {"bubble", "history", "group", "prompt"}
    # Step 1 has bubble drafts (pre-generated in step 0): speculation saved target forwards.
    assert report["forward_reduction_first_bubble_step"] > 0
    assert report["steps"][1]["all"]["target_forwards"] < report["steps"][1]["ar"]["target_forwards"]
