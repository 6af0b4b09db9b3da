"""Sliding-window attention (HF Qwen2/Qwen3/Qwen3-MoE/Mixtral semantics: which layers, window size)
in megarl's plain-torch model against transformers, on sequences several windows long."""
import pytest
import torch
import transformers

from megarl.models.config import ModelArgs
from megarl.models.hf_io import load_hf_model
from megarl.models.llama import CausalLM, causal_attention

WINDOW = 7
COMMON = dict(attn_implementation="eager", vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128,
              sliding_window=WINDOW)
# family -> (HF config, layers that slide)
CASES = {
    "qwen2": (lambda: transformers.Qwen2Config(use_sliding_window=True, max_window_layers=1, **COMMON), [1, 2]),
    "qwen3": (lambda: transformers.Qwen3Config(
        use_sliding_window=True, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        **COMMON), [0, 2]),
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(
        use_sliding_window=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, **COMMON), [0, 1, 2]),
    "mixtral": (lambda: transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **COMMON), [0, 1, 2]),
}


def hf_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CASES[family][0]()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and "experts" not in name:  # sharp router, no near-ties
                p.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("family", sorted(CASES))
def test_sliding_window_logits_match_transformers(tmp_path, family):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "hf")  # megarl's loader maps HF 5's fused MoE experts
    ours = load_hf_model(tmp_path / "hf", torch.float32).eval()
    args = ours.args
    assert args.sliding_window == WINDOW
    assert [i for i in range(args.num_hidden_layers) if args.window(i) is not None] == CASES[family][1]
    ids = torch.randint(0, 53, (2, 6 * WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        diff = (ours(ids) - want).abs().max().item()
        full_diff = (ours(ids, attn=_FullCausal()) - want).abs().max().item()
    assert diff <= 1e-5, diff
    assert full_diff > 1e-3, "the window does not change these logits: the test would not see it ignored"


class _FullCausal:
    handles_window = True  # claims windows but applies none: what megarl did before windows

    def __call__(self, layer_idx, q, k, v):
        return causal_attention(layer_idx, q, k, v)


@pytest.mark.parametrize("family", sorted(CASES))
def test_sliding_window_hf_config_round_trip(family):
    hf = hf_model(family)
    args = ModelArgs.from_hf_config(hf.config.to_dict())
    assert ModelArgs.from_hf_config(args.to_hf_config()) == args
    back = type(hf.config)(**args.to_hf_config())
    assert back.sliding_window == WINDOW
    assert getattr(back, "layer_types", None) == getattr(hf.config, "layer_types", None)


def test_window_off_and_bad_windows():
    cfg = CASES["qwen2"][0]().to_dict()
    assert ModelArgs.from_hf_config({**cfg, "use_sliding_window": False}).sliding_window is None
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        ModelArgs.from_hf_config({**cfg, "sliding_window": 0})
    with pytest.raises(ValueError, match="must name 3 layers"):
        ModelArgs.from_hf_config({**cfg, "layer_types": ["sliding_attention"] * 2})
    with pytest.raises(ValueError, match="does not apply windows"):
        CausalLM(ModelArgs.from_hf_config(cfg))(torch.zeros(1, 3, dtype=torch.long), attn=causal_attention)
