"""Rewards scored in the pool as responses finish: the same rewards as scoring
afterwards; a reward that raises, hangs in the sandbox, or blows its memory scores 0 and is
counted, and the rollout goes on; stream training gets each group once its rewards are in, in
the order the groups finished."""
import zlib

import pytest

from megarl.config import load_config
from megarl.engine import Engine, EngineConfig
from megarl.rl.reward_pool import sandboxed
from megarl.rl.rewards import RewardConfig
from megarl.rollout.stage import RolloutStage
from megarl.rl.sandbox import run_python
from megarl.setup_run import prepare_inputs
from tests.spec.test_spec_engine import _policy_with_entropy

PROGRAMS = {0: "print('fine')", 1: "while True: pass", 2: "b = bytearray(10 * 1024**3)"}


def _kind(text: str) -> int:
    return zlib.crc32(text.encode()) % 4


@sandboxed
def mixed_reward(problem, text, limits=None) -> float:
    """Deterministic in the response: 1/4 raise, 1/4 run a program that loops forever, 1/4 one
    that allocates 10 GB, 1/4 a program that passes (reward = 0.5 + length / 1000)."""
    kind = _kind(text)
    if kind == 3:
        raise RuntimeError("reward crashed")
    result = run_python(PROGRAMS[kind], limits=limits)
    return 0.5 + len(text) / 1000 if result.ok else 0.0


def _stage(reward_fn, workers=2):
    cfg = load_config("configs/tiny.yaml", [
        "task.num_prompts=6", "task.max_terms=6", "rollout.prompts_per_step=6", "rollout.group_size=4",
        "rollout.max_new_tokens=12", "model.hidden_size=32", "model.intermediate_size=64",
        "model.num_hidden_layers=2", f"reward.workers={workers}", "reward.sandbox.timeout_s=1.0",
        "reward.sandbox.memory_mb=256"])
    inputs = prepare_inputs(cfg)
    inputs.reward_fn = reward_fn
    engine = Engine(_policy_with_entropy(inputs.args), EngineConfig(max_batch_size=24, max_seq_len=128,
                                                                      dtype="float64"), seed=3)
    return RolloutStage(engine, inputs, cfg.rollout, cfg.reward)


def test_failing_rewards_score_zero_are_counted_and_the_rollout_goes_on():
    stage = _stage(mixed_reward)
    handed = []
    groups = stage.run(list(range(6)), step=0, on_group=handed.append)
    texts = [stage.inputs.tokenizer.decode(r.tokens) for g in groups for r in g.results]
    kinds = [_kind(t) for t in texts]
    assert set(kinds) >= {0, 1, 3}  # the case mix really happened
    want = [0.5 + len(t) / 1000 if k == 0 else 0.0 for t, k in zip(texts, kinds)]
    assert [x for g in groups for x in g.rewards] == want
    assert stage.reward_errors == sum(k != 0 for k in kinds)  # raised, timed out, out of memory
    errors = stage.pool.stats()["errors"]
    assert errors.get("exception:RuntimeError", 0) == kinds.count(3)
    assert errors.get("timeout", 0) == kinds.count(1)
    assert errors.get("memory", 0) == kinds.count(2)
    assert stage.metrics(groups)["reward_errors"] == stage.reward_errors
    # Stream training saw every group once, with the same rewards.
    assert sorted(g.problem.uid for g in handed) == list(range(6))
    by_uid = {g.problem.uid: g.rewards for g in groups}
    assert all(g.rewards == by_uid[g.problem.uid] for g in handed)
    stage.close()


def test_pool_scoring_equals_scoring_afterwards_and_keeps_finishing_order():
    def reward(problem, text):
        return len(text) % 3 + 0.25 * (problem.uid % 2)

    stage = _stage(reward, workers=3)
    order = []
    groups = stage.run(list(range(6)), step=1, on_group=lambda g: order.append(g.problem.uid))
    again = stage.groups(list(range(6)), [r for g in groups for r in g.results])  # scored one by one
    assert [g.rewards for g in groups] == [g.rewards for g in again]
    # The order in which groups finished: by the step at which their last sample ended.
    last = {g.problem.uid: max(len(r.tokens) for r in g.results) for g in groups}
    assert [last[u] for u in order] == sorted(last[u] for u in order)
    stage.close()


def test_reward_config_checks_workers():
    with pytest.raises(ValueError, match="reward.workers=0"):
        RewardConfig(workers=0)
