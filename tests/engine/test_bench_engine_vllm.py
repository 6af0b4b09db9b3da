"""``megarl bench engine --model`` with its vLLM-CPU side, on SmolLM2-135M at a tiny shape (the
figures' plumbing, not speed): in fp32 vLLM's and ``generate``'s greedy tokens equal megarl's
engine's row by row, and every row carries each side's figures."""
import json

from megarl.cli import main
from tests.vllm_marks import needs_vllm

pytestmark = needs_vllm


def test_bench_engine_vllm_side(smollm2_dir, tmp_path):
    out = tmp_path / "engine.json"
    rc = main(["bench", "engine", "--json", str(out), "--model", str(smollm2_dir), "--sides", "engine,vllm,hf",
               "--batch-sizes", "3", "--lengths", "equal", "--temperatures", "0,1", "--prompt-len", "6",
               "--new-tokens", "8", "--repeats", "1", "--dtype", "float32", "--vllm-setup", "as-is"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["complete"] is True and report["sides"] == ["engine", "vllm", "hf"]
    assert report["vllm_setup"]["enforce_eager"] is True and report["vllm_setup"]["threads"] == 2
    greedy, sampled = report["rows"]
    assert (greedy["temperature"], sampled["temperature"]) == (0.0, 1.0)
    for r in (greedy, sampled):
        assert r["batch"] == 3 and r["mean_len"] == 8
        assert min(r["engine_tok_s"], r["vllm_tok_s"], r["hf_tok_s"]) > 0
        assert r["engine_over_vllm"] == r["engine_tok_s"] / r["vllm_tok_s"]
    # same prompts, same weights, fp32: greedy decoding agrees token for token on every row
    assert greedy["vllm_same_greedy"] == "3/3" and greedy["hf_same_greedy"] == "3/3"
    assert "vllm_same_greedy" not in sampled  # T=1: each side samples with its own noise
