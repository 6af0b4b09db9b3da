"""Packed linears (megarl/models/packed_linear.py): a row's bits do not depend on how many rows
share the matmul (from 2 rows up; the engine gives a lone row a twin), values within rounding of
``F.linear``, ``F.linear`` itself outside an engine forward, and weights written after packing are
seen by the next forward."""
import copy

import pytest
import torch
import torch.nn.functional as F

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.models import packed_linear
from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="torch built without oneDNN")

# SmolLM2-135M's linears (fused q/k/v, o, fused gate/up, down; an LM head cut to 8192 rows) and the
# tiny model's, with a bias on some: the shapes the CPU engine runs.
SHAPES = [(960, 576, False), (576, 576, False), (3072, 576, False), (576, 1536, False), (8192, 576, False),
          (384, 128, True), (128, 128, False), (1024, 128, False), (128, 512, False)]
ROW_COUNTS = list(range(2, 34)) + [63, 64, 65, 127, 129, 200]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_row_count(dtype):
    """Rows computed among m others equal the same rows computed among 240, for every shape and
    row count: the property that makes speculative decoding (verify rows) give plain decoding's
    logits. torch's fp32 ``F.linear`` (MKL) lacks it on this project's CPUs below 12 rows."""
    g = torch.Generator().manual_seed(0)
    packs = packed_linear.PackedLinears(torch.nn.Module())
    for n_out, n_in, has_bias in SHAPES:
        w = (torch.randn(n_out, n_in, generator=g) * 0.05).to(dtype)
        bias = (torch.randn(n_out, generator=g) * 0.1).to(dtype) if has_bias else None
        x = (torch.randn(240, n_in, generator=g) * (1 + 3 * torch.rand(240, 1, generator=g))).to(dtype)
        with packs.active():
            full = packed_linear.linear(x, w, bias)
            for m in ROW_COUNTS:
                for start in (0, 240 - m):
                    part = packed_linear.linear(x[start:start + m], w, bias)
                    assert torch.equal(part, full[start:start + m]), (dtype, n_out, n_in, m, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_values_are_f_linear_within_rounding_and_f_linear_outside(dtype):
    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(300, 128, generator=g).to(dtype), torch.randn(300, generator=g).to(dtype)
    x = torch.randn(2, 5, 128, generator=g).to(dtype)  # [B, T, H] as the model passes it
    ref = F.linear(x.double(), w.double(), bias.double())
    with packed_linear.PackedLinears(torch.nn.Module()).active():
        packed = packed_linear.linear(x, w, bias)
        wide = packed_linear.linear(x.double(), w.double(), bias.double())  # fp64: not packed
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert packed.shape == (2, 5, 300) and torch.allclose(packed.double(), ref, atol=tol * 10, rtol=tol)
    assert torch.equal(wide, ref)
    assert torch.equal(packed_linear.linear(x, w, bias), F.linear(x, w, bias))  # no engine forward: F.linear


def _model(seed: int) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(ModelArgs(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, eos_token_id=1,
                              model_type="qwen2")).eval()


def _tokens(engine: Engine) -> list[list[int]]:
    reqs = [Request(uid=u, sample_idx=0, prompt_ids=[3, 4, 5 + u],
                    params=SamplingParams(temperature=1.0, max_new_tokens=12)) for u in range(3)]
    return [r.tokens for r in engine.generate(reqs, step=0)]


def test_engine_uses_packed_linears_and_sees_weights_written_after():
    """Weights written after the first forward (``load_weights``; ``copy_`` into the parameters)
    reach the next one: it samples what a fresh engine on the new weights samples."""
    cfg = EngineConfig(max_batch_size=4, max_seq_len=32)
    a, b = _model(0), _model(1)
    engine = Engine(copy.deepcopy(a), cfg, seed=3)
    assert engine.packs is not None and engine.pad_single_row
    first = _tokens(engine)
    assert first == _tokens(Engine(copy.deepcopy(a), cfg, seed=3))
    fresh_b = _tokens(Engine(copy.deepcopy(b), cfg, seed=3))
    assert fresh_b != first  # the check below can fail
    engine.load_weights(b.state_dict())
    assert _tokens(engine) == fresh_b
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            p.copy_(dict(a.named_parameters())[name])
    assert _tokens(engine) == first
    off = Engine(copy.deepcopy(a), EngineConfig(max_batch_size=4, max_seq_len=32, cpu_packed_linears=False), seed=3)
    assert off.packs is None and not off.pad_single_row
