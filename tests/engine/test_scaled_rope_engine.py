"""The engine with scaled RoPE (HF rope_type llama3 / yarn), past the original context: sampled
tokens and logprobs are the plain model's full forward over the same sequence (fp64, up to
rounding), and that forward is transformers' (up to HF's fp32 RoPE frequencies), on the slot and
the paged KV cache, the static-shape step and the speculative verify path."""
import pytest
import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM
from megarl.spec.config import SpecConfig
from megarl.spec.speculator import Speculator
from tests.models.test_rope_scaling import ROPES, hf_model
from tests.spec.test_spec_engine import Scripted

LAYOUTS = {"slots": dict(kv_cache="slots"), "paged": dict(kv_cache="paged"),
           "paged_static": dict(kv_cache="paged", static_shapes=True)}


def requests():
    g = torch.Generator().manual_seed(3)
    out = []
    for i, (n, t) in enumerate([(40, 0.0), (33, 1.0), (47, 0.7), (8, 0.0)]):
        prompt = torch.randint(3, 53, (n,), generator=g).tolist()
        out.append(Request(i, 0, prompt, SamplingParams(temperature=t, max_new_tokens=60)))
    return out


def check_against_hf(hf, model, reqs, results):
    """Each response's logprobs (and greedy tokens) from the model's forward over prompt + response,
    whose logits are HF's within the fp32 rounding of HF's inverse frequencies."""
    assert sum(len(r.tokens) for r in results) > 150  # positions well past original_max_position_embeddings
    for req, res in zip(reqs, results):
        seq = torch.tensor([req.prompt_ids + res.tokens])
        with torch.no_grad():
            logits = model(seq)[0, len(req.prompt_ids) - 1: -1]
            assert (hf(seq).logits[0, len(req.prompt_ids) - 1: -1] - logits).abs().max() < 1e-4
        logp = torch.log_softmax(logits / (req.params.temperature or 1.0), -1)
        want = logp.gather(1, torch.tensor(res.tokens)[:, None])[:, 0].tolist()
        assert res.logprobs == pytest.approx(want, abs=1e-10)
        if req.params.temperature == 0:
            assert res.tokens == logits.argmax(-1).tolist()


def setup(rope):
    hf = hf_model("llama", ROPES[rope], seed=11).double()
    with torch.no_grad():  # sharper logits, so that greedy/sampled tokens depend on the RoPE angles
        hf.lm_head.weight.mul_(20)
    args = ModelArgs.from_hf_config(hf.config.to_dict())
    args.eos_token_id = None  # run every response to its length limit
    model = CausalLM(args).double()
    model.load_state_dict(hf.state_dict())
    return hf, model


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rope", ["llama3", "yarn_mscale"])
def test_engine_matches_transformers(rope, layout):
    hf, model = setup(rope)
    cfg = EngineConfig(max_batch_size=3, max_seq_len=128, dtype="float64", **LAYOUTS[layout])
    reqs = requests()
    check_against_hf(hf, model, reqs, Engine(model, cfg, seed=1).generate(reqs, step=2))


@pytest.mark.parametrize("rope", ["llama3", "yarn"])
def test_speculative_verify_matches_transformers(rope):
    hf, model = setup(rope)
    check_speculative_verify(hf, model)


def check_speculative_verify(hf, model):
    """Scripted drafts (30% of their tokens wrong) give plain decoding's tokens, with drafts accepted,
    and transformers' logits."""
    cfg = EngineConfig(max_batch_size=3, max_seq_len=128, dtype="float64")
    reqs = requests()
    ref = Engine(model, cfg, seed=1).generate(reqs, step=2)
    spec = Speculator(SpecConfig(enabled=True, sources=("group",), k_init=4, k_min=1, k_max=8, max_batch=3))
    spec.sources = [Scripted(spec.cfg, {(r.uid, r.sample_idx): r.tokens for r in ref}, flip=0.3)]
    out = Engine(model, cfg, seed=1, spec=spec).generate(reqs, step=2)
    assert [r.tokens for r in out] == [r.tokens for r in ref]
    assert sum(r.n_forwards for r in out) < sum(len(r.tokens) for r in out)  # drafts were accepted
    check_against_hf(hf, model, reqs, out)
