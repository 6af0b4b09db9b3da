"""The trainer scores what the engine sampled, at any temperature.

The trainer's logprobs (old, new, the reference's for KL) are ``log softmax(logits / T)`` with
T = 0 read as 1 and top-k/top-p not applied: what the engine's ``token_stats`` reports for each
sampled token. So the on-policy check (``logprob_diff_max``) is rounding-level at every T."""
import dataclasses
import types
import warnings

import pytest
import torch

from megarl.config import load_config
from megarl.engine import Engine, EngineConfig, filter_logits
from megarl.parallel.dist import ParallelDims
from megarl.rl import grpo as grpo_mod
from megarl.stages import sft
from megarl.rollout.stage import RolloutStage
from megarl.rl.grpo import UpdateSpec
from megarl.stages.update import grpo_update
from megarl.stream_train.stream import StreamUpdate
from megarl.setup_run import prepare_inputs
from megarl.trainer import trainer as trainer_mod
from megarl.trainer.logprobs import vocab_parallel_logprobs
from megarl.trainer.trainer import Trainer, TrainerConfig
from tests.spec.test_spec_engine import _policy_with_entropy

# fp64 Megatron training is a CPU-only mode (the Trainer refuses it on CUDA).
cpu_fp64 = pytest.mark.skipif(torch.cuda.is_available(), reason="fp64 Megatron training is a CPU-only test mode")
TOL = {"float32": 1e-5, "float64": 1e-10}


@pytest.fixture(scope="module")
def dims():
    from megatron.core import parallel_state as ps

    from megarl.parallel.dist import init_parallel, teardown
    if ps.model_parallel_is_initialized():
        # Another module's fixture holds the process's (one-process, TP=PP=1) Megatron state, e.g.
        # tests/conftest.py's session fixture when that directory ran first: use its groups.
        if ps.get_tensor_model_parallel_world_size() != 1 or ps.get_pipeline_model_parallel_world_size() != 1:
            pytest.skip("Megatron parallel state of another layout is initialised")
        from megatron.core.process_groups_config import ProcessGroupCollection
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        yield ParallelDims(world_size=1, rank=0, tp=1, pp=1, dp=1, tp_group=pgs.tp, pp_group=pgs.pp,
                           dp_group=pgs.dp, pg_collection=pgs, ep_group=pgs.ep, expt_dp_group=pgs.expt_dp,
                           backend="nccl" if torch.cuda.is_available() else "gloo",
                           device=torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                           else torch.device("cpu"))
        return
    with warnings.catch_warnings():  # Megatron warns about missing apex/TE at import
        warnings.simplefilter("ignore")
        d = init_parallel(tp=1, pp=1)
    yield d
    teardown(d)


# ------------------------------------------------------------------ the logprob function itself

@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_gradcheck_of_the_temperature_path(temperature):
    """Forward = log_softmax(x / T)[target] (padding columns masked); the custom backward's
    gradient, (onehot - softmax) / T, passes gradcheck in fp64. Catches a backward without 1/T."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3))  # columns 5, 6: vocabulary padding
    f = lambda x: vocab_parallel_logprobs(x, targets, None, 5, temperature)  # noqa: E731
    want = torch.log_softmax(x[..., :5] / temperature, -1).gather(-1, targets[..., None])[..., 0]
    assert (f(x) - want).abs().max().item() < 1e-14
    assert torch.autograd.gradcheck(f, (x,))
    # greedy (T=0) reads as T=1, as in the engine's token_stats
    assert torch.equal(vocab_parallel_logprobs(x, targets, None, 5, 0.0), vocab_parallel_logprobs(x, targets, None, 5))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(x, targets, None, 5, -1.0)


# ------------------------------------------------------------------ engine -> update path

def _setup(dims, temperature, dtype="float32", top_k=0, top_p=1.0, n=4):
    """A rollout stage on a tiny policy with ~1 nat of entropy per token at T=1, a trainer and a
    reference model holding the same weights, in ``dtype``. The trainer's lr is 0: updates leave
    the weights as they were, so one rollout serves several updates."""
    cfg = load_config("configs/tiny.yaml", [
        f"task.num_prompts={n}", "task.max_terms=6", f"rollout.prompts_per_step={n}", "rollout.group_size=3",
        "rollout.max_new_tokens=30", "model.hidden_size=32", "model.intermediate_size=64",
        "model.num_hidden_layers=2", f"rollout.temperature={temperature}", f"rollout.top_k={top_k}",
        f"rollout.top_p={top_p}", "grpo.drop_zero_variance=false", "grpo.kl_coef=0.1"])
    inputs = prepare_inputs(cfg)
    model = _policy_with_entropy(inputs.args)
    engine = Engine(model, EngineConfig(max_batch_size=12, max_seq_len=96, dtype=dtype), seed=5)  # model -> dtype
    ref = _policy_with_entropy(inputs.args).to(engine.dtype).eval()
    trainer = Trainer(model.args, TrainerConfig(lr=0.0, micro_batch_size=4, dtype=dtype), dims,
                      hf_state=model.hf_state_dict())
    stage = RolloutStage(engine, inputs, cfg.rollout, cfg.reward)
    groups = stage.run(list(range(n)), step=0)
    stage.close()
    return cfg, inputs, trainer, ref, groups


def _capture_loss_inputs(monkeypatch):
    """Record what the GRPO loss sees in every micro-batch: the new logprobs and the batch."""
    seen = []
    real = grpo_mod.grpo_loss

    def spy(logprobs, *args, **kw):
        seen.append((logprobs.detach(), kw.get("ref_logprobs")))
        return real(logprobs, *args, **kw)

    monkeypatch.setattr(grpo_mod, "grpo_loss", spy)
    return seen


def _engine_logprobs(groups) -> dict[tuple, list[float]]:
    return {tuple(r.prompt_ids + r.tokens): r.logprobs for g in groups for r in g.results}


def _max_diff_to_engine(seen, ids_of_call, groups) -> float:
    """Largest |logprob - engine logprob| over the response tokens of the recorded micro-batches
    (rows are matched to samples by their tokens: micro-batches are length-sorted)."""
    eng, worst, n = _engine_logprobs(groups), 0.0, 0
    for lp, (ids, mask) in zip(seen, ids_of_call):
        for i in range(ids.shape[0]):
            pos = mask[i].nonzero()[:, 0]
            want = torch.tensor(eng[tuple(ids[i, :int(pos[-1]) + 2].tolist())], dtype=torch.float64)
            worst = max(worst, (lp[i, pos].double() - want).abs().max().item())
            n += 1
    assert n == sum(len(g.results) for g in groups)  # every sample was compared
    return worst


def _record_batches(monkeypatch, trainer):
    """Record (input_ids, loss_mask) of each micro-batch the loss runs on, in order."""
    rows = []
    real = trainer._forward_backward

    def fb(mbs, loss_fn, temperature=1.0):
        if loss_fn is not None:
            rows.extend((mb["input_ids"], mb["loss_mask"]) for mb in mbs)
        return real(mbs, loss_fn, temperature)

    monkeypatch.setattr(trainer, "_forward_backward", fb)
    return rows


@pytest.mark.parametrize("temperature,dtype", [(0.7, "float32"), (1.3, "float32"),
                                               pytest.param(0.7, "float64", marks=cpu_fp64)])
def test_on_policy_check_holds_at_temperature(dims, monkeypatch, temperature, dtype):
    """grpo_update reports logprob_diff_max at T != 1 and it is rounding-level; the new logprobs
    the loss sees (train_step) and the reference's (KL) are the engine's too."""
    cfg, inputs, trainer, ref, groups = _setup(dims, temperature, dtype)
    seen, mbs = _capture_loss_inputs(monkeypatch), _record_batches(monkeypatch, trainer)
    out = grpo_update(trainer, groups, UpdateSpec.of(cfg, inputs.tokenizer.pad_id), ref=ref)
    assert out["logprob_diff_max"] < TOL[dtype]
    assert _max_diff_to_engine([lp for lp, _ in seen], mbs, groups) < TOL[dtype]
    assert _max_diff_to_engine([r for _, r in seen], mbs, groups) < 1e-5  # the reference's: fp32
    assert abs(out["kl"]) < 1e-6  # same weights, same temperature: no KL (k3 rounds to either side of 0)


def test_on_policy_check_catches_a_trainer_that_ignores_temperature(dims, monkeypatch):
    """The check is not vacuous: a trainer scoring at T=1 what was sampled at T=0.7 is off by far
    more than rounding."""
    cfg, inputs, trainer, ref, groups = _setup(dims, 0.7)
    real = trainer_mod.vocab_parallel_logprobs
    monkeypatch.setattr(trainer_mod, "vocab_parallel_logprobs",
                        lambda logits, targets, group, vocab, temperature=1.0: real(logits, targets, group, vocab))
    d = grpo_update(trainer, groups, UpdateSpec.of(cfg, inputs.tokenizer.pad_id), ref=ref)["logprob_diff_max"]
    assert d > 0.05


def test_update_refuses_responses_sampled_at_another_temperature(dims):
    """The trainer's temperature (UpdateSpec's) is checked against the one each result was sampled
    at: an update (or stream training) that would score at T=1 what was sampled at T=0.7 raises
    before any forward, naming the first such response; at the rollout's own temperature the
    other tests of this module pass the check."""
    cfg, inputs, trainer, ref, groups = _setup(dims, 0.7)
    assert {r.temperature for g in groups for r in g.results} == {0.7}
    spec = dataclasses.replace(UpdateSpec.of(cfg, inputs.tokenizer.pad_id), temperature=1.0)
    with pytest.raises(ValueError, match=r"at temperature 0.7, the trainer at 1.0 \(rollout.temperature\)"):
        grpo_update(trainer, groups, spec, ref=ref)
    stream = StreamUpdate(trainer, spec, ref=ref)
    stream.begin()
    with pytest.raises(ValueError, match="at temperature 0.7, the trainer at 1.0"):
        stream.add_group(groups[0])


def test_stream_update_scores_at_temperature(dims, monkeypatch):
    """Stream training (StreamUpdate) passes the rollout's temperature to the trainer and the
    reference as well."""
    cfg, inputs, trainer, ref, groups = _setup(dims, 0.7)
    seen, mbs = _capture_loss_inputs(monkeypatch), _record_batches(monkeypatch, trainer)
    stream = StreamUpdate(trainer, UpdateSpec.of(cfg, inputs.tokenizer.pad_id), ref=ref)
    stream.begin()
    for g in groups:
        stream.add_group(g)
    out = stream.finish(groups)
    assert _max_diff_to_engine([lp for lp, _ in seen], mbs, groups) < 1e-5
    assert _max_diff_to_engine([r for _, r in seen], mbs, groups) < 1e-5
    assert out["update_ok"] == 1.0


def test_top_k_top_p_logprobs_are_of_the_unfiltered_distribution(dims, monkeypatch):
    """The documented convention (verl's and slime's): with top-k/top-p on, the engine reports and
    the trainer computes log softmax(logits / T) of the unfiltered distribution. They agree, and
    they differ from the renormalised filtered distribution's logprobs (the filters did cut)."""
    temperature, k, p = 0.7, 8, 0.9
    cfg, inputs, trainer, ref, groups = _setup(dims, temperature, top_k=k, top_p=p)
    out = grpo_update(trainer, groups, UpdateSpec.of(cfg, inputs.tokenizer.pad_id), ref=ref)
    assert out["logprob_diff_max"] < 1e-5
    filtered_gap = 0.0
    for r in (r for g in groups for r in g.results):
        ids = torch.tensor([r.prompt_ids + r.tokens])
        with torch.no_grad():
            logits = ref(ids)[0, len(r.prompt_ids) - 1:-1].float()
        tok = torch.tensor(r.tokens)
        kept = torch.log_softmax(filter_logits(logits, temperature, k, p), -1).gather(1, tok[:, None])[:, 0]
        assert torch.isfinite(kept).all()  # every sampled token lies inside the filters
        filtered_gap = max(filtered_gap, (kept - torch.tensor(r.logprobs)).abs().max().item())
    assert filtered_gap > 0.05


def test_sft_trains_at_temperature_1_whatever_the_rollout_temperature():
    """SFT is a supervised NLL of the data, not of the sampling distribution."""
    cfg = load_config("configs/tiny.yaml", ["rollout.temperature=0.7", "sft.steps=2", "sft.batch_size=2",
                                            "task.num_prompts=4", "progress=false"])
    temps = []
    fake = types.SimpleNamespace(
        dims=types.SimpleNamespace(rank=0, dp_rank=0, dp=1), set_lr=lambda lr: None,
        train_step=lambda batch, loss_fn, temperature=None: temps.append(temperature) or {"loss": 0.0})
    sft.run_sft(fake, prepare_inputs(cfg), cfg.sft, cfg.seed)
    assert temps == [1.0, 1.0]

