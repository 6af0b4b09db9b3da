"""Megatron-core GPTModel built from ModelArgs == megarl's CausalLM with the same HF weights."""
import pytest
import torch

from megarl.models import mcore_mapping as mm
from megarl.models.llama import CausalLM
from megarl.trainer.model import build_gpt_model, gpt_logits


def reference(args, seed, dtype=torch.float32):
    torch.manual_seed(seed)
    ref = CausalLM(args)
    with torch.no_grad():  # non-trivial norms and biases, so a mapping slip would show
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    return ref.to(dtype)


@pytest.mark.parametrize("model_type,tie", [("qwen2", False), ("llama", True), ("llama", False)])
def test_logits_match_causal_lm(dims, make_args, model_type, tie):
    args = make_args(model_type, tie=tie)
    ref = reference(args, seed=1)
    model = build_gpt_model(args, dims, torch.float32, seed=0)
    missing, unexpected = model.load_state_dict(mm.hf_to_mcore(ref.hf_state_dict(), args), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    ids = torch.randint(0, args.vocab_size, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = gpt_logits(model, ids).cpu(), ref(ids)
    assert got.shape == want.shape == (3, 11, args.vocab_size)
    assert (got - want).abs().max().item() <= 1e-5


def test_logits_match_fp64(dims, make_args):
    args = make_args("qwen2")
    ref = reference(args, seed=3, dtype=torch.float64)
    model = build_gpt_model(args, dims, torch.float64, seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    model.load_state_dict(mm.hf_to_mcore(ref.hf_state_dict(), args), strict=False)
    ids = torch.randint(0, args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (gpt_logits(model, ids).cpu() - ref(ids)).abs().max().item() <= 1e-12


def test_seeded_init_is_deterministic(dims, make_args):
    args = make_args("qwen2")
    a = build_gpt_model(args, dims, seed=7).state_dict()
    b = build_gpt_model(args, dims, seed=7).state_dict()
    c = build_gpt_model(args, dims, seed=8).state_dict()
    key = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(a[key], b[key]) and not torch.equal(a[key], c[key])
