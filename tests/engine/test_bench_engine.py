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
