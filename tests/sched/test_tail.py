"""Tail batching: the round plan and queue, short rounds that keep the first
complete prompts with exactly the samples a full rollout gives them, and the on-policy check."""
import copy

import pytest
import torch

from megarl.config import load_config
from megarl.engine import Engine, EngineConfig
from megarl.rl.data import epoch_order
from megarl.rl.grpo import grpo_batch, logprob_diff_max
from megarl.rollout.scoring import rollout_line
from megarl.rollout.stage import RolloutStage
from megarl.sched.tail import Round, TailBatcher, TailConfig
from megarl.trainer.logprobs import ref_token_logprobs
from megarl.setup_run import prepare_inputs
from tests.spec.test_spec_engine import _policy_with_entropy


def test_rounds_take_fresh_blocks_and_run_the_queue_once_it_holds_a_step():
    t = TailBatcher(prompts_per_step=4, overprovision=1.5, n_prompts=10, seed=3)
    stream = epoch_order(3, 0, 10) + epoch_order(3, 1, 10)
    r1 = t.plan()
    assert r1 == Round(long=False, uids=stream[0:6], keep=4)
    assert t.commit(r1, finished=r1.uids[:4]) == r1.uids[4:]  # two deferred
    r2 = t.plan()
    # Fresh prompts continue into epoch 1, up to (not including) a prompt the block already holds.
    block = next(stream[6:k] for k in range(7, 13) if k == 12 or stream[k] in stream[6:k])
    assert not r2.long and r2.uids == block and len(set(r2.uids)) == len(r2.uids)
    t.commit(r2, finished=r2.uids[:1] + r2.uids[2:])
    assert t.queue == [r1.uids[4], r1.uids[5], r2.uids[1]]
    t.queue.append(99)
    r3 = t.plan()
    assert r3 == Round(long=True, uids=t.queue, keep=None)  # a step's worth: the long round
    t.queue[-1] = r3.uids[-1] = stream[0]  # (a real prompt uid)
    state = t.state_dict()
    with pytest.raises(RuntimeError, match="long round must complete every prompt"):
        t.commit(r3, finished=r3.uids[:3])
    t.load_state_dict(state)
    assert t.commit(r3, finished=r3.uids) == [] and t.queue == []
    assert t.plan().uids[0] == stream[6 + len(block)]
    fresh = TailBatcher(4, 1.5, 10, 3)
    fresh.load_state_dict(t.state_dict())  # the checkpointed state resumes the same plan
    assert fresh.plan() == t.plan()


def test_a_prompt_deferred_twice_runs_once_per_long_round():
    t = TailBatcher(prompts_per_step=2, overprovision=1.0, n_prompts=4, seed=0)
    t.queue = [7, 7, 8]
    r = t.plan()
    assert r.long and r.uids == [7, 8]
    t.commit(r, finished=[7, 8])
    assert t.queue == [7]


def test_tail_config_checks_overprovision():
    for bad in (0.9, 2.5):
        with pytest.raises(ValueError, match=f"tail.overprovision={bad}.*valid range: \\[1.0, 2.0\\]"):
            TailConfig(overprovision=bad)


def _stage(n=8):
    cfg = load_config("configs/tiny.yaml", [
        f"task.num_prompts={n}", "task.max_terms=6", f"rollout.prompts_per_step={n}", "rollout.group_size=3",
        "rollout.max_new_tokens=60", "model.hidden_size=32", "model.intermediate_size=64",
        "model.num_hidden_layers=2"])
    inputs = prepare_inputs(cfg)
    model = _policy_with_entropy(inputs.args)
    with torch.no_grad():  # EOS as likely as a typical token: response lengths spread out
        model.lm_head.weight[inputs.args.eos_token_id] = model.lm_head.weight[inputs.tokenizer.encode("5")[0]]
    engine = Engine(model, EngineConfig(max_batch_size=24, max_seq_len=128, dtype="float64"), seed=5)
    return RolloutStage(engine, inputs, cfg.rollout, cfg.reward), model


def check_short_round(stage, uids: list[int], step: int = 2):
    """Tail batching's short round on ``stage`` (any engine): the kept groups are the first prompts to
    complete, with the very samples and rewards a full rollout gives them, handed on as they finish,
    and rollouts.jsonl's deferred entries hold the others as the stop left them. Returns the full
    rollout's groups by uid and the kept groups."""
    full = {g.problem.uid: g for g in stage.run(uids, step=step)}
    handed = []
    kept = stage.run(uids, step=step, keep=3, on_group=handed.append)
    assert 3 <= len(kept) < len(uids) and len(kept) + len(stage.aborted) == len(uids)
    assert sorted([g.problem.uid for g in kept] + list(stage.aborted)) == uids
    for g in kept:  # the very samples and rewards a full rollout gives these prompts
        assert [r.tokens for r in g.results] == [r.tokens for r in full[g.problem.uid].results]
        assert g.rewards == full[g.problem.uid].rewards
    # ... and they are the prompts whose longest sample is shortest (first to complete)
    longest = {u: max(len(r.tokens) for r in g.results) for u, g in full.items()}
    assert max(longest[g.problem.uid] for g in kept) <= min(longest[u] for u in stage.aborted)
    assert sorted(g.problem.uid for g in handed) == sorted(g.problem.uid for g in kept)  # stream training
    # rollouts.jsonl's deferred entries (the simulator's replay): each deferred prompt's samples as
    # the stop left them: finished ones whole, running ones a strict prefix of their full response
    line = rollout_line(step, kept, stage.aborted)
    assert [d["uid"] for d in line["deferred"]] == list(stage.aborted)
    for d in line["deferred"]:
        full_lens = [len(r.tokens) for r in full[d["uid"]].results]
        assert "aborted" in d["finish_reasons"]
        for n, why, n_full in zip(d["lengths"], d["finish_reasons"], full_lens):
            assert n < n_full if why == "aborted" else n == n_full
    return full, kept


def test_short_round_keeps_the_first_complete_prompts_with_their_full_samples():
    stage, _ = _stage()
    check_short_round(stage, list(range(8)))
    stage.close()


def test_logprob_diff_catches_samples_from_other_weights():
    """The on-policy metric: ~0 when the trainer's weights sampled the responses, large when
    they came from older weights (what resuming a deferred prompt's partial samples would do)."""
    stage, model = _stage(4)
    groups = stage.run([0, 1, 2, 3], step=0)
    batch = grpo_batch(groups, len(groups[0].results), stage.inputs.tokenizer.pad_id, True, stage.cfg.temperature)

    def diff_under(policy):
        lp = ref_token_logprobs(policy.double(), batch["input_ids"])
        return logprob_diff_max(lp, batch["rollout_logprobs"], batch["loss_mask"])

    assert diff_under(copy.deepcopy(model)) <= 1e-5  # (ref_token_logprobs takes the softmax in fp32)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    assert diff_under(moved) > 1e-3
    stage.close()
