"""megarl's plain-torch Llama/Qwen2 against transformers, built from the same tiny random configs."""
import json

import pytest
import torch
import transformers

from megarl.models.config import ModelArgs
from megarl.models.hf_io import load_hf_model, save_hf_model
from megarl.models.llama import CausalLM

CASES = [
    ("llama", False, False),
    ("llama", True, True),  # tied embeddings, qkv bias
    ("qwen2", False, True),
    ("qwen2", True, True),
]


def hf_model(arch: str, tie: bool, bias: bool, seed: int = 0):
    # eager attention: the reference is HF's plain math, whatever the installed default backend
    common = dict(attn_implementation="eager", vocab_size=53, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=tie, rope_theta=5000.0,
                  rms_norm_eps=1e-5, max_position_embeddings=128)
    if arch == "llama":
        cfg = transformers.LlamaConfig(attention_bias=bias, **common)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # HF inits biases/norms to constants; randomise them so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("arch,tie,bias", CASES)
def test_logits_match_transformers(arch, tie, bias):
    hf = hf_model(arch, tie, bias)
    args = ModelArgs.from_hf_config(hf.config.to_dict())
    assert args.model_type == arch and args.tie_word_embeddings == tie and args.qkv_bias == (bias or arch == "qwen2")
    ours = CausalLM(args).eval()
    sd = hf.state_dict()
    if tie:
        sd.pop("lm_head.weight")
    ours.load_state_dict(sd, strict=True)
    ids = torch.randint(0, 53, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max().item()
    assert diff <= 1e-5, diff


@pytest.mark.parametrize("arch,tie,bias", CASES[1:3])
def test_export_loads_in_transformers(tmp_path, arch, tie, bias):
    hf = hf_model(arch, tie, bias, seed=3)
    args = ModelArgs.from_hf_config(hf.config.to_dict())
    ours = CausalLM(args)
    sd = hf.state_dict()
    if tie:
        sd.pop("lm_head.weight")
    ours.load_state_dict(sd)
    out = save_hf_model(ours.state_dict(), args, tmp_path / "export")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dir left behind"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), hf.state_dict().values()))
    ids = torch.randint(0, 53, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)
    again = load_hf_model(out)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))


def test_missing_weights_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_model("qwen2", True, True).config.to_dict()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_model(tmp_path / "nowhere")


def test_unsupported_architecture_is_rejected():
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelArgs.from_hf_config({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10})


def test_rope_settings_in_both_config_layouts():
    base = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    assert ModelArgs.from_hf_config({**base, "rope_theta": 5000.0}).rope_theta == 5000.0  # transformers 4.x
    v5 = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 123.0}}  # transformers 5.x
    assert ModelArgs.from_hf_config(v5).rope_theta == 123.0
    with pytest.raises(ValueError, match="rope_type='linear' is not supported"):
        ModelArgs.from_hf_config({**base, "rope_scaling": {"rope_type": "linear", "factor": 4.0}})
