"""Engine: exactness (batch invariance), stopping, slot reuse, logprobs, weight loading."""
import random

import pytest
import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM

ARGS = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, model_type="qwen2", eos_token_id=1)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return CausalLM(ModelArgs(**ARGS))


def engine(max_batch_size=4, max_seq_len=64, seed=1234, dtype="float64", model_seed=0, **cfg):
    return Engine(tiny_model(model_seed), EngineConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                                       dtype=dtype, **cfg), seed=seed)


def mixed_requests(n=16):
    rng = random.Random(0)
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=5),
             dict(temperature=1.2, top_p=0.7), dict(temperature=0.9, top_k=8, top_p=0.9)]
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(2, 40) for _ in range(rng.randint(1, 9))]
        params = SamplingParams(max_new_tokens=rng.randint(1, 14), stop_token_ids=(1,), **kinds[i % len(kinds)])
        reqs.append(Request(uid=100 + i // 2, sample_idx=i % 2, prompt_ids=prompt, params=params))
    return reqs


def key(r):
    return (r.uid, r.sample_idx, tuple(r.tokens), r.finish_reason)


def test_batch_invariance_and_order_invariance():
    reqs = mixed_requests()
    eng = engine(max_batch_size=4)
    batched = eng.generate(reqs, step=5)
    assert eng.stats["forwards"] < sum(r.n_forwards for r in batched)  # rows really shared forwards
    # alone: one request per generate call
    solo = [engine(max_batch_size=4).generate([r], step=5)[0] for r in reqs]
    assert [key(r) for r in batched] == [key(r) for r in solo]
    for b, s in zip(batched, solo):
        assert b.logprobs == pytest.approx(s.logprobs, abs=1e-12)
    # shuffled request order and a different batch limit
    perm = list(range(len(reqs)))
    random.Random(1).shuffle(perm)
    shuffled = engine(max_batch_size=3).generate([reqs[i] for i in perm], step=5)
    assert [key(shuffled[perm.index(i)]) for i in range(len(reqs))] == [key(r) for r in batched]
    # results come back in request order
    assert [(r.uid, r.sample_idx) for r in shuffled] == [(reqs[i].uid, reqs[i].sample_idx) for i in perm]
    # the step is part of the noise: another step gives other samples for the sampled requests
    other = engine(max_batch_size=4).generate(reqs, step=6)
    assert [key(r) for r in other] != [key(r) for r in batched]
    assert all(key(o) == key(b) for o, b, r in zip(other, batched, reqs) if r.params.temperature == 0)


def test_logprobs_and_entropies_match_full_forward():
    eng = engine()
    reqs = [Request(0, 0, [3, 4, 5], SamplingParams(temperature=0.7, max_new_tokens=6)),
            Request(1, 0, [9], SamplingParams(temperature=0.0, max_new_tokens=6))]
    for req, res in zip(reqs, eng.generate(reqs, step=0)):
        seq = torch.tensor([req.prompt_ids + res.tokens])
        with torch.no_grad():
            logits = eng.model(seq)[0, len(req.prompt_ids) - 1: -1]
        t = req.params.temperature or 1.0
        logp = torch.log_softmax(logits / t, -1)
        assert res.logprobs == pytest.approx(logp.gather(1, torch.tensor(res.tokens)[:, None])[:, 0].tolist(),
                                             abs=1e-10)
        assert res.entropies == pytest.approx((-(logp.exp() * logp).sum(-1)).tolist(), abs=1e-10)
        if req.params.temperature == 0:
            assert res.tokens == logits.argmax(-1).tolist()


def test_stop_token_and_length_limits():
    eng = engine()
    req = Request(7, 0, [2, 3], SamplingParams(temperature=1.0, max_new_tokens=20))
    free = eng.generate([req], step=0)[0]
    assert free.finish_reason == "length" and len(free.tokens) == 20 and free.n_forwards == 20
    # make the 6th sampled token a stop token: output is the same prefix, stopping right there
    stop = free.tokens[5]
    first = free.tokens.index(stop)
    req_stop = Request(7, 0, [2, 3], SamplingParams(temperature=1.0, max_new_tokens=20, stop_token_ids=(stop,)))
    res = eng.generate([req_stop], step=0)[0]
    assert res.finish_reason == "stop" and res.tokens == free.tokens[: first + 1]
    assert res.n_forwards == first + 1
    # max_seq_len bounds prompt + response
    short = engine(max_seq_len=8).generate([req], step=0)[0]
    assert short.finish_reason == "length" and len(short.tokens) == 6 and short.tokens == free.tokens[:6]
    with pytest.raises(ValueError, match="prompt length"):
        engine(max_seq_len=8).generate([Request(0, 0, list(range(2, 10)), SamplingParams())], step=0)


def test_results_carry_their_sampling_temperature():
    """Each result names the temperature it was sampled at (the trainer checks it scores there):
    greedy, T = 1 and other temperatures, in one batch; aborted requests too."""
    reqs = mixed_requests(10)
    out = engine().generate(reqs, step=3)
    assert [r.temperature for r in out] == [q.params.temperature for q in reqs]
    assert {r.temperature for r in out} == {0.0, 1.0, 0.8, 1.2, 0.9}
    aborted = engine().generate(reqs, step=3, should_stop=lambda: True)
    assert [(r.finish_reason, r.temperature) for r in aborted] == [("aborted", q.params.temperature) for q in reqs]


def test_eos_stop():
    # vocab 40 at a high temperature: EOS (id 1) shows up within 50 tokens for most requests
    eng = engine()
    reqs = [Request(i, 0, [5 + i], SamplingParams(temperature=1.5, max_new_tokens=50, stop_token_ids=(1,)))
            for i in range(6)]
    res = eng.generate(reqs, step=0)
    stopped = [r for r in res if r.finish_reason == "stop"]
    assert len(stopped) >= 2
    for r in stopped:
        assert r.tokens[-1] == 1 and 1 not in r.tokens[:-1]
    for r in res:
        assert r.finish_reason == "stop" or (len(r.tokens) == 50 and 1 not in r.tokens)


def test_slots_are_reused_and_counters():
    eng = engine(max_batch_size=3)
    reqs = [Request(i, j, [2 + i, 3], SamplingParams(temperature=1.0, max_new_tokens=3 + i))
            for i in range(5) for j in range(2)]
    res = eng.generate(reqs, step=1, progress=True)
    assert all(r.finish_reason == "length" and len(r.tokens) == r_.params.max_new_tokens
               for r, r_ in zip(res, reqs))
    assert eng.cache.table.n_free == 3 and all(n == 0 for n in eng.cache.table.lengths)
    assert eng.stats["target_forwards"] == sum(r.n_forwards for r in res) == eng.stats["tokens"]
    assert all(r.n_forwards == len(r.tokens) for r in res)
    # a second call on the same engine (slots already recycled) reproduces the first
    assert [r.tokens for r in eng.generate(reqs, step=1)] == [r.tokens for r in res]
    with pytest.raises(ValueError, match="duplicate"):
        eng.generate(reqs + reqs[:1], step=1)


def test_load_weights():
    eng = engine(model_seed=0)
    src = tiny_model(seed=5).double()
    req = [Request(0, 0, [3, 4], SamplingParams(temperature=0.0, max_new_tokens=8))]
    ref = Engine(tiny_model(seed=5), EngineConfig(max_batch_size=2, max_seq_len=64, dtype="float64"), seed=1)
    before = eng.generate(req, step=0)[0].tokens
    eng.load_weights({k: v.float() for k, v in src.hf_state_dict().items()})  # cast on load
    assert eng.model.model.embed_tokens.weight.dtype == torch.float64
    after = eng.generate(req, step=0)[0].tokens
    assert after == ref.generate(req, step=0)[0].tokens
    assert after != before
    named = src.hf_state_dict()
    missing = {k: v for k, v in named.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="lm_head.weight"):
        eng.load_weights(missing)
    with pytest.raises(ValueError, match="bogus"):
        eng.load_weights({**named, "bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        eng.load_weights({**named, "model.norm.weight": torch.zeros(3)})


def test_engine_config_validation():
    for kw, name in [(dict(max_batch_size=0), "max_batch_size"), (dict(max_seq_len=1), "max_seq_len"),
                     (dict(dtype="float16"), "dtype"), (dict(device="tpu"), "device")]:
        with pytest.raises(ValueError, match=name):
            EngineConfig(**kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_low_precision_dtypes_run(dtype):
    eng = engine(dtype=dtype)
    assert eng.model.lm_head.weight.dtype == getattr(torch, dtype) and eng.cache.k.dtype == getattr(torch, dtype)
    reqs = [Request(i, 0, [2 + i] * (1 + i), SamplingParams(temperature=1.0, max_new_tokens=5)) for i in range(5)]
    res = eng.generate(reqs, step=0)
    assert all(len(r.tokens) == 5 and all(0 <= t < 40 for t in r.tokens) for r in res)
    assert all(torch.isfinite(torch.tensor(r.logprobs + r.entropies)).all() for r in res)


def test_cpu_engine_never_runs_a_one_row_linear():
    """On CPU, bf16 or packed linears: a request decoding alone carries a twin row
    (``Engine._forward``), so every linear and the LM head see >= 2 rows; the tokens, logprobs and
    cache are those of the request decoded inside a batch. fp32 on ``F.linear`` runs single rows as
    they are (a twin would double their cost there and not make MKL's fp32 GEMMs row-count
    invariant: rows past the last multiple of 4 of a GEMM of < 12 rows take another kernel)."""
    reqs = [r for r in mixed_requests() if r.params.max_new_tokens >= 6][:4]
    for dtype, packed, padded in (("bfloat16", True, True), ("bfloat16", False, True), ("float32", True, True),
                                  ("float32", False, False)):
        eng = engine(max_batch_size=4, dtype=dtype, cpu_packed_linears=packed)
        assert eng.pad_single_row is padded and (eng.packs is not None) is packed
        rows = []
        hs, lg = eng.model.hidden_states, eng.model.logits
        eng.model.hidden_states = lambda ids, pos, attn: (rows.append(ids.shape[1]), hs(ids, pos, attn))[1]
        eng.model.logits = lambda h: (rows.append(h.shape[0]), lg(h))[1]
        alone = [eng.generate([r], step=5)[0] for r in reqs]
        assert (min(rows) >= 2) is padded, (dtype, sorted(set(rows)))
        del eng.model.hidden_states, eng.model.logits
        together = engine(max_batch_size=4, dtype=dtype, cpu_packed_linears=packed).generate(reqs, step=5)
        assert [key(r) for r in alone] == [key(r) for r in together], (dtype, packed)
        if dtype == "bfloat16":  # bitwise; fp32 attention's GEMMs vary in the last bit with the key
            # count on this CPU (MKL, few rows: docs/benchmarks.md "Prepacked linears"), so only close
            assert [r.logprobs for r in alone] == [r.logprobs for r in together], (dtype, packed)
        else:
            assert torch.allclose(torch.tensor([lp for r in alone for lp in r.logprobs]),
                                  torch.tensor([lp for r in together for lp in r.logprobs]), rtol=0, atol=1e-5)
