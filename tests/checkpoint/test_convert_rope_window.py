"""``megarl convert`` of models with scaled RoPE (HF rope_type llama3 / yarn) or sliding-window
attention: the HF -> Megatron -> HF round trip is bitwise and carries those settings in meta.json and
config.json; the trainer's GPTModel and the engine's CausalLM loaded from the converted checkpoints
give transformers' logits past the original context / over several windows."""
import json

import pytest
import torch
import transformers

from megarl.checkpoint import convert as cv
from megarl.models.config import ModelArgs
from megarl.models.hf_io import load_hf_model, load_hf_state_dict
from megarl.trainer.model import build_gpt_model, gpt_logits, load_state
from tests.checkpoint.test_convert import assert_same_tensors, dims, make_hf  # noqa: F401 (dims: fixture)
from tests.models.test_rope_scaling import ROPES

CASES = [("llama", "llama3"), ("qwen2", "yarn_mscale"), ("qwen3", "yarn"), ("qwen2", "window"), ("qwen3", "window")]
WINDOW = dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)  # layer 0 full, layer 1 sliding


def scaled_hf(tmp_path, family, rope):
    if rope == "window":
        return make_hf(family, tmp_path / "hf", seed=5, max_position_embeddings=128, **WINDOW)
    rope_parameters = {**ROPES[rope], "rope_theta": 5000.0}
    return make_hf(family, tmp_path / "hf", seed=5, max_position_embeddings=128, rope_parameters=rope_parameters)


@pytest.mark.parametrize("family,rope", CASES)
def test_round_trip_is_bitwise_and_carries_rope(tmp_path, family, rope):
    hf = scaled_hf(tmp_path, family, rope)
    hf_cfg = json.loads((hf / "config.json").read_text())
    cv.hf_to_mcore(hf, tmp_path / "mc", tp=2, pp=2, progress=False)
    meta, args = cv.read_meta(tmp_path / "mc")
    assert meta["hf_config"] == hf_cfg
    assert args == ModelArgs.from_hf_config(hf_cfg)
    if rope == "window":
        assert args.windows == [None, WINDOW["sliding_window"]]
    else:
        assert hf_cfg["rope_parameters"]["rope_type"] == ROPES[rope]["rope_type"]
        assert {k: args.rope_scaling[k] for k in ROPES[rope]} == ROPES[rope]
    cv.mcore_to_hf(tmp_path / "mc", tmp_path / "back", progress=False)
    assert_same_tensors(load_hf_state_dict(tmp_path / "back"), load_hf_state_dict(hf))
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == hf_cfg


@pytest.mark.parametrize("family,rope", CASES)
def test_converted_checkpoint_logits_match_transformers(tmp_path, dims, family, rope):
    hf = scaled_hf(tmp_path, family, rope)
    cv.hf_to_mcore(hf, tmp_path / "mc", tp=1, pp=1, progress=False)
    cv.mcore_to_hf(tmp_path / "mc", tmp_path / "back", progress=False)
    ids = torch.randint(0, 53, (2, 110), generator=torch.Generator().manual_seed(1))
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager").eval()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    _, args = cv.read_meta(tmp_path / "mc")
    gpt = build_gpt_model(args, dims, torch.float32, seed=0)
    load_state(gpt, cv.load_piece(tmp_path / "mc", 0, 0))
    engine = load_hf_model(tmp_path / "back", torch.float32).eval()
    with torch.no_grad():
        want = ref(ids).logits
        assert torch.equal(back(ids).logits, want)
        assert (gpt_logits(gpt, ids).cpu() - want).abs().max().item() <= 1e-5
        assert (engine(ids) - want).abs().max().item() <= 1e-5
