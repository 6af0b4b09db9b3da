"""The engine with sliding-window attention, on responses many windows long: sampled tokens and
logprobs are the plain model's full forward (fp64), which is transformers', on the slot and the
paged KV cache, the static-shape step and the speculative verify path."""
import pytest
import torch

from megarl.engine import Engine, EngineConfig
from megarl.models.hf_io import load_hf_model
from tests.engine.test_scaled_rope_engine import LAYOUTS, check_against_hf, check_speculative_verify, requests
from tests.models.test_sliding_window import WINDOW, hf_model


def setup(tmp_path, family):
    hf = hf_model(family, seed=4).double()
    with torch.no_grad():  # sharper logits, so that the tokens depend on what attention sees
        hf.lm_head.weight.mul_(20)
    hf.save_pretrained(tmp_path / "hf")
    model = load_hf_model(tmp_path / "hf", torch.float64)
    model.args.eos_token_id = None  # run every response to its length limit
    assert model.args.sliding_window == WINDOW
    return hf, model


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # full and sliding layers mixed
def test_engine_matches_transformers(tmp_path, family, layout):
    hf, model = setup(tmp_path, family)
    cfg = EngineConfig(max_batch_size=3, max_seq_len=128, dtype="float64", **LAYOUTS[layout])
    reqs = requests()
    check_against_hf(hf, model, reqs, Engine(model, cfg, seed=1).generate(reqs, step=2))


def test_speculative_verify_matches_transformers(tmp_path):
    hf, model = setup(tmp_path, "qwen2")
    check_speculative_verify(hf, model)
