"""The plain GRPO update takes no separate old-logprob forward. With one optimizer
step per RL step the ratio's old logprobs are the training forward's own, detached; the update and
the on-policy check ``logprob_diff_max`` are those of the update with the separate forward."""
import pytest
import torch

from megarl.rl.grpo import UpdateSpec, grpo_batch, logprob_diff_max
from megarl.stages.update import grpo_update
from megarl.trainer.trainer import Trainer, TrainerConfig
from tests.rl.test_temperature_logprobs import _setup, dims  # noqa: F401 (dims: the fixture)

cpu_fp64 = pytest.mark.skipif(torch.cuda.is_available(), reason="fp64 Megatron training is a CPU-only test mode")


@cpu_fp64
def test_update_without_old_forward_is_the_same_step(dims):  # noqa: F811
    cfg, inputs, base, ref, groups = _setup(dims, 0.8, "float64")
    spec = UpdateSpec.of(cfg, inputs.tokenizer.pad_id)
    g = torch.Generator().manual_seed(0)
    for grp in groups:  # rewards with a spread, so that the policy gradient is not zero
        grp.rewards = torch.rand(len(grp.results), generator=g).tolist()
    # the on-policy check as the separate forward computed it before the step
    batch = grpo_batch(groups, spec.group_size, spec.pad_id, cfg.grpo.normalize_std, spec.temperature)
    old_lp = base.masked_logprobs(batch["input_ids"], batch["loss_mask"], temperature=spec.temperature)
    want_diff = logprob_diff_max(old_lp, batch["rollout_logprobs"], batch["loss_mask"])
    runs = {}
    for old_forward in (True, False):
        tr = Trainer(base.args, TrainerConfig(lr=1e-2, micro_batch_size=4, dtype="float64"), dims,
                     hf_state=base.hf_state_dict())
        calls = []
        real = tr._forward_backward
        tr._forward_backward = lambda mbs, fn, t=1.0: calls.append(fn is None) or real(mbs, fn, t)
        out = grpo_update(tr, groups, spec, ref=ref, old_forward=old_forward)
        assert calls == ([True, False] if old_forward else [False])  # forward-only passes, then the training one
        runs[old_forward] = out, tr.hf_state_dict()
    (with_old, w_old), (without, w_new) = runs[True], runs[False]
    assert without["update_ok"] == 1.0 and without["grad_norm"] > 1e-3
    moved = max((w_new[k] - base.hf_state_dict()[k]).abs().max().item() for k in w_new)
    assert moved > 1e-4  # the step did move the weights
    assert max((w_new[k] - w_old[k]).abs().max().item() for k in w_new) < 1e-12
    for key in ("loss", "pg_loss", "kl", "grad_norm"):
        assert abs(with_old[key] - without[key]) < 1e-12, key
    assert abs(without["ratio"] - 1.0) < 1e-12 and without["clip_frac"] == 0.0  # ratio 1: nothing clipped
    # logprob_diff_max: the training forward's, max over its 3 micro-batches, = the separate forward's
    assert 0 < without["logprob_diff_max"] < 1e-10
    assert without["logprob_diff_max"] == pytest.approx(want_diff, rel=1e-6, abs=1e-15)
    assert with_old["logprob_diff_max"] == without["logprob_diff_max"]
