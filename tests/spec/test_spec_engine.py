"""Speculative decoding in the engine: token-for-token the output without speculation (fp64), with
drafts that are perfect, wrong, cut by stop tokens and length limits, and from every source."""
import copy
import dataclasses
import random

import pytest
import torch

from megarl.config import load_config
from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.models.llama import CausalLM
from megarl.rollout.stage import RolloutStage
from megarl.setup_run import prepare_inputs
from megarl.spec.config import SpecConfig
from megarl.spec.sources import DraftSource, Proposal
from megarl.spec.speculator import Speculator
from tests.engine.test_engine import engine, key, mixed_requests


class Scripted(DraftSource):
    """Drafts read from a table of known responses: ``flip`` of them are wrong at a random
    position, so verification sees full acceptance, partial acceptance and rejection."""

    name = "group"  # any registered name: the speculator attributes its stats to it

    def __init__(self, cfg, answers, flip=0.0, seed=0):
        super().__init__(cfg)
        self.answers, self.flip, self.rng = answers, flip, random.Random(seed)

    def propose(self, req, tokens, k):
        ans = self.answers[(req.uid, req.sample_idx)]
        draft = list(ans[len(tokens):len(tokens) + k])
        if draft and self.rng.random() < self.flip:
            i = self.rng.randrange(len(draft))
            draft[i] = (draft[i] + 1) % 40
        return Proposal(draft, self.name, 1) if draft else None


def scripted_engine(answers, flip, k=4, max_batch=64, **kw):
    spec = Speculator(SpecConfig(enabled=True, sources=("group",), k_init=k, k_min=1, k_max=8, max_batch=max_batch))
    spec.sources = [Scripted(spec.cfg, answers, flip)]
    return Engine(engine(**kw).model, EngineConfig(max_batch_size=kw.get("max_batch_size", 4), max_seq_len=64,
                                                   dtype="float64"), seed=1234, spec=spec)


@pytest.mark.parametrize("flip", [0.0, 0.3, 1.0])
def test_scripted_drafts_are_exact(flip):
    reqs = mixed_requests(20)
    ref = engine(max_batch_size=4).generate(reqs, step=5)
    answers = {(r.uid, r.sample_idx): r.tokens for r in ref}
    eng = scripted_engine(answers, flip, max_batch_size=4)
    out = eng.generate(reqs, step=5)
    assert [key(r) for r in out] == [key(r) for r in ref]
    for a, b in zip(out, ref):  # logprobs come from the verify forward: same up to fp64 rounding
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-10)
        assert a.entropies == pytest.approx(b.entropies, abs=1e-10)
    tokens = sum(len(r.tokens) for r in ref)
    forwards = sum(r.n_forwards for r in out)
    st = eng.spec.metrics()
    # Each forward yields its accepted drafts plus the target's token, except when the last
    # accepted draft is a stop token.
    stops_in_draft = tokens - forwards - st["accepted_tokens"]
    assert 0 <= -stops_in_draft <= sum(r.finish_reason == "stop" for r in ref)
    if flip == 0.0:  # perfect drafts: all accepted
        assert st["accepted_tokens"] == st["drafted_tokens"] > 0
        assert forwards < tokens / 2
    else:
        assert st["accepted_tokens"] < st["drafted_tokens"]


def test_cache_rolls_back_rejected_drafts():
    """Drafts that are always wrong in the last position: the rejected k/v sit in the cache past the
    accepted length; a later forward must not see them (same output as without speculation)."""
    reqs = [dataclasses.replace(r, params=dataclasses.replace(r.params, stop_token_ids=(), max_new_tokens=30))
            for r in mixed_requests(8)]
    ref = engine(max_batch_size=8).generate(reqs, step=2)
    answers = {(r.uid, r.sample_idx): r.tokens[:-3] + [(t + 1) % 40 for t in r.tokens[-3:]] for r in ref}
    out = scripted_engine(answers, 0.0, max_batch_size=8).generate(reqs, step=2)
    assert [key(r) for r in out] == [key(r) for r in ref]
    assert all(len(r.tokens) == 30 for r in out)


def test_adaptive_draft_length_and_batch_threshold():
    cfg = SpecConfig(enabled=True, sources=("group",), k_init=2, k_min=1, k_max=8, max_batch=3,
                     forward_cost_tokens=0)
    spec = Speculator(cfg)
    spec.sources = [Scripted(cfg, {(0, 0): list(range(5, 40))})]
    req = Request(0, 0, [3], SamplingParams())
    spec.begin([req], 0)
    lens = []
    for accepted in (True, True, True, True, False, False, False):
        d = spec.propose([req], [[]], [100], n_rows=1)[0]
        lens.append(len(d))
        spec.feedback(req, [0], len(d), len(d) if accepted else 0)
    assert lens == [2, 4, 8, 8, 8, 4, 2]  # doubles on full acceptance, halves on early rejection
    assert spec.propose([req], [[]], [100], n_rows=1)[0] != []
    assert spec.propose([req], [[]], [100], n_rows=4) == [[]]  # batch above max_batch: off
    assert spec.propose([req], [[]], [0], n_rows=1) == [[]]  # no room left for drafts
    spec.begin([req], 0)  # back to k_init = 2
    spec.cfg.max_draft_tokens = 3  # token budget of one forward, shared by its rows
    assert len(spec.propose([req], [[]], [100], n_rows=1)[0]) == 2  # k_init, under the budget
    assert len(spec.propose([req], [[]], [100], n_rows=3)[0]) == 1  # 3 tokens over 3 rows
    spec.cfg.max_batch = 100
    assert spec.propose([req], [[]], [100], n_rows=4) == [[]]  # under one token per row: none


def test_cost_rule_cuts_drafts_by_batch_size_and_acceptance():
    cfg = SpecConfig(enabled=True, sources=("group",), k_init=8, k_max=8, forward_cost_tokens=64)
    spec = Speculator(cfg)
    source = Scripted(cfg, {(0, 0): list(range(5, 40))})
    spec.sources = [source]
    req = Request(0, 0, [3], SamplingParams())
    spec.begin([req], 0)
    # Prior acceptance rate of a suffix-match draft: 1/2. Token j stays while 0.5**j >= B / (B + 64).
    assert spec.accept_rate("group", False) == 0.5
    assert [len(spec.propose([req], [[]], [100], n_rows=b)[0]) for b in (1, 16, 64, 256)] == [6, 2, 1, 0]
    for _ in range(20):  # every draft rejected at its first token: the rate falls, drafts shrink
        spec.propose([req], [[]], [100], n_rows=1)
        spec.feedback(req, [0], 6, 0)
    assert spec.accept_rate("group", False) < 0.05
    assert spec.propose([req], [[]], [100], n_rows=16) == [[]]
    assert len(spec.propose([req], [[]], [100], n_rows=1)[0]) == 1  # alone, even 1 in 20 pays
    # A coupled draft (a bubble draft at its own positions) starts from a prior rate of 0.9.
    source.propose = lambda r, toks, k: Proposal(list(range(5, 5 + k)), "bubble", 17, coupled=True)
    assert spec.accept_rate("bubble", True) == 0.9
    other = Request(1, 0, [3], SamplingParams())  # starts at k_init (req's k was halved to 1)
    assert len(spec.propose([other], [[]], [100], n_rows=256)[0]) == 2  # 0.9**2 >= 0.8 > 0.9**3
    m = spec.metrics()
    assert m["spec/group/accept_rate"] < 0.05


def _tiny_task(n_prompts, temperature, top_p):
    cfg = load_config("configs/tiny.yaml", [
        f"task.num_prompts={n_prompts}", "task.max_terms=8", f"rollout.prompts_per_step={n_prompts}",
        "rollout.group_size=4", f"rollout.temperature={temperature}", f"rollout.top_p={top_p}",
        "rollout.max_new_tokens=24", "model.hidden_size=32", "model.intermediate_size=64",
        "model.num_hidden_layers=2", "spec.enabled=true",
        # no cost cut: every source must draft, however often it is rejected
        "spec.forward_cost_tokens=0"])
    return cfg, prepare_inputs(cfg)


def _policy_with_entropy(args):
    """A random policy that behaves like a half-trained one: untied LM head scaled for ~1 nat of
    entropy per token at T=1 (the default init of a tied model repeats one token forever), and
    EOS made rare so responses run to tens of tokens, with repeated patterns to draft from."""
    torch.manual_seed(0)
    model = CausalLM(dataclasses.replace(args, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.6)
        model.lm_head.weight[args.eos_token_id] = 0
        model.lm_head.weight[args.eos_token_id, 0] = -2
    return model


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 0.9)])
def test_every_source_exact_on_the_tiny_task(temperature, top_p):
    """256 prompts x 4 samples, fp64: step 0 fills the history, a pre-generation with the step-0
    weights gives bubble drafts for half of step 1's prompts, the weights move (one 'RL step'),
    and step 1 runs with bubble, history, group and prompt drafts: token-identical to no
    speculation at both steps."""
    cfg, inputs = _tiny_task(256, temperature, top_p)
    model = _policy_with_entropy(inputs.args)
    ecfg = EngineConfig(max_batch_size=256, max_seq_len=128, dtype="float64")
    ar, sp = Engine(model, ecfg, seed=7), Engine(copy.deepcopy(model), ecfg, seed=7, spec=Speculator(cfg.spec))
    requests = RolloutStage(ar, inputs, cfg.rollout, cfg.reward).requests(list(range(256)))
    assert len(requests) == 1024
    for step in (0, 1):
        if step == 1:
            sp.pregenerate(requests[:512], 1)
            with torch.no_grad():  # one "RL update", applied to both engines
                for p_ar, p_sp in zip(ar.model.parameters(), sp.model.parameters()):
                    p_ar.add_(0.05 * torch.randn_like(p_ar))
                    p_sp.copy_(p_ar)
        ref, out = ar.generate(requests, step), sp.generate(requests, step)
        assert [r.tokens for r in out] == [r.tokens for r in ref]
        assert [r.finish_reason for r in out] == [r.finish_reason for r in ref]
    m = sp.spec.metrics()  # both steps (pre-generation included)
    for s in ("bubble", "history", "group", "prompt"):
        assert m[f"spec/{s}/forwards"] > 0, s  # every source's drafts were verified
    for s in ("bubble", "history", "group"):  # (this random policy rarely copies its prompt)
        assert m[f"spec/{s}/accepted"] > 0, s
    assert m["spec/accepted"] < m["spec/drafted"]  # rejections happened too
