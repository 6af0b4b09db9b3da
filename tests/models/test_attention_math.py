"""The attention math the engine and the trainer's ``eager`` attention share
(megarl/models/llama.py): a row's bits depend on that row only, not on how many hidden keys pad it
or on which rows share its batch, and the norm is Megatron's (one rounding)."""
import pytest
import torch

from megarl.models.llama import MIN_SOFTMAX_KEYS, RMSNorm, grouped_attention, masked_softmax


def test_softmax_row_does_not_depend_on_hidden_keys():
    """Rows shorter than one vector are where torch's CPU softmax changes its order: keys 1..40,
    padded with 1..40 hidden ones."""
    g = torch.Generator().manual_seed(0)
    for s in range(1, 41):
        scores = torch.randn(4, s, generator=g) * 6
        alone = masked_softmax(scores, torch.zeros(s, dtype=torch.bool), torch.float32)
        for pad in (1, 7, 16, 40):
            padded = torch.cat((scores, torch.randn(4, pad, generator=g)), -1)
            hidden = torch.arange(s + pad) >= s
            got = masked_softmax(padded, hidden, torch.float32)
            assert torch.equal(got[:, :s], alone), (s, pad)
            assert torch.equal(got[:, s:], torch.zeros(4, pad))


def _qkv(b, t, s, hq=6, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, t, hq, d, generator=g) * 2).bfloat16()
    k = (torch.randn(b, hkv, s, d, generator=g) * 2).bfloat16()
    v = torch.randn(b, hkv, s, d, generator=g).bfloat16()
    return q, k, v


@pytest.mark.parametrize("n_keys", [3, 9, 15, 16, 23, 70])
def test_grouped_attention_row_is_its_own_in_bf16(n_keys):
    """A decode row (one query over its n_keys keys) gives the same bf16 bits alone, inside a
    batch whose longest row has more keys, and as one row of a full causal pass over a longer
    padded sequence (the trainer's ``eager`` attention); 8 draws."""
    width, p = n_keys + 29, n_keys - 1  # p: the query's position
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    lengths = torch.tensor([width, n_keys, 5])
    for seed in range(8):
        q, k, v = _qkv(1, width, width, seed=seed)
        alone = grouped_attention(q[:, p:p + 1], k[:, :, :n_keys], v[:, :, :n_keys],
                                  torch.zeros(1, 1, n_keys, dtype=torch.bool))
        others = _qkv(2, 1, width, seed=100 + seed)
        qb, kb, vb = (torch.cat((x[:1], y, x[1:]), 0) for x, y in zip(others, (q[:, p:p + 1], k, v)))
        batch = grouped_attention(qb, kb, vb, torch.arange(width)[None, None, :] >= lengths[:, None, None])
        assert torch.equal(batch[1:2], alone), seed
        full = grouped_attention(q, k, v, ~causal[None])
        assert torch.equal(full[:, p:p + 1], alone), seed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_is_megatrons(dtype):
    """Megatron's torch-only norm is ``torch.nn.RMSNorm``: the engine's norm gives its bits."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    ours, theirs = RMSNorm(96, 1e-5).to(dtype), torch.nn.RMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        w = (1 + torch.randn(96, generator=g) / 4).to(dtype)
        ours.weight.copy_(w), theirs.weight.copy_(w)
        assert torch.equal(ours(x), theirs(x))


def test_min_softmax_keys_covers_a_vector():
    assert MIN_SOFTMAX_KEYS >= 16  # fp32 lanes of AVX-512, the widest CPU vector torch uses
