"""The learned drafter: exact with any weights (fp64, token-identical to speculation
off), training lowers its loss and raises acceptance, preemptible training, the strategy bandit,
export round trip, and identical weights on every replica after averaging (2 processes, gloo)."""
import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch

from megarl.engine import Engine, EngineConfig, Request, SamplingParams
from megarl.engine.sampling_rows import SamplingRows
from megarl.models.config import ModelArgs
from megarl.models.llama import CausalLM
from megarl.sched.bubble import BubbleWorker, ScheduleConfig
from megarl.spec.bandit import ARMS, StrategyBandit, bucket_of
from megarl.spec.config import DrafterConfig, SpecConfig
from megarl.spec.drafter import load_drafter, save_drafter
from megarl.spec.speculator import Speculator
from tests.engine.test_engine import ARGS, engine, key, mixed_requests
from tests.torchrun import torchrun


def _target(seed=0):
    """A random policy with real entropy at T=1 and long responses (untied head scaled for about
    a nat of entropy; EOS rare), so there is something to draft."""
    torch.manual_seed(seed)
    model = CausalLM(ModelArgs(**{**ARGS, "tie_word_embeddings": False}))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.6)
        model.lm_head.weight[1] = 0
        model.lm_head.weight[1, 0] = -2
    return model


def _drafter_engine(model, strategy="drafter", k=4, sources=(), cost=0.0, max_batch_size=4, **dkw):
    spec = Speculator(SpecConfig(enabled=True, sources=sources, forward_cost_tokens=cost,
                                 drafter=DrafterConfig(enabled=True, strategy=strategy, k=k, **dkw)))
    return Engine(model, EngineConfig(max_batch_size=max_batch_size, max_seq_len=96, dtype="float64"),
                  seed=1234, spec=spec)


def _requests(uids, n=4, max_new=40, temperature=1.0, **kw):
    return [Request(u, i, [2 + u % 30, 3 + (u * 7) % 30, 4 + (u * 3) % 30],
                    SamplingParams(temperature=temperature, max_new_tokens=max_new, stop_token_ids=(1,), **kw))
            for u in uids for i in range(n)]


@pytest.mark.parametrize("strategy,sources", [("drafter", ()), ("combined", ("group", "prompt")),
                                              ("bandit", ("group", "prompt"))])
def test_untrained_drafter_is_exact(strategy, sources):
    reqs = mixed_requests(20)  # greedy, T != 1, top-k, top-p, stops and length limits
    ref = engine(max_batch_size=4).generate(reqs, step=5)
    eng = _drafter_engine(engine(max_batch_size=4).model, strategy, sources=sources)
    out = eng.generate(reqs, step=5)
    assert [key(r) for r in out] == [key(r) for r in ref]
    for a, b in zip(out, ref):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-10)
    m = eng.spec.metrics()
    if strategy != "bandit":
        assert m["spec/drafter/drafted"] > 0 and m["spec/drafter/accepted"] > 0
    else:
        assert any(k.startswith("spec_strategy/") for k in m)


def test_draft_chain_samples_with_the_requests_own_noise():
    """Each chain token is argmax(filter(logits / T) + g) with g the target sampler's noise at
    that request and position (greedy rows: the raw argmax): the coupling that makes drafts agree
    with the target. Checked against the dense noise over the whole vocabulary (what the chain
    used before it hashed only the tokens that can win), at a vocabulary large enough for pruning."""
    from megarl.engine.sampler import filter_logits, gumbel_noise
    from megarl.spec.drafter import Drafter, _Attn

    args = ModelArgs(**{**ARGS, "vocab_size": 4096})
    torch.manual_seed(0)
    d = Drafter(args, window=4).double()
    embed_w, head_w = torch.randn(4096, args.hidden_size, dtype=torch.float64), torch.randn(4096, args.hidden_size,
                                                                                           dtype=torch.float64) * 3
    b, w, k = 5, 4, 3
    feats = torch.randn(b, w, args.hidden_size, dtype=torch.float64)
    tokens = torch.randint(0, 4096, (b, w))
    valid = torch.ones(b, w, dtype=torch.bool)
    valid[0, :2] = False
    sampling = SamplingRows(temperature=torch.tensor([1.0, 0.0, 0.7, 1.0, 1.3], dtype=torch.float64),
                            top_k=torch.tensor([0, 0, 50, 0, 0]),
                            top_p=torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0], dtype=torch.float64),
                            uid=torch.tensor([3, 3, 8, 9, 11]), sample_idx=torch.tensor([0, 1, 0, 2, 5]),
                            position=torch.tensor([0, 4, 7, 1, 30]), seed=1234, step=2)
    head = lambda h: torch.nn.functional.linear(h, head_w)  # noqa: E731
    got = d.draft(feats, tokens, valid, k, embed_w, head, sampling)

    attn, pos = _Attn(valid, keep=True), torch.arange(w).expand(b, w)
    x_feat, x_emb, want = feats, torch.nn.functional.embedding(tokens, embed_w), []
    with torch.no_grad():
        for j in range(k):
            pred = d(x_feat, x_emb, pos, attn)[:, -1:]
            logits = torch.nn.functional.linear(pred[:, 0], head_w)
            g = gumbel_noise(1234, 2, sampling.uid, sampling.sample_idx, sampling.position + j, 4096,
                             torch.float64)
            s = filter_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
            tok = torch.where(sampling.temperature == 0, logits.argmax(-1), (s + g).argmax(-1))
            want.append(tok)
            x_feat, x_emb = pred, torch.nn.functional.embedding(tok[:, None], embed_w)
            pos = torch.full((b, 1), w + j, dtype=torch.int64)
    want = torch.stack(want, 1)
    assert torch.equal(got, want)
    # the noise decides the sampled rows (another seed gives other tokens), not the greedy one
    other = d.draft(feats, tokens, valid, k, embed_w, head, dataclasses.replace(sampling, seed=99))
    assert torch.equal(other[1], got[1]) and not torch.equal(other[[0, 2, 3, 4]], got[[0, 2, 3, 4]])


def test_training_lowers_loss_raises_acceptance_and_stays_exact():
    """Rollouts of a fixed target fill the buffer; training on them lowers the drafter's loss and
    raises its acceptance on requests it has never seen, and output stays the target's."""
    model = _target()
    ref_eng = Engine(_target(), EngineConfig(max_batch_size=16, max_seq_len=96, dtype="float64"), seed=1234)
    eng = _drafter_engine(model, "drafter", k=4, max_batch_size=16, lr=3e-3)
    test = _requests(range(100, 106))
    ref = ref_eng.generate(test, step=9)

    def accept_len():
        eng.reset_stats()
        out = eng.generate(test, step=9)
        assert [key(r) for r in out] == [key(r) for r in ref]
        return eng.spec.metrics()["spec/drafter/accept_len_mean"]

    before = accept_len()
    eng.generate(_requests(range(24)), step=0)  # rollouts: the buffer fills
    src = eng.spec.drafter
    assert src.buffer.tokens > 1000
    first = src.trainer.train(max_steps=5)["drafter_loss"]
    src.trainer.train(max_steps=150)
    last = src.trainer.train(max_steps=5)["drafter_loss"]
    assert last < 0.8 * first
    after = accept_len()
    assert after > before + 0.15, (before, after)


def test_buffer_is_bounded_and_keeps_whole_recent_responses():
    eng = _drafter_engine(_target(), max_batch_size=8, buffer_tokens=300)
    eng.generate(_requests(range(10)), step=0)
    buf = eng.spec.drafter.buffer
    assert 0 < buf.tokens <= 300 and buf.tokens == sum(f.shape[0] for f, _, _ in buf.records)
    feats, toks, resp = buf.records[-1]
    assert feats.shape == (toks.shape[0], ARGS["hidden_size"]) and 0 < resp < toks.shape[0]


def _stop_after(n):
    calls = [0]

    def stop():
        calls[0] += 1
        return calls[0] > n

    return stop


def test_drafter_training_stops_within_one_step_in_a_bubble():
    eng = _drafter_engine(_target(), max_batch_size=8)
    eng.generate(_requests(range(8)), step=0)
    trainer = eng.spec.drafter.trainer
    out = BubbleWorker(lambda: trainer.train(_stop_after(3)), low_priority=True, flush_denormal=True).join()
    assert out["drafter_train_steps"] == 3 and trainer.steps == 3
    # stopped from another thread while it trains: at most the step in flight finishes after
    flag = threading.Event()
    done = {}
    worker = threading.Thread(target=lambda: done.update(trainer.train(flag.is_set)))
    worker.start()
    time.sleep(0.3)
    flag.set()
    n_at_stop = trainer.steps
    worker.join(timeout=30)
    assert not worker.is_alive() and trainer.steps - n_at_stop <= 1 and done["drafter_train_steps"] > 0
    assert trainer.train(max_steps=2)["drafter_train_steps"] == 2


def test_schedule_and_drafter_config():
    assert ScheduleConfig(bubble_work=["drafter_train", "pregen"]).bubble_work == ("drafter_train", "pregen")
    with pytest.raises(ValueError, match="strategy.*valid choices"):
        DrafterConfig(strategy="greedy")
    with pytest.raises(ValueError, match="spec.drafter.window"):
        DrafterConfig(window=0)
    assert SpecConfig().drafter.enabled is False
    with pytest.raises(ValueError, match="needs spec.enabled=true"):
        SpecConfig(enabled=False, drafter=DrafterConfig(enabled=True))


def test_bandit_picks_the_better_arm_and_is_deterministic():
    def run(seed):
        bandit = StrategyBandit(c=0.2, discount=1.0, seed=seed)
        means = {"off": 100.0, "sources": 80.0, "drafter2": 120.0, "drafter4": 160.0, "drafter8": 140.0,
                 "combined": 150.0}
        # large batches: "off" wins
        means_big = {"off": 170.0, "sources": 130.0, "drafter2": 120.0, "drafter4": 90.0, "drafter8": 80.0,
                     "combined": 110.0}
        picks = []
        for t in range(600):
            rows = 2 if t % 2 == 0 else 200
            arm = bandit.choose(rows)
            noise = ((t * 7919) % 13 - 6) / 6.0  # deterministic, zero-mean-ish
            bandit.update(rows, arm, (means if rows == 2 else means_big)[arm] + 5.0 * noise)
            picks.append(arm)
        return bandit, picks

    bandit, picks = run(3)
    assert bandit.best(2) == "drafter4" and bandit.best(200) == "off"
    small = [p for i, p in enumerate(picks) if i % 2 == 0][-100:]
    big = [p for i, p in enumerate(picks) if i % 2 == 1][-100:]
    assert small.count("drafter4") > 60 and big.count("off") > 60
    assert run(3)[1] == picks  # same seed, same rewards: same choices
    assert run(4)[1][:12] != picks[:12]  # the seed orders the first tries
    m = bandit.metrics()
    assert m[f"spec_strategy/{bucket_of(2)}/drafter4"] > 0 and set(ARMS) >= {k.split("/")[2] for k in m
                                                                              if not k.endswith("_reward")}
    assert bucket_of(1) == 1 and bucket_of(3) == 4 and bucket_of(256) == 256


def test_chain_cost_rule_drafts_for_small_batches_only():
    """The drafter's cost rule counts its own chain: the row cost is the drafter's weights per
    token over the target's (a head counted once, tied or not), and the chain length it allows
    shrinks with the batch and grows with the acceptance rate; on the tiny model's shapes a
    well-accepted drafter drafts at batch 1 and is off at batch 64."""
    def spec_for(tied):
        eng = _drafter_engine(CausalLM(ModelArgs(**{**ARGS, "tie_word_embeddings": tied})), cost=80.0)
        eng.spec.attach(eng.draft_target())
        return eng.spec

    tied, untied = spec_for(True), spec_for(False)
    d = tied.drafter
    layer = sum(p.numel() for p in d.model.layer.parameters())
    h, v = ARGS["hidden_size"], ARGS["vocab_size"]
    want = (2 * h * h + h + layer + h + v * h) / (ARGS["num_hidden_layers"] * layer + h + v * h)
    assert d.row_cost == pytest.approx(want) and untied.drafter.row_cost == pytest.approx(want)
    rates = (0.0, 0.3, 0.6, 0.8, 0.95)
    table = {n: [tied._chain_len(8, n, n, r) for r in rates] for n in (1, 2, 4, 8, 16, 32, 64, 256)}
    assert all(row[0] == 0 for row in table.values())
    for row in table.values():  # more acceptance, longer chains
        assert row == sorted(row)
    for n, bigger in zip(list(table), list(table)[1:]):  # bigger batches, shorter chains
        assert all(a >= b for a, b in zip(table[n], table[bigger]))
    assert table[1][-1] > 0 and table[64] == [0] * len(rates)
    # without its chain cost the same drafter would draft at batch 64 (the rule it replaces)
    d._row_cost = 0.0
    assert tied._chain_len(8, 64, 64, 0.95) > 0


def test_export_round_trip_gives_the_same_proposals(tmp_path):
    eng = _drafter_engine(_target(), max_batch_size=8)
    eng.generate(_requests(range(8)), step=0)
    src = eng.spec.drafter
    src.trainer.train(max_steps=10)
    out = save_drafter(src.model, tmp_path / "drafter")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    eng2 = _drafter_engine(_target(), max_batch_size=8, init_from=str(out))
    reqs = _requests(range(50, 54))
    eng.reset_stats()
    a, b = eng.generate(reqs, step=3), eng2.generate(reqs, step=3)
    assert [key(r) for r in a] == [key(r) for r in b]
    ma, mb = eng.spec.metrics(), eng2.spec.metrics()
    assert ma["spec/drafter/drafted"] == mb["spec/drafter/drafted"] > 0
    assert ma["spec/drafter/accepted"] == mb["spec/drafter/accepted"]  # the same drafts, proposal by proposal
    for k, v in load_drafter(out, eng.model.args, torch.float64).state_dict().items():
        assert torch.equal(v, src.model.state_dict()[k])
    other = ModelArgs(**{**ARGS, "hidden_size": 64})
    with pytest.raises(ValueError, match="another target: hidden_size"):
        load_drafter(out, other)
    with pytest.raises(FileNotFoundError):
        load_drafter(tmp_path / "missing", eng.model.args)


def test_replicas_end_with_identical_drafter_weights():
    torchrun(Path(__file__).with_name("drafter_sync_worker.py"), 2, timeout=120)
