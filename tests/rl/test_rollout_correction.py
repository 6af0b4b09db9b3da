"""Rollout correction (``grpo.rollout_correction``): the loss and gradient of TIS and MIS on a
hand-computed case, and the config's checks."""
import math

import pytest
import torch

from megarl.rl.grpo import GRPOConfig, grpo_loss_fn

# Trainer probabilities of three sampled tokens, the engine's of the same tokens, and a padding
# position (-inf logprobs, masked). rho = pi_old / pi_engine = 1.25, 0.4, 4.0.
TRAINER = [0.5, 0.2, 0.4]
ENGINE = [0.4, 0.5, 0.1]
A, N = 1.5, 3.0


def _loss_and_grad(mode: str, threshold: float = 2.0):
    lp = torch.tensor([[*map(math.log, TRAINER), -math.inf]], dtype=torch.float64, requires_grad=True)
    mb = {"advantages": torch.tensor([A], dtype=torch.float64),
          "loss_mask": torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
          "rollout_logprobs": torch.tensor([[*map(math.log, ENGINE), 0.0]], dtype=torch.float64)}
    fn = grpo_loss_fn(GRPOConfig(rollout_correction=mode, rollout_correction_threshold=threshold), N)
    loss, metrics = fn(lp, mb)
    loss.backward()
    return loss.item(), lp.grad[0].tolist(), metrics


@pytest.mark.parametrize("mode, weights", [
    ("none", [1.0, 1.0, 1.0]),
    ("tis", [1.25, 0.4, 2.0]),   # min(rho, 2)
    ("mis", [1.25, 0.0, 0.0]),   # rho in [1/2, 2] kept, 0.4 and 4.0 rejected
])
def test_loss_and_gradient_are_the_weighted_formula(mode, weights):
    """One optimizer step per RL step: the PPO ratio is 1, so each token's loss is -w * A / N and
    its gradient with respect to its logprob -w * A / N; the padding's gradient is 0, not NaN."""
    loss, grad, metrics = _loss_and_grad(mode)
    assert loss == pytest.approx(-sum(weights) * A / N, abs=1e-12)
    assert grad[:3] == pytest.approx([-w * A / N for w in weights], abs=1e-12)
    assert grad[3] == 0.0
    if mode == "none":
        assert not any(k.startswith("is_") for k in metrics)
        return
    assert metrics["is_ratio"] == pytest.approx((1.25 + 0.4 + 4.0) / N, abs=1e-12)
    assert metrics["is_ratio_max"] == pytest.approx(4.0, abs=1e-12)
    frac = "is_clip_frac" if mode == "tis" else "is_mask_frac"
    assert metrics[frac] == pytest.approx((1 if mode == "tis" else 2) / N)


def test_correction_uses_the_old_policy_not_the_new():
    """With a separate old forward (``old=``), rho is pi_old / pi_engine: the new logprobs move
    the PPO ratio, not the correction's weights."""
    old = torch.tensor([[math.log(0.4)]], dtype=torch.float64)
    lp = torch.tensor([[math.log(0.44)]], dtype=torch.float64, requires_grad=True)  # PPO ratio 1.1
    mb = {"advantages": torch.tensor([1.0], dtype=torch.float64), "loss_mask": torch.ones(1, 1),
          "rollout_logprobs": torch.tensor([[math.log(0.16)]], dtype=torch.float64), "old": old}  # rho 2.5
    fn = grpo_loss_fn(GRPOConfig(rollout_correction="tis", rollout_correction_threshold=2.0), 1.0, old="old")
    loss, metrics = fn(lp, mb)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0 * 1.1, abs=1e-12)  # w = min(2.5, 2) times the PPO ratio 1.1
    assert lp.grad.item() == pytest.approx(-2.0 * 1.1, abs=1e-12)  # d(ratio)/d(lp) = ratio
    assert metrics["is_ratio"] == pytest.approx(2.5) and metrics["is_clip_frac"] == 1.0


def test_correction_without_engine_logprobs_and_bad_threshold_are_refused():
    fn = grpo_loss_fn(GRPOConfig(rollout_correction="mis"), 1.0)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        fn(torch.zeros(1, 1, requires_grad=True), {"advantages": torch.zeros(1), "loss_mask": torch.ones(1, 1)})
    with pytest.raises(ValueError, match="rollout_correction_threshold=1.0"):
        GRPOConfig(rollout_correction_threshold=1.0)
