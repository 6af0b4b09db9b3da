"""megarl's rollout stage on the vLLM backend (megarl/engine/vllm_backend.py, vLLM's step-level
engine API): tail batching's short round keeps the first complete prompts with exactly the samples
a full rollout gives them, and stream training trains each group while vLLM still generates the
others, to the update taken after the rollout. One ``vllm.LLM`` serves the module."""
import pytest
import torch

from megarl.config import load_config
from megarl.engine import EngineConfig
from megarl.models.init_weights import init_hf_state
from megarl.models.llama import CausalLM
from megarl.rl.grpo import UpdateSpec
from megarl.setup_run import prepare_inputs
from megarl.rollout.stage import RolloutStage
from megarl.stages.update import grpo_update
from megarl.stream_train.stream import StreamUpdate
from megarl.trainer.trainer import Trainer, TrainerConfig
from tests.rl.test_temperature_logprobs import dims  # noqa: F401 (the fixture)
from tests.sched.test_tail import check_short_round
from tests.vllm_run_worker import CONFIG, OVERRIDES, length_reward
from tests.vllm_marks import needs_vllm

pytestmark = needs_vllm


@pytest.fixture(scope="module")
def stage():
    """The 2-process runs' tiny fp32 Llama (tests/vllm_run_worker.py: head_dim 32, no k bias), freshly
    initialised, on 8 prompts of 3 samples up to 40 tokens: response lengths spread from 2 to 40."""
    from megarl.engine.vllm_backend import VLLMEngine

    cfg = load_config(CONFIG, OVERRIDES + ["rollout.prompts_per_step=8", "rollout.max_new_tokens=40"])
    inputs = prepare_inputs(cfg)
    inputs.reward_fn = length_reward  # rewards that vary in a group: real updates
    model = CausalLM(inputs.args)
    model.load_state_dict(init_hf_state(inputs.args, cfg.seed, torch.float32))
    engine = VLLMEngine(model.args, EngineConfig(max_batch_size=24, max_seq_len=96), seed=5, temperature=1.0)
    engine.model.load_state_dict(model.state_dict())
    engine.push_weights()
    st = RolloutStage(engine, inputs, cfg.rollout, cfg.reward)
    yield st, model, cfg
    st.close()


def test_short_round_keeps_the_first_complete_prompts_with_their_full_samples(stage):
    stage, _, _ = stage
    uids = list(range(8))
    full, kept = check_short_round(stage, uids)
    for g in kept:  # the logprobs too
        assert [r.logprobs for r in g.results] == [r.logprobs for r in full[g.problem.uid].results]
    for u in stage.aborted:  # the stopped samples are prefixes of the full ones, token for token
        for r, whole in zip(stage.aborted[u], full[u].results):
            if r.finish_reason == "aborted":
                assert len(r.tokens) < len(whole.tokens) and r.tokens == whole.tokens[:len(r.tokens)]
            else:
                assert r.tokens == whole.tokens
    # the stop left vLLM empty: the same round run again to the end samples what the first one did
    assert not stage.engine.llm.llm_engine.has_unfinished_requests()
    again = stage.run(uids, step=2)
    assert [r.tokens for g in again for r in g.results] == [r.tokens for u in uids for r in full[u].results]


def test_stream_training_trains_groups_during_generation_to_the_same_update(stage, dims):  # noqa: F811
    """Each group is trained (forward/backward) between vLLM's engine steps as soon as it is scored,
    some while vLLM still runs other requests; the optimizer step at the end equals the update
    taken on the same groups after the rollout (fp32 rounding)."""
    stage, model, cfg = stage
    spec = UpdateSpec.of(cfg, stage.inputs.tokenizer.pad_id)
    tcfg = TrainerConfig(lr=1e-5, micro_batch_size=6, dtype="float32")
    streamed, plain = (Trainer(model.args, tcfg, dims, hf_state=model.state_dict()) for _ in range(2))
    stream = StreamUpdate(streamed, spec)
    stream.begin()
    running = []  # did vLLM still hold unfinished requests when each group was trained?

    def on_group(group):
        running.append(stage.engine.llm.llm_engine.has_unfinished_requests())
        stream.add_group(group)

    groups = stage.run(list(range(8)), step=4, on_group=on_group)
    got = stream.finish(groups)
    assert len(running) == 8 and running[0] and stream.groups == 8
    want = grpo_update(plain, groups, spec)
    assert got["grad_norm"] > 1e-3 and got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert got["logprob_diff_max"] < 1e-4  # vLLM's logprobs are the trainer's (docs/design.md §1.3)
    a, b, start = streamed.hf_state_dict(), plain.hf_state_dict(), model.state_dict()
    moved = max((b[k] - start[k]).abs().max().item() for k in b)
    diff = max((a[k] - b[k]).abs().max().item() for k in b)
    assert moved > 5e-6 and diff < 1e-7, (moved, diff)


def test_a_request_at_another_temperature_is_refused_before_any_starts(stage):
    from megarl.engine import Request, SamplingParams

    stage, _, _ = stage
    prompt = stage.inputs.prompt_ids[0]
    ok, bad = SamplingParams(temperature=1.0, max_new_tokens=4), SamplingParams(temperature=0.5, max_new_tokens=4)
    with pytest.raises(ValueError, match="request 1: temperature 0.5"):
        stage.engine.generate([Request(0, 0, prompt, ok), Request(0, 1, prompt, bad)], step=0)
    assert not stage.engine.llm.llm_engine.has_unfinished_requests()  # request 0 was never started
