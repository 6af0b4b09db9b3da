"""RoPE as the model applies it (signed sin, q and k rotated together) is HF's, bit for bit."""
import pytest
import torch

from megarl.models.llama import apply_rope, rope_cos_sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_signed_sin_rope_equals_hf_rotate_half(dtype):
    from transformers.models.llama.modeling_llama import rotate_half

    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([[0, 1, 7, 300], [5, 6, 1000, 4095]])
    cos, sin_signed = rope_cos_sin(pos, 64, 1e5, dtype)
    # HF's cos/sin: the same frequencies, sin unsigned
    inv = 1.0 / (1e5 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    emb = torch.cat([pos.float()[..., None] * inv] * 2, dim=-1)[:, :, None, :]
    hf_cos, hf_sin = emb.cos().to(dtype), emb.sin().to(dtype)
    assert torch.equal(cos, hf_cos)
    q = (torch.randn(2, 4, 9, 64, generator=g) * 4).to(dtype)
    k = (torch.randn(2, 4, 3, 64, generator=g) * 4).to(dtype)
    want_q, want_k = q * hf_cos + rotate_half(q) * hf_sin, k * hf_cos + rotate_half(k) * hf_sin
    assert torch.equal(apply_rope(q, cos, sin_signed), want_q)
    # q and k rotated in one call over their heads side by side, as the fused attention does
    both = apply_rope(torch.cat([q, k], dim=2), cos, sin_signed)
    assert torch.equal(both[:, :, :9], want_q) and torch.equal(both[:, :, 9:], want_k)
