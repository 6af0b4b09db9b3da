"""Rollout tensor parallelism: the slicing rule and its errors in-process; TP=2 over gloo (one
2-process launch, see tp_worker.py): logits equal TP=1's, engine tokens identical to TP=1's."""
from pathlib import Path

import pytest
import torch

from megarl.engine.tp_model import check_tp, tp_divisors, tp_shard, tp_slice, tp_split, vocab_range
from megarl.models.config import SUPPORTED_ARCHITECTURES, ModelArgs
from megarl.models.llama import CausalLM, attention
from tests.torchrun import torchrun

ARGS = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def test_tp_slice_pieces_rebuild_every_tensor():
    torch.manual_seed(0)
    variants = [dict(model_type="qwen2", tie_word_embeddings=True), dict(model_type="llama", attention_bias=True)]
    if "qwen3" in SUPPORTED_ARCHITECTURES.values():  # per-head q/k norms: replicated
        variants.append(dict(model_type="qwen3"))
    for kw in variants:
        full = CausalLM(ModelArgs(**ARGS, **kw)).state_dict()
        pieces = [tp_shard(full, r, 2) for r in range(2)]
        for name, t in full.items():
            kind = tp_split(name)
            if kind == "replicated":
                assert all(p[name] is t for p in pieces)
            else:
                dim = 1 if kind == "row" else 0
                assert all(p[name].shape[dim] == t.shape[dim] // 2 for p in pieces)
                assert torch.equal(torch.cat([p[name] for p in pieces], dim), t), name
        assert tp_split("model.layers.1.self_attn.o_proj.bias") == "replicated"  # added once after the sum
        assert tp_split("lm_head.weight") == tp_split("model.embed_tokens.weight") == "vocab"


def test_contiguous_head_blocks_keep_gqa_groups():
    """Query head h reads KV head h // (Hq/Hkv): attention over rank r's block of query heads and
    its block of KV heads is exactly those heads' part of the full attention (tp = 2 and 4)."""
    torch.manual_seed(0)
    hq, hkv, d = 8, 4, 8
    q, k, v = torch.randn(2, 5, hq, d, dtype=torch.float64), *torch.randn(2, 2, 5, hkv, d, dtype=torch.float64)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    full = attention(q, k, v, mask)
    for tp in (2, 4):
        for r in range(tp):
            qs, ks = slice(r * hq // tp, (r + 1) * hq // tp), slice(r * hkv // tp, (r + 1) * hkv // tp)
            assert torch.equal(attention(q[:, :, qs], k[:, :, ks], v[:, :, ks], mask), full[:, :, qs])


def test_divisibility_errors_name_the_field_and_valid_sizes():
    args = ModelArgs(**ARGS)  # 4 heads, 2 KV heads, ff 64, vocab 40
    assert tp_divisors(args) == [1, 2]
    check_tp(args, 2)
    with pytest.raises(ValueError, match=r"tp=3 does not divide num_attention_heads=4; .*: \[1, 2\]"):
        check_tp(args, 3)
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_key_value_heads=2; .*: \[1, 2\]"):
        check_tp(args, 4)
    with pytest.raises(ValueError, match=r"tp=2 does not divide intermediate_size=63; .*: \[1\]"):
        check_tp(ModelArgs(**{**ARGS, "intermediate_size": 63}), 2)
    check_tp(ModelArgs(**{**ARGS, "vocab_size": 41}), 2)  # uneven vocab pieces are fine
    with pytest.raises(ValueError, match=r"tp=2 leaves the last rank no rows of vocab_size=1"):
        check_tp(ModelArgs(**{**ARGS, "vocab_size": 1}), 2)
    with pytest.raises(ValueError, match="tp=0 is invalid"):
        check_tp(args, 0)
    args.model_type = "mixtral"  # (set after validation: only the TP check is under test)
    with pytest.raises(ValueError, match=r"does not cover model_type='mixtral' \(MoE layers\)"):
        check_tp(args, 1)
    with pytest.raises(ValueError, match="not a parameter name of a dense"):
        tp_slice("model.layers.0.self_attn.qkv.weight", torch.zeros(4, 4), 0, 2)
    with pytest.raises(ValueError, match="tp_rank=2 is invalid for tp_size=2"):
        tp_slice("lm_head.weight", torch.zeros(4, 4), 2, 2)
    with pytest.raises(ValueError, match="q_proj.weight has 5 entries along dim 0, not divisible by tp_size=2"):
        tp_slice("model.layers.0.self_attn.q_proj.weight", torch.zeros(5, 4), 0, 2)


def test_uneven_vocab_pieces_cover_the_vocab_once():
    for v, tp, want in ((40, 2, [20, 20]), (41, 2, [21, 20]), (27, 4, [7, 7, 7, 6]), (10, 3, [4, 4, 2])):
        ranges = [vocab_range(v, r, tp) for r in range(tp)]
        assert [n for _, n in ranges] == want
        assert [s for s, _ in ranges] == [sum(want[:r]) for r in range(tp)]
    full = torch.arange(41 * 2).view(41, 2)
    assert torch.equal(torch.cat([tp_slice("lm_head.weight", full, r, 2) for r in range(2)]), full)


def test_tp2_logits_and_tokens_equal_tp1():
    """2 gloo processes, fp64: logits within 1e-12 of TP=1 (3 model variants); Engine.generate
    token-identical to TP=1, with and without speculation, on both ranks (tp_worker.py)."""
    torchrun(Path(__file__).with_name("tp_worker.py"), 2, timeout=120)
