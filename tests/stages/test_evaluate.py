"""The ``eval`` section and its held-out set (megarl/stages/evaluate.py)."""
import pytest

from megarl.config import load_config
from megarl.rl.task import AdditionTask, Problem, TaskConfig
from megarl.rl.tokenizer import CharTokenizer
from megarl.sched.prompts import prompt_uids_for_step
from megarl.stages.evaluate import EvalConfig, Evaluation, held_out_set
from megarl.utils.dataclass_config import ConfigError


@pytest.mark.parametrize("overrides, match", [
    (["eval.every=2"], "eval.every=2 needs a held-out set: set eval.prompts >= 1"),
    (["eval.every=-1"], "eval.every"),
    (["eval.samples=0"], "eval.samples"),
    (["eval.temperature=-0.5"], "eval.temperature"),
    (["eval.max_new_tokens=300", "rollout.max_new_tokens=256"], "eval.max_new_tokens=300 exceeds rollout.max_new_"),
    (["eval.every=1", "eval.prompts=4", "tail.enabled=true", "tail.long_rollout_tp=2"], "tail.long_rollout_tp"),
])
def test_bad_eval_config_is_one_clear_error(overrides, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        load_config(None, overrides)


def test_default_is_off():
    cfg = load_config(None, [])
    assert cfg.eval.every == 0 and cfg.eval.prompts == 0
    assert not Evaluation(cfg.eval, cfg.rl_steps, None, None, True).due(0)


def test_evaluation_steps():
    ev = Evaluation(EvalConfig(every=2, prompts=1), 5, None, None, False)
    assert [s for s in range(6) if ev.due(s)] == [0, 2, 4, 5]  # step 0, every 2nd, and after the last


def test_addition_held_out_set_is_apart_from_the_training_set():
    task = AdditionTask(TaskConfig(num_prompts=16, max_operand=4))
    train = [task.problem(u) for u in range(len(task))]
    tok = CharTokenizer()
    ids = [tok.encode_prompt(p.prompt) for p in train]
    held = held_out_set(EvalConfig(every=1, prompts=5), train, ids, tok, task, 200, prompts_per_step=4)
    assert held.train_size == 16  # training keeps every prompt it had
    assert [p.uid for p in held.problems] == list(range(16, 21))
    assert held.prompt_ids == [tok.encode_prompt(p.prompt) for p in held.problems]
    assert held_out_set(EvalConfig(), train, ids, tok, task, 200, 4) is None


def test_dataset_held_out_set_is_never_drawn_for_training():
    problems = [Problem(uid=i, prompt=f"q{i}", answer="a") for i in range(10)]
    ids = [[1, 2, 3]] * 10
    held = held_out_set(EvalConfig(every=1, prompts=3), problems, ids, None, None, 50, prompts_per_step=2)
    assert held.train_size == 7 and [p.uid for p in held.problems] == [7, 8, 9]
    drawn = {u for step in range(40) for u in prompt_uids_for_step(step, 2, 1234, held.train_size)}
    assert drawn == set(range(7))  # every training prompt, over several epochs, and no held-out one
    with pytest.raises(ValueError, match="eval.prompts=9 leaves 1 of the 10 prompts for training"):
        held_out_set(EvalConfig(every=1, prompts=9), problems, ids, None, None, 50, prompts_per_step=2)
    with pytest.raises(ValueError, match="beyond the rollout engine's context of 3"):
        held_out_set(EvalConfig(every=1, prompts=3), problems, ids, None, None, 3, prompts_per_step=2)


class _Tripwire:
    """A speculator that fails on any use: evaluation must not reach the run's speculator."""

    def __getattr__(self, name):
        raise AssertionError(f"evaluation used the speculator ({name})")


class _Tok:
    stop_ids = (1,)

    @staticmethod
    def decode(tokens):
        return " ".join(map(str, tokens))


def test_evaluator_samples_with_its_own_noise_and_leaves_the_speculator_alone():
    from megarl.engine import Request
    from megarl.rl.eval_metrics import eval_metrics
    from megarl.rl.rewards import RewardConfig
    from megarl.stages.evaluate import EVAL_NOISE_STEP, Evaluator, HeldOut
    from megarl.rollout.config import RolloutConfig
    from tests.engine.test_engine import engine

    eng = engine(max_batch_size=4)
    held = HeldOut([Problem(uid=100 + i, prompt="", answer="") for i in range(3)],
                   [[5, 6, 7], [8, 9], [10, 11, 12, 13]], train_size=100)
    reward = lambda problem, text: float(len(text.split()) % 2)  # noqa: E731 - any deterministic score
    rollout = RolloutConfig(temperature=1.0, max_new_tokens=12, group_size=2)
    ev = Evaluator(EvalConfig(every=1, prompts=3, samples=3), eng, held, reward, _Tok(), rollout,
                   RewardConfig(workers=2))
    trip = _Tripwire()
    eng.spec = trip
    got = ev.run()
    assert eng.spec is trip  # restored, never called
    eng.spec = None
    # The figures of the engine's keyed samples of (held-out uid, sample index) at the evaluation's noise step.
    reqs = [Request(uid=p.uid, sample_idx=s, prompt_ids=ids, params=ev.params)
            for p, ids in zip(held.problems, held.prompt_ids) for s in range(3)]
    res = eng.generate(reqs, step=EVAL_NOISE_STEP)
    rows = [res[3 * i:3 * i + 3] for i in range(3)]
    want = eval_metrics([[reward(None, _Tok.decode(r.tokens)) for r in row] for row in rows],
                        [[len(r.tokens) for r in row] for row in rows],
                        [[r.finish_reason == "length" for r in row] for row in rows], 1.0)
    assert got == want
    assert ev.run() == got  # the same weights: the same figures (every evaluation shares its noise)
    step0 = eng.generate(reqs, step=0)  # (the noise step matters: training's steps sample other tokens)
    assert [r.tokens for r in step0] != [r.tokens for r in res]
