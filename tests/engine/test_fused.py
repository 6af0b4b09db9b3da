"""Fused q/k/v and gate/up projections (llama.fuse_linears): the same logits as the separate
linears, bit for bit, and the fused weights stay the parameters the weight sync writes."""
import copy

import pytest
import torch

from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM

# Widths as in real models (head_dim 64, inner sizes multiples of 32): there an elementwise op on
# a column slice of the fused output (silu of the gate half, q-norm of the q part) runs the same
# vectorized loop as on a separate linear's output. (With a row of, e.g., 48 floats the strided
# slice ends in a scalar remainder that the contiguous tensor vectorizes: values differ in the last
# bit, still batch-invariant, which is what the exactness contract needs.)
BASE = dict(vocab_size=50, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, eos_token_id=1)
KINDS = {
    "qwen2": dict(model_type="qwen2"),  # q/k/v biases
    "llama": dict(model_type="llama"),
    "qwen3": dict(model_type="qwen3"),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
}


def _model(kind: str, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    args = ModelArgs(**BASE, **KINDS[kind])
    model = CausalLM(args)
    with torch.no_grad():  # nonzero biases, so that a bias lost in fusing shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(KINDS))
def test_fused_logits_equal_separate(kind, dtype):
    plain = _model(kind).to(dtype)
    fused = copy.deepcopy(plain).fuse_projections()
    assert fused.model.layers[0].self_attn._qkv is not None
    ids = torch.randint(0, BASE["vocab_size"], (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for rows in (ids[:1, :1], ids[:1], ids):  # one token (GEMV), one row, a batch
            assert torch.equal(fused(rows), plain(rows)), (kind, dtype, tuple(rows.shape))


def test_fused_parameters_keep_names_and_take_new_weights():
    """``copy_`` into a fused model's parameters (what load_weights / the weight sync do) reaches
    the fused matmul; ``.to()`` after fusing falls back to the separate linears, still correct."""
    fused = _model("qwen2").fuse_projections()
    other = _model("qwen2", seed=5)
    assert set(fused.state_dict()) == set(other.state_dict())
    with torch.no_grad():
        for k, v in fused.state_dict().items():
            v.copy_(other.state_dict()[k])
    ids = torch.randint(0, BASE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.equal(fused(ids), other(ids))
        moved = fused.to(torch.float64)  # replaces the views: the layers must notice
        assert torch.equal(moved(ids), other.to(torch.float64)(ids))
        moved.fuse_projections()  # fp64 GEMMs of another width may sum in another order: 1e-15
        assert moved.model.layers[0].self_attn._qkv[0].dtype == torch.float64
        torch.testing.assert_close(moved(ids), other(ids), rtol=0, atol=1e-12)
