"""The main job end to end (configs/smoke.yaml), resume exactness, export, and bad-input handling.

Runs go through the real CLI in subprocesses: Megatron's parallel state is per process.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli_runs import ROOT, assert_weights_change_every_step, deterministic_part, megarl, read_metrics

REQUIRED = {"step", "reward_mean", "entropy_mean", "response_len_mean", "response_len_max", "rollout_tokens",
            "target_forwards", "rollout_time_s", "train_time_s", "step_time_s"}
# (the smoke_run fixture, the uninterrupted reference run, is in tests/conftest.py: tests/test_faults.py shares it)


def test_smoke_run_writes_metrics_checkpoints_and_export(smoke_run):
    metrics = read_metrics(smoke_run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert_weights_change_every_step(metrics)  # what makes the resume and fault tests able to fail
    for m in metrics:
        assert REQUIRED <= set(m), REQUIRED - set(m)
        assert m["rollout_tokens"] >= m["response_len_max"] > 0
        assert m["target_forwards"] >= m["rollout_tokens"]  # no speculation: one forward per token at least
    assert sorted(p.name for p in (smoke_run / "checkpoints").iterdir()) == \
        ["step_000000", "step_000002", "step_000004"]
    assert (smoke_run / "hf" / "model.safetensors").is_file()
    assert not [p for p in smoke_run.rglob(".*tmp*")], "temporary directories left behind"


def test_export_greedy_matches_engine(smoke_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.engine import Engine, EngineConfig, Request, SamplingParams
    from megarl.models.hf_io import load_hf_model

    hf_dir = smoke_run / "hf"
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    ours = load_hf_model(hf_dir)
    engine = Engine(ours, EngineConfig(max_batch_size=4, max_seq_len=256), seed=0)
    prompts = ["12+7=", "40+3+25=", "9+81+6+77=", "5+5="]
    eos = hf.config.eos_token_id
    params = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=(eos,))
    results = engine.generate([Request(uid=i, sample_idx=0, prompt_ids=tok.encode(p, add_special_tokens=False),
                                       params=params) for i, p in enumerate(prompts)], step=0)
    for p, res in zip(prompts, results):
        ids = torch.tensor([tok.encode(p, add_special_tokens=False)])
        out = hf.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        assert out[0, ids.shape[1]:].tolist() == res.tokens, p


def test_resume_reproduces_next_steps_exactly(smoke_run, tmp_path):
    """Resumed from checkpoint 2, steps 3-4 repeat the uninterrupted run bitwise. The steps compared
    change the weights (nonzero gradients, new checksums) and start from Adam moments of two real
    updates, so a resume that restored the weights or the optimizer state wrongly would differ."""
    resumed = tmp_path / "resumed"
    shutil.copytree(smoke_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    shutil.rmtree(resumed / "hf")
    megarl("train", "--config", "configs/smoke.yaml", "--run-dir", str(resumed), "--resume")
    full, again = read_metrics(smoke_run), read_metrics(resumed)
    assert [m["step"] for m in again] == [1, 2, 3, 4]
    assert_weights_change_every_step(full)
    for a, b in zip(full, again):
        assert deterministic_part(a) == deterministic_part(b)
    from safetensors.torch import load_file
    w1, w2 = load_file(smoke_run / "hf" / "model.safetensors"), load_file(resumed / "hf" / "model.safetensors")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    # The export is not the checkpoint resumed from: the resumed steps moved the weights.
    at_resume = torch.load(smoke_run / "checkpoints" / "step_000002" / "trainer.pt", weights_only=False)["model"]
    at_resume = at_resume[0] if isinstance(at_resume, list) else at_resume
    emb = next(v for k, v in at_resume.items() if k.endswith("embedding.word_embeddings.weight"))
    assert not torch.equal(emb.to(w2["model.embed_tokens.weight"].dtype), w2["model.embed_tokens.weight"])


def test_tensorboard_events_equal_metrics_and_report_draws_curves(smoke_run, tmp_path):
    """The run's TensorBoard event files, read with TensorBoard's own reader, hold every
    numeric metric of metrics.jsonl at its step with the same value (TensorBoard stores float32),
    one point per step; ``megarl report`` draws the metric curves as PNGs."""
    import numpy as np

    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megarl.utils.metrics_log import scalar_tag

    assert list((smoke_run / "tensorboard").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(smoke_run / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    metrics = read_metrics(smoke_run)
    numeric = {k for m in metrics for k, v in m.items()
               if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert len(numeric) > 20 and set(scalars) == {scalar_tag(k) for k in numeric}
    for k in sorted(numeric):
        want = [(m["step"], np.float32(m[k])) for m in metrics if k in m]
        assert scalars[scalar_tag(k)] == want, k
    out = tmp_path / "report"
    proc = megarl("report", str(smoke_run), "--out", str(out))
    pngs = {p.name for p in out.glob("*.png")}
    assert {"reward.png", "entropy.png", "response_length.png", "step_time.png"} <= pngs, pngs
    for name in pngs:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(out / name) in proc.stdout


def test_existing_run_dir_needs_resume(smoke_run):
    proc = megarl("train", "--config", "configs/smoke.yaml", "--run-dir", str(smoke_run), check=False)
    assert proc.returncode == 2 and "pass --resume" in proc.stderr


def _assert_clean_failure(proc, run_dir: Path, *needles):
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("megarl: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[-1], lines[-1]
    assert not run_dir.exists(), "a failed start left output behind"


def test_misspelt_config_key(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text((ROOT / "configs/smoke.yaml").read_text().replace("group_size:", "group_sise:"))
    run_dir = tmp_path / "run"
    proc = megarl("train", "--config", str(cfg), "--run-dir", str(run_dir), check=False)
    _assert_clean_failure(proc, run_dir, "group_sise", "did you mean 'group_size'")


def test_missing_hf_file(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 32,
                                                    "hidden_size": 16, "intermediate_size": 32,
                                                    "num_hidden_layers": 1, "num_attention_heads": 2}))
    run_dir = tmp_path / "run"
    proc = megarl("train", "--config", "configs/smoke.yaml", "--run-dir", str(run_dir),
                  "--set", f"model.init_from_hf={hf_dir}", check=False)
    _assert_clean_failure(proc, run_dir, "model.safetensors")


def test_dataset_row_without_prompt(tmp_path):
    from megarl.rl.tokenizer import CharTokenizer

    tok_dir = tmp_path / "tok"
    CharTokenizer().save_pretrained(tok_dir)
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+2=", "answer": "3"}\n{"question": "2+2=", "answer": "4"}\n')
    run_dir = tmp_path / "run"
    proc = megarl("train", "--config", "configs/smoke.yaml", "--run-dir", str(run_dir),
                  "--set", "data.source=jsonl", "--set", f"data.jsonl_path={data}",
                  "--set", f"data.tokenizer_path={tok_dir}", "--set", "sft.steps=0", check=False)
    _assert_clean_failure(proc, run_dir, "data.jsonl:2", "prompt")


def test_jsonl_dataset_with_hf_tokenizer_runs(tmp_path):
    """Real-data path: JSONL rows + a HF tokenizer read from a local folder (here the char
    tokenizer saved in HF format), no SFT; prompts are the rows, the reward an exact match."""
    from megarl.rl.tokenizer import CharTokenizer

    tok_dir = tmp_path / "tok"
    CharTokenizer().save_pretrained(tok_dir)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(1, 5) for b in range(1, 3)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    megarl("train", "--config", "configs/smoke.yaml", "--run-dir", str(run_dir), "--set", "data.source=jsonl",
           "--set", f"data.jsonl_path={data}", "--set", f"data.tokenizer_path={tok_dir}", "--set", "sft.steps=0",
           "--set", "rl_steps=1", "--set", "checkpoint_every=0")
    (m,) = read_metrics(run_dir)
    assert m["step"] == 1 and m["rollout_tokens"] > 0
    assert (run_dir / "hf" / "tokenizer.json").is_file()


def test_kl_to_reference_survives_resume(tmp_path):
    """grpo.kl_coef > 0: the reference is the post-SFT policy, kept in checkpoints, so a resumed
    run computes the same KL (and everything else) as the uninterrupted one."""
    run_dir = tmp_path / "kl"
    args = ["--config", "configs/smoke.yaml", "--set", "grpo.kl_coef=0.05", "--set", "rl_steps=3",
            "--set", "checkpoint_every=1"]
    megarl("train", *args, "--run-dir", str(run_dir))
    full = read_metrics(run_dir)
    # step 1's policy is the reference (up to Megatron-vs-plain-torch rounding); later ones move away
    assert abs(full[0]["kl"]) < 1e-6 and full[2]["kl"] > 1e-5
    shutil.rmtree(run_dir / "checkpoints" / "step_000003")
    megarl("train", *args, "--run-dir", str(run_dir), "--resume")
    again = read_metrics(run_dir)
    assert [deterministic_part(m) for m in again] == [deterministic_part(m) for m in full]


def test_generate_cli_prints_engine_greedy_text(smoke_run):
    from megarl.engine import Engine, EngineConfig, Request, SamplingParams
    from megarl.models.hf_io import load_hf_model
    from megarl.rl.tokenizer import CharTokenizer

    tok = CharTokenizer()
    model = load_hf_model(smoke_run / "hf")
    engine = Engine(model, EngineConfig(max_batch_size=1, max_seq_len=256), seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=(tok.eos_id,))
    (res,) = engine.generate([Request(uid=0, sample_idx=0, prompt_ids=tok.encode("4+5+1="), params=params)], step=0)
    proc = megarl("generate", "--model", str(smoke_run / "hf"), "--prompt", "4+5+1=", "--max-new-tokens", "30")
    assert proc.stdout == "4+5+1=" + tok.decode(res.tokens) + "\n"
