"""``grpo.rollout_correction`` through the trainer (micro-batches, the old policy = the training
forward's own logprobs): the identity with an exact engine, the formula with a perturbed one."""
import math

import pytest
import torch

from megarl.engine import Engine, EngineConfig
from megarl.parallel.weight_sync import WeightSync
from megarl.rl.grpo import GRPOConfig, UpdateSpec
from megarl.rollout.stage import RolloutStage
from megarl.stages.update import grpo_update
from megarl.trainer.trainer import Trainer, TrainerConfig
from tests.rl.test_temperature_logprobs import _setup, dims  # noqa: F401 (dims: the fixture)
from tests.spec.test_spec_engine import _policy_with_entropy

cpu_fp64 = pytest.mark.skipif(torch.cuda.is_available(), reason="fp64 Megatron training is a CPU-only test mode")


def _spread_rewards(groups, seed):
    g = torch.Generator().manual_seed(seed)
    for grp in groups:  # rewards with a spread, so that the policy gradient is not zero
        grp.rewards = torch.rand(len(grp.results), generator=g).tolist()


def _train_steps(dims, cfg, inputs, grpo: GRPOConfig, steps: int):  # noqa: F811
    """``steps`` synchronous steps (rollout by the engine, update, weight sync) in fp64."""
    model = _policy_with_entropy(inputs.args)
    engine = Engine(model, EngineConfig(max_batch_size=12, max_seq_len=96, dtype="float64"), seed=5)
    trainer = Trainer(model.args, TrainerConfig(lr=1e-2, micro_batch_size=4, dtype="float64"), dims,
                      hf_state=model.hf_state_dict())
    stage = RolloutStage(engine, inputs, cfg.rollout, cfg.reward)
    spec = UpdateSpec(grpo, cfg.rollout.group_size, cfg.rollout.temperature, inputs.tokenizer.pad_id)
    outs, sync = [], WeightSync(trainer, engine)
    for step in range(steps):
        groups = stage.run(list(range(len(inputs.problems))), step=step)
        _spread_rewards(groups, step)
        outs.append(grpo_update(trainer, groups, spec))
        sync()
    stage.close()
    return outs, trainer.hf_state_dict(), model


@cpu_fp64
def test_exact_engine_makes_the_correction_the_identity(dims):  # noqa: F811
    """The engine samples the trainer's distribution (fp64): rho is 1 up to rounding, so three
    steps with tis or mis end at none's weights, and nothing is clipped or masked."""
    cfg, inputs, _, _, _ = _setup(dims, 0.8, "float64")
    runs = {mode: _train_steps(dims, cfg, inputs, GRPOConfig(rollout_correction=mode, drop_zero_variance=False), 3)
            for mode in ("none", "tis", "mis")}
    base = _policy_with_entropy(inputs.args).hf_state_dict()
    want = runs["none"][1]
    assert min(max((w[k] - base[k]).abs().max().item() for k in w) for w in (want,)) > 1e-4  # the steps moved it
    for mode in ("tis", "mis"):
        outs, got, _ = runs[mode]
        assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-12, mode
        for o in outs:
            assert abs(o["is_ratio"] - 1.0) < 1e-10 and abs(o["is_ratio_max"] - 1.0) < 1e-10
            assert o[{"tis": "is_clip_frac", "mis": "is_mask_frac"}[mode]] == 0.0


@cpu_fp64
@pytest.mark.parametrize("mode, shift, scale", [
    ("tis", math.log(1.5), 1.5),   # rho = 1.5 everywhere: within C, every term weighted 1.5
    ("tis", math.log(3.0), 2.0),   # rho = 3: truncated at C = 2
    ("mis", math.log(1.5), 1.5),   # kept, weighted by rho
    ("mis", math.log(3.0), 0.0),   # rejected: no policy gradient at all
])
def test_perturbed_engine_logprobs_scale_the_update_by_the_formula(dims, mode, shift, scale):  # noqa: F811
    """Engine logprobs lowered by ``shift`` make rho = exp(shift) on every token; the correction's
    weight is then one constant, so the step's loss and gradient norm are ``scale`` times the
    uncorrected step's (the KL term, 0 at the reference, is not weighted)."""
    cfg, inputs, trainer, ref, groups = _setup(dims, 0.8, "float64")  # lr 0: the weights stay
    _spread_rewards(groups, 0)
    spec = UpdateSpec.of(cfg, inputs.tokenizer.pad_id)
    plain = grpo_update(trainer, groups, spec, ref=ref)
    for grp in groups:
        for r in grp.results:
            r.logprobs = [x - shift for x in r.logprobs]
    corrected = UpdateSpec(GRPOConfig(rollout_correction=mode, kl_coef=cfg.grpo.kl_coef, drop_zero_variance=False),
                           spec.group_size, spec.temperature, spec.pad_id)
    out = grpo_update(trainer, groups, corrected, ref=ref)
    assert plain["grad_norm"] > 1e-3
    # (Megatron takes the gradient norm in fp32; the KL term's gradient is rounding-level, ~1e-8)
    assert out["grad_norm"] == pytest.approx(scale * plain["grad_norm"], rel=1e-6, abs=1e-6)
    assert out["pg_loss"] == pytest.approx(scale * plain["pg_loss"], rel=1e-9, abs=1e-12)
    assert out["is_ratio"] == pytest.approx(math.exp(shift), rel=1e-9)
    assert out["is_ratio_max"] == pytest.approx(math.exp(shift), rel=1e-9)
    frac = out["is_clip_frac" if mode == "tis" else "is_mask_frac"]
    assert frac == (1.0 if scale in (2.0, 0.0) else 0.0)


@cpu_fp64
def test_stream_training_takes_the_same_corrected_update(dims):  # noqa: F811
    """Stream training (each group trained as it finishes, the normaliser applied at the end) with
    tis on engine logprobs perturbed per token gives the update and metrics of the plain one."""
    from megarl.stream_train.stream import StreamUpdate

    cfg, inputs, trainer, ref, groups = _setup(dims, 0.8, "float64")  # lr 0: the weights stay
    _spread_rewards(groups, 1)
    g = torch.Generator().manual_seed(3)
    for grp in groups:  # rho from e^-1.2 to e^1.2: some clipped at 2, some below 1
        for r in grp.results:
            r.logprobs = [x + float(d) for x, d in zip(r.logprobs, torch.empty(len(r.logprobs)).uniform_(
                -1.2, 1.2, generator=g))]
    base = UpdateSpec.of(cfg, inputs.tokenizer.pad_id)
    spec = UpdateSpec(GRPOConfig(rollout_correction="tis", kl_coef=cfg.grpo.kl_coef, drop_zero_variance=False),
                      base.group_size, base.temperature, base.pad_id)
    plain = grpo_update(trainer, groups, spec, ref=ref)
    stream = StreamUpdate(trainer, spec, ref=ref)
    stream.begin()
    for grp in groups:
        stream.add_group(grp)
    streamed = stream.finish(groups)
    assert 0 < plain["is_clip_frac"] < 1
    for key in ("loss", "pg_loss", "is_ratio", "is_ratio_max", "is_clip_frac"):
        assert streamed[key] == pytest.approx(plain[key], rel=1e-9, abs=1e-12), key
    assert streamed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
