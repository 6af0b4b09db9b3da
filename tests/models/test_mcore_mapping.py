"""HF <-> Megatron-core name mapping: bitwise round trip, layout, and loud errors."""
import pytest
import torch

from megarl.models import mcore_mapping as mm
from megarl.models.llama import CausalLM

CASES = [("qwen2", False), ("qwen2", True), ("llama", False), ("llama", True)]


def random_hf(args, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g, dtype=dtype) for k, s in mm.hf_shapes(args).items()}


@pytest.mark.parametrize("model_type,tie", CASES)
def test_round_trip_bitwise(make_args, model_type, tie):
    args = make_args(model_type, tie=tie)
    assert set(mm.hf_shapes(args)) == set(CausalLM(args).state_dict())  # names CausalLM uses
    hf = random_hf(args, dtype=torch.float64)
    mc = mm.hf_to_mcore(hf, args)
    assert {k: tuple(v.shape) for k, v in mc.items()} == mm.mcore_shapes(args)
    back = mm.mcore_to_hf(mc, args)
    assert back.keys() == hf.keys()
    for k in hf:
        assert back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]), k
    # and the other direction, with Megatron's _extra_state entries ignored
    mc2 = mm.hf_to_mcore(back, args)
    mc_extra = {**mc, "decoder.layers.0.mlp.linear_fc1._extra_state": None}
    assert all(torch.equal(mm.hf_to_mcore(mm.mcore_to_hf(mc_extra, args), args)[k], mc2[k]) for k in mc)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_qkv_layout_is_per_group(make_args, kv_heads):
    """Group g of linear_qkv holds query heads g*r..g*r+r-1, then k_g, then v_g."""
    args = make_args("qwen2", num_key_value_heads=kv_heads)
    hf = random_hf(args)
    qkv = mm.hf_to_mcore(hf, args)["decoder.layers.1.self_attention.linear_qkv.weight"]
    d, r = args.head_dim, args.num_attention_heads // kv_heads
    q = hf["model.layers.1.self_attn.q_proj.weight"]
    k = hf["model.layers.1.self_attn.k_proj.weight"]
    v = hf["model.layers.1.self_attn.v_proj.weight"]
    for g in range(kv_heads):
        blk = qkv[g * (r + 2) * d:(g + 1) * (r + 2) * d]
        assert torch.equal(blk[:r * d], q[g * r * d:(g + 1) * r * d])
        assert torch.equal(blk[r * d:(r + 1) * d], k[g * d:(g + 1) * d])
        assert torch.equal(blk[(r + 1) * d:], v[g * d:(g + 1) * d])


def test_errors_name_the_tensor(make_args):
    args = make_args("qwen2")
    hf = random_hf(args)
    bad = dict(hf)
    del bad["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        mm.hf_to_mcore(bad, args)
    bad = {**hf, "model.layers.9.foo": torch.zeros(1)}
    with pytest.raises(KeyError, match="model.layers.9.foo"):
        mm.hf_to_mcore(bad, args)
    bad = {**hf, "model.norm.weight": torch.zeros(31)}
    with pytest.raises(ValueError, match="model.norm.weight"):
        mm.hf_to_mcore(bad, args)
    mc = mm.hf_to_mcore(hf, args)
    del mc["output_layer.weight"]
    with pytest.raises(KeyError, match="output_layer.weight"):
        mm.mcore_to_hf(mc, args)


def test_tied_accepts_equal_lm_head(make_args):
    args = make_args("llama", tie=True)
    hf = random_hf(args)
    mc = mm.hf_to_mcore({**hf, "lm_head.weight": hf["model.embed_tokens.weight"].clone()}, args)
    assert "output_layer.weight" not in mc
    with pytest.raises(ValueError, match="lm_head.weight"):
        mm.hf_to_mcore({**hf, "lm_head.weight": torch.zeros(40, 32)}, args)
