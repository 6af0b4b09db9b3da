"""``megarl bench engine`` end to end on a very small model (the figures' plumbing, not speed)."""
import json

import pytest

from megarl.bench import engine as bench
from megarl.cli import main


def test_bench_engine_small(tmp_path, monkeypatch):
    monkeypatch.setitem(bench.MODEL_SIZES, "tiny", dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=1e6, max_position_embeddings=128, tie_word_embeddings=True))
    out = tmp_path / "engine.json"
    rc = main(["bench", "engine", "--json", str(out), "--model-size", "tiny", "--batch-sizes", "2",
               "--prompt-len", "5", "--new-tokens", "9", "--repeats", "1", "--device", "cpu"])
    assert rc == 0
    rep = json.loads(out.read_text())
    (row,) = rep["rows"]
    assert row["batch"] == 2 and row["hf_tok_s"] > 0 and row["bound_tok_s"] > 0
    for kv in ("slots", "paged"):
        e = row[kv]
        assert e["engine_tok_s"] > 0 and e["engine_spec_tok_s"] > 0
        # coupled drafts from the same weights: every draft accepted, K=4 -> 5 tokens per forward
        # (the last forward of each response has room for fewer)
        assert 4 <= e["spec_accept_len"] <= 5
        v = rep["verify_k4_b16"][kv]
        assert v["decode_step_ms"] > 0 and v["verify_over_decode"] == v["verify_step_ms"] / v["decode_step_ms"]
    assert "only meaningful" in rep["note"] and rep["device"] == "cpu"


def test_bench_engine_bad_flags(capsys):
    assert main(["bench", "engine", "--json", "x.json", "--device", "tpu"]) == 2
    assert "--dtype/--device" in capsys.readouterr().err
    assert main(["bench", "engine", "--json", "x.json", "--new-tokens", "1"]) == 2
    assert "--new-tokens=1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "engine", "--json", "x.json", "--kv-cache", "pages"])


def test_bench_engine_real_weights_mode(tmp_path):
    """``--model HF_DIR`` on a very small saved model: every cell filled, the engine's greedy
    tokens equal generate's and speculation's equal plain decoding's (the plumbing, not speed)."""
    import torch

    from megarl.models.config import ModelArgs
    from megarl.models.hf_io import save_hf_model
    from megarl.models.llama import CausalLM

    torch.manual_seed(0)
    args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, rope_theta=1e4, max_position_embeddings=128, tie_word_embeddings=True,
                     model_type="llama")
    folder = save_hf_model(CausalLM(args).state_dict(), args, tmp_path / "m")
    out = tmp_path / "engine.json"
    rc = main(["bench", "engine", "--json", str(out), "--model", str(folder), "--batch-sizes", "1,4",
               "--prompt-len", "5", "--new-tokens", "9", "--repeats", "1", "--dtype", "float32", "--threads", "1",
               "--sides", "hf,engine,engine_spec", "--temperatures", "0,1"])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["complete"] is True and report["sides"] == ["hf", "engine", "engine_spec"]
    assert [(r["batch"], r["temperature"], r["lengths"]) for r in rows] == [
        (b, t, m) for b in (1, 4) for t in (0.0, 1.0) for m in ("tailed", "equal")]
    for r in rows:
        assert r["hf_tok_s"] > 0 and r["engine_tok_s"] > 0 and r["engine_spec_tok_s"] > 0
        assert r["engine_over_hf"] == r["engine_tok_s"] / r["hf_tok_s"]
        # speculation leaves every token unchanged at T=1 too (docs/design.md §1.2)
        assert r["spec_same_as_plain"] is True
        if r["temperature"] == 0:
            assert r["hf_same_greedy"] == f"{r['batch']}/{r['batch']}"
        else:  # each side samples with its own noise: no token comparison
            assert "hf_same_greedy" not in r
    assert rows[4]["mean_len"] < 9  # tailed: most rows shorter than the longest


def test_bench_engine_real_weights_bad_flags(tmp_path, capsys):
    assert main(["bench", "engine", "--json", "x.json", "--model", str(tmp_path), "--threads", "0"]) == 2
    err = capsys.readouterr().err
    assert "--threads=0" in err and f"--model={tmp_path}" in err and "config.json" in err
    assert main(["bench", "engine", "--json", "x.json", "--model", str(tmp_path), "--sides", "engine,sglang",
                 "--temperatures", "0,0.7"]) == 2
    err = capsys.readouterr().err
    assert "--sides=engine,sglang (valid: distinct names of hf,engine,engine_spec,vllm)" in err
    assert "--temperatures=0,0.7 (valid: 0 and/or 1" in err
    assert main(["bench", "engine", "--json", "x.json", "--model", str(tmp_path), "--batch-sizes", "1,x"]) == 2
    assert "--batch-sizes=1,x" in capsys.readouterr().err


def test_bench_engine_vllm_side_absent(tmp_path, capsys, monkeypatch):
    """Without vLLM, a bench that asks for its side (as the default sides do) stops before anything
    is written, naming the install step and the sides that would run."""
    from megarl.engine import vllm_backend

    monkeypatch.setattr(vllm_backend, "vllm_missing", lambda: "ModuleNotFoundError: No module named 'vllm'")
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    out = tmp_path / "engine.json"
    assert main(["bench", "engine", "--json", str(out), "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "the default --sides includes vllm, but vLLM cannot be imported (ModuleNotFoundError" in err
    assert "`make vllm`" in err and "--sides hf,engine,engine_spec" in err
    assert not out.exists()


def test_vllm_setup_rerun_env(monkeypatch):
    """vLLM's CPU set-up: a fresh process preloads the libraries found and not yet preloaded, with
    OMP_NUM_THREADS and the in-process engine core; none when nothing is missing or already re-run."""
    from megarl.bench.engine_vllm import RERUN_MARK, rerun_env

    monkeypatch.delenv(RERUN_MARK, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/x/libother.so")
    setup = {"libs": {"tcmalloc": "/l/libtcmalloc_minimal.so.4", "iomp": None},
             "preloaded": {"tcmalloc": False, "iomp": False}, "threads": 3}
    env = rerun_env(setup)
    assert env["LD_PRELOAD"] == "/l/libtcmalloc_minimal.so.4:/x/libother.so"
    assert env["OMP_NUM_THREADS"] == "3" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env[RERUN_MARK] == "1"
    assert rerun_env({**setup, "preloaded": {"tcmalloc": True, "iomp": False}}) is None
    assert rerun_env({**setup, "libs": {"tcmalloc": None, "iomp": None}}) is None
    monkeypatch.setenv(RERUN_MARK, "1")
    assert rerun_env(setup) is None
