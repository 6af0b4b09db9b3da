"""Scaled RoPE (HF rope_type llama3 and yarn) in megarl's plain-torch model against transformers,
from tiny random configs whose positions run past the original context (megarl/models/rope.py)."""
import pytest
import torch
import transformers

from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM

THETA = 5000.0
# head_dim 16 over theta 5000 puts the 8 frequencies on both sides of every band edge below.
ROPES = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
    "yarn_mscale": dict(rope_type="yarn", factor=6.0, original_max_position_embeddings=24, beta_fast=16.0,
                        beta_slow=2.0, mscale=1.2, mscale_all_dim=0.7, truncate=False),
    "yarn_attention_factor": dict(rope_type="yarn", factor=3.0, original_max_position_embeddings=20,
                                  attention_factor=1.3),
}


def hf_model(arch: str, rope: dict, seed: int = 0):
    common = dict(attn_implementation="eager", vocab_size=53, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                  max_position_embeddings=256, rope_parameters={**rope, "rope_theta": THETA})
    cfg = transformers.LlamaConfig(**common) if arch == "llama" else transformers.Qwen2Config(**common)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    return cls(cfg).eval()


def ours_from(hf) -> CausalLM:
    args = ModelArgs.from_hf_config(hf.config.to_dict())
    model = CausalLM(args).eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_scaled_rope_logits_match_transformers(arch, rope):
    hf = hf_model(arch, ROPES[rope])
    ours = ours_from(hf)
    assert ours.args.rope_scaling["rope_type"] == ROPES[rope]["rope_type"] and ours.args.rope_theta == THETA
    ids = torch.randint(0, 53, (2, 120), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        diff = (ref - ours(ids)).abs().max().item()
        plain = CausalLM(ModelArgs(**{**ours.args.__dict__, "rope_scaling": None})).eval()
        plain.load_state_dict(hf.state_dict())
        plain_diff = (ref - plain(ids)).abs().max().item()
    assert diff <= 1e-5, diff
    assert plain_diff > 1e-3, "the scaling does not change these logits: the test would not see it ignored"


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_scaled_rope_hf_config_round_trip(rope):
    hf = hf_model("llama", ROPES[rope])
    args = ModelArgs.from_hf_config(hf.config.to_dict())
    again = ModelArgs.from_hf_config(args.to_hf_config())
    assert again == args
    reloaded = transformers.LlamaConfig(**args.to_hf_config())
    assert reloaded.rope_parameters == hf.config.rope_parameters


@pytest.mark.parametrize("rope,msg", [
    (dict(rope_type="linear", factor=2.0), "rope_type='linear' is not supported"),
    (dict(rope_type="llama3", factor=8.0), "missing keys \\['high_freq_factor', 'low_freq_factor'\\]"),
    (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, betta_fast=3),
     "unknown keys \\['betta_fast'\\]"),
])
def test_unsupported_rope_is_one_clear_error(rope, msg):
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=53, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, rope_parameters={**rope, "rope_theta": THETA})
    with pytest.raises(ValueError, match=msg):
        ModelArgs.from_hf_config(cfg)
