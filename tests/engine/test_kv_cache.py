"""Slot table bookkeeping (host only) and cached attention against a no-cache forward."""
import pytest
import torch

from megarl.engine.kv_cache import KVCache, SlotTable
from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM


def tiny_model(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    args = ModelArgs(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, model_type="qwen2", eos_token_id=1)
    return CausalLM(args).to(dtype).eval()


def make_cache(model, slots=4, seq=32):
    a = model.args
    return KVCache(a.num_hidden_layers, slots, seq, a.num_key_value_heads, a.head_dim, torch.float64, "cpu")


def test_slot_table_allocate_free_reuse():
    t = SlotTable(3, 10)
    assert [t.allocate() for _ in range(3)] == [0, 1, 2]
    assert t.n_free == 0
    with pytest.raises(RuntimeError):
        t.allocate()
    assert t.reserve([1, 2], [4, 1]) == [0, 0]
    assert t.reserve([1], [1]) == [4]
    assert t.lengths[1] == 5
    t.free(1)
    assert t.lengths[1] == 0 and t.n_free == 1
    with pytest.raises(ValueError):
        t.free(1)  # double free
    with pytest.raises(ValueError):
        t.reserve([1], [1])  # not allocated
    assert t.allocate() == 1  # reused
    t.free(2)
    t.free(0)
    assert t.allocate() == 0  # lowest free slot first
    with pytest.raises(ValueError):
        t.reserve([1], [11])  # beyond max_seq_len


@torch.no_grad()
def test_cached_decode_matches_full_forward():
    model = tiny_model()
    cache = make_cache(model)
    prompts = [[5, 6, 7, 8, 9], [3, 2], [10, 11, 12]]
    cont = [[13, 14, 15, 16], [17, 18, 19, 20], [21, 22, 23, 24]]
    slots = [cache.table.allocate() for _ in prompts]
    # padded batched prefill
    attn, pos = cache.batch(slots, [len(p) for p in prompts])
    t = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (t - len(p)) for p in prompts])
    logits = model(ids, pos, attn)
    for b, p in enumerate(prompts):
        ref = model(torch.tensor([p]))[0]
        assert torch.allclose(logits[b, : len(p)], ref, rtol=0, atol=1e-10)
    # batched one-token decode steps
    for i in range(4):
        attn, pos = cache.batch(slots, [1] * len(slots))
        logits = model(torch.tensor([[c[i]] for c in cont]), pos, attn)
        for b, p in enumerate(prompts):
            ref = model(torch.tensor([p + cont[b][: i + 1]]))[0, -1]
            assert torch.allclose(logits[b, 0], ref, rtol=0, atol=1e-10)
    # a mixed step: one row decodes 1 token while another appends 3 (chunk), padding in between
    attn, pos = cache.batch(slots[:2], [1, 3])
    logits = model(torch.tensor([[30, 0, 0], [31, 32, 33]]), pos, attn)
    ref0 = model(torch.tensor([prompts[0] + cont[0] + [30]]))[0, -1]
    ref1 = model(torch.tensor([prompts[1] + cont[1] + [31, 32, 33]]))[0, -3:]
    assert torch.allclose(logits[0, 0], ref0, rtol=0, atol=1e-10)
    assert torch.allclose(logits[1], ref1, rtol=0, atol=1e-10)


@torch.no_grad()
def test_reused_slot_ignores_stale_entries():
    model = tiny_model()
    cache = make_cache(model, slots=1)
    s = cache.table.allocate()
    attn, pos = cache.batch([s], [9])
    model(torch.arange(1, 10)[None], pos, attn)  # fills 9 positions with k/v of another request
    cache.table.free(s)
    s = cache.table.allocate()
    attn, pos = cache.batch([s], [3])
    out = model(torch.tensor([[4, 5, 6]]), pos, attn)
    assert torch.allclose(out[0], model(torch.tensor([[4, 5, 6]]))[0], rtol=0, atol=1e-10)
