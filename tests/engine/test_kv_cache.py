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


def packed(rows):
    return torch.tensor([[t for r in rows for t in r]])


@torch.no_grad()
def test_cached_decode_matches_full_forward():
    model = tiny_model()
    cache = make_cache(model)
    prompts = [[5, 6, 7, 8, 9], [3, 2], [10, 11, 12]]
    cont = [[13, 14, 15, 16], [17, 18, 19, 20], [21, 22, 23, 24]]
    slots = [cache.table.allocate() for _ in prompts]
    # packed prefill of prompts of different lengths
    attn, pos = cache.batch(slots, [len(p) for p in prompts])
    assert pos.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2]]
    logits = model(packed(prompts), pos, attn)[0]
    off = 0
    for p in prompts:
        ref = model(torch.tensor([p]))[0]
        assert torch.allclose(logits[off:off + len(p)], ref, rtol=0, atol=1e-10)
        off += len(p)
    # batched one-token decode steps (every row has one token: the dense path)
    for i in range(4):
        attn, pos = cache.batch(slots, [1] * len(slots))
        assert attn.dense
        logits = model(packed([[c[i]] for c in cont]), pos, attn)[0]
        for b, p in enumerate(prompts):
            ref = model(torch.tensor([p + cont[b][: i + 1]]))[0, -1]
            assert torch.allclose(logits[b], ref, rtol=0, atol=1e-10)
    # a mixed step: one row decodes 1 token while another appends 3 (a verify row)
    attn, pos = cache.batch(slots[:2], [1, 3])
    assert not attn.dense
    logits = model(packed([[30], [31, 32, 33]]), pos, attn)[0]
    ref0 = model(torch.tensor([prompts[0] + cont[0] + [30]]))[0, -1]
    ref1 = model(torch.tensor([prompts[1] + cont[1] + [31, 32, 33]]))[0, -3:]
    assert torch.allclose(logits[0], ref0, rtol=0, atol=1e-10)
    assert torch.allclose(logits[1:], ref1, rtol=0, atol=1e-10)


@torch.no_grad()
def test_shared_prefix_equals_own_prefill():
    model = tiny_model()
    cache = make_cache(model)
    prompt = [5, 6, 7, 8, 9]
    src, a, b = (cache.table.allocate() for _ in range(3))
    attn, pos = cache.batch([src], [4])
    model(packed([prompt[:4]]), pos, attn)
    cache.share_prefix(src, [a, b], 4)
    assert cache.table.lengths[a] == cache.table.lengths[b] == 4
    assert torch.equal(cache.k[:, a, :, :4], cache.k[:, src, :, :4]) and torch.equal(cache.v[:, b, :, :4], cache.v[:, src, :, :4])
    # the samples then go their own ways from the shared prompt
    attn, pos = cache.batch([src, a, b], [1, 2, 1])
    logits = model(packed([[9], [9, 20], [9]]), pos, attn)[0]
    ref = model(torch.tensor([prompt + [20]]))[0]
    assert torch.allclose(logits[0], ref[4], rtol=0, atol=1e-10) and torch.allclose(logits[3], ref[4], rtol=0, atol=1e-10)
    assert torch.allclose(logits[1:3], ref[4:6], rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="not empty"):
        cache.share_prefix(src, [a], 2)
    c = cache.table.allocate()
    with pytest.raises(ValueError, match="holds"):
        cache.share_prefix(a, [c], 9)


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


@torch.no_grad()
def test_move_slot_keeps_its_cache():
    model = tiny_model()
    cache = make_cache(model, slots=3)
    slots = [cache.table.allocate() for _ in range(3)]
    attn, pos = cache.batch(slots, [3, 2, 4])
    model(packed([[4, 5, 6], [7, 8], [9, 10, 11, 12]]), pos, attn)
    cache.table.free(0)
    assert cache.table.lowest_free() == 0 and cache.table.highest_used() == 2
    cache.move(2, 0)
    assert cache.table.lengths[0] == 4 and cache.table.lowest_free() == 2 and cache.table.highest_used() == 1
    attn, pos = cache.batch([0, 1], [1, 1])
    assert attn.slot_range == (0, 2)  # consecutive slots: attention reads the cache in place
    out = model(packed([[13], [14]]), pos, attn)[0]
    assert torch.allclose(out[0], model(torch.tensor([[9, 10, 11, 12, 13]]))[0, -1], rtol=0, atol=1e-10)
    assert torch.allclose(out[1], model(torch.tensor([[7, 8, 14]]))[0, -1], rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="not allocated"):
        cache.move(2, 2)
    with pytest.raises(ValueError, match="not free"):
        cache.move(0, 1)
