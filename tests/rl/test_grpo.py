"""GRPO functions against numbers worked out by hand (the arithmetic is in the comments)."""
import math
import types

import pytest
import torch

from megarl.engine import Result
from megarl.rl.grpo import group_advantages, grpo_batch, grpo_loss, kl_k3, sft_loss

LN2 = math.log(2.0)


def test_group_advantages_std_normalised():
    # Group 1 (G=3): r = 1, 0, 0. mean = 1/3, deviations = 2/3, -1/3, -1/3.
    #   unbiased var = (4/9 + 1/9 + 1/9) / (3-1) = 1/3  ->  std = 1/sqrt(3) = 0.577350
    #   A = (2/3)/0.577350 = 1.154701, (-1/3)/0.577350 = -0.577350 (twice)
    # Group 2: r = 1, 1, 1: std 0 -> A = 0/(0+eps) = 0.
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    a = group_advantages(r, group_size=3)
    torch.testing.assert_close(a, torch.tensor([1.154701, -0.577350, -0.577350, 0.0, 0.0, 0.0]),
                               atol=1e-5, rtol=0)


def test_group_advantages_g2_and_unnormalised():
    # G=2, group 1: r = 1, 0: mean .5, deviations +-.5, unbiased std = sqrt((.25+.25)/1) = 0.707107
    #   -> A = +-0.707107. Group 2: .5, .5 -> 0.
    r = torch.tensor([1.0, 0.0, 0.5, 0.5])
    torch.testing.assert_close(group_advantages(r, 2), torch.tensor([0.707107, -0.707107, 0.0, 0.0]),
                               atol=1e-5, rtol=0)
    # normalize_std=False: r - mean only.
    torch.testing.assert_close(group_advantages(r, 2, normalize_std=False), torch.tensor([0.5, -0.5, 0.0, 0.0]))
    # Integer rewards are accepted; G=1 gives zeros, not NaN.
    assert group_advantages(torch.tensor([3, 1]), 1).tolist() == [0.0, 0.0]


def test_group_advantages_bad_group_size():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 3), 3)


def test_kl_k3():
    # lp = log .5, ref = log .25: d = ref - lp = -ln2, k3 = e^-ln2 + ln2 - 1 = 0.5 + 0.693147 - 1 = 0.193147
    # lp = ref: d = 0 -> k3 = 1 - 0 - 1 = 0.
    lp = torch.log(torch.tensor([0.5, 0.3]))
    ref = torch.log(torch.tensor([0.25, 0.3]))
    torch.testing.assert_close(kl_k3(lp, ref), torch.tensor([0.193147, 0.0]), atol=1e-6, rtol=0)


def _batch():
    # Two sequences, T=3. Seq 0 has A=+1 and ratios 1.1, 1.5, 0.5; seq 1 has A=-1 and ratios
    # 0.5, 1.5 and a padding token (holding -inf / NaN to check it cannot leak in).
    old = torch.full((2, 3), math.log(0.5), dtype=torch.float64)
    ratios = torch.tensor([[1.1, 1.5, 0.5], [0.5, 1.5, 1.0]], dtype=torch.float64)
    lp = (old + ratios.log()).clone()
    lp[1, 2] = float("-inf")
    old[1, 2] = float("-inf")
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    return lp.requires_grad_(), old, adv, mask


def test_grpo_loss_hand_computed():
    lp, old, adv, mask = _batch()
    # eps 0.2/0.2: clip range [0.8, 1.2]. pg = -min(r*A, clip(r)*A):
    #   seq0 (A=+1): r=1.1 -> -min(1.1, 1.1) = -1.1 ; r=1.5 -> -min(1.5, 1.2) = -1.2 (clipped)
    #                r=0.5 -> -min(0.5, 0.8) = -0.5
    #   seq1 (A=-1): r=0.5 -> -min(-0.5, -0.8) = 0.8 (clipped) ; r=1.5 -> -min(-1.5, -1.2) = 1.5
    #   sum = -1.1 - 1.2 - 0.5 + 0.8 + 1.5 = -0.5 ; num_tokens = 5 -> loss = -0.1
    #   clip_frac = 2/5 = 0.4 ; mean ratio = (1.1+1.5+0.5+0.5+1.5)/5 = 1.02
    loss, m = grpo_loss(lp, old, adv, mask, num_tokens=5)
    assert loss.item() == pytest.approx(-0.1, abs=1e-12)
    assert m["pg_loss"] == pytest.approx(-0.1, abs=1e-12)
    assert m["clip_frac"] == pytest.approx(0.4)
    assert m["ratio"] == pytest.approx(1.02)
    assert "kl" not in m
    # d loss / d lp = -r*A/5 where unclipped, 0 where clipped or masked:
    #   seq0: -1.1/5 = -0.22, 0, -0.5/5 = -0.1 ; seq1: 0, 1.5/5 = 0.3, 0 (padding, not NaN)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.22, 0.0, -0.1], [0.0, 0.3, 0.0]], dtype=torch.float64))


def test_grpo_loss_clip_higher():
    lp, old, adv, mask = _batch()
    # clip_eps_high = 0.6: range [0.8, 1.6]; seq0 r=1.5 is now unclipped -> -1.5.
    #   sum = -1.1 - 1.5 - 0.5 + 0.8 + 1.5 = -0.8 -> loss = -0.16 ; clip_frac = 1/5 (seq1 r=0.5 only)
    loss, m = grpo_loss(lp, old, adv, mask, num_tokens=5, clip_eps_high=0.6)
    assert loss.item() == pytest.approx(-0.16, abs=1e-12)
    assert m["clip_frac"] == pytest.approx(0.2)


def test_grpo_loss_with_kl():
    lp, old, adv, mask = _batch()
    # ref = lp + ln2 on every token: d = ln2, k3 = 2 - ln2 - 1 = 0.306853 per token.
    #   kl metric = 5 * 0.306853 / 5 = 0.306853 ; loss = -0.1 + 0.1 * 0.306853 = -0.0693147
    ref = lp.detach() + LN2
    loss, m = grpo_loss(lp, old, adv, mask, num_tokens=5, kl_coef=0.1, ref_logprobs=ref)
    assert m["kl"] == pytest.approx(1 - LN2, abs=1e-12)
    assert loss.item() == pytest.approx(-0.1 + 0.1 * (1 - LN2), abs=1e-12)
    assert m["pg_loss"] == pytest.approx(-0.1, abs=1e-12)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, old, adv, mask, num_tokens=5, kl_coef=0.1)


def test_grpo_loss_micro_batches_sum_to_step():
    # Stream training: micro-batch losses/metrics normalised by the step's token count add up.
    lp, old, adv, mask = _batch()
    full, mf = grpo_loss(lp, old, adv, mask, num_tokens=5)
    parts = [grpo_loss(lp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], num_tokens=torch.tensor(5.0))
             for i in range(2)]
    assert sum(p[0] for p in parts).item() == pytest.approx(full.item(), abs=1e-12)
    for key in mf:
        assert sum(p[1][key] for p in parts) == pytest.approx(mf[key], abs=1e-12)


def test_grpo_loss_validation():
    lp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="num_tokens"):
        grpo_loss(lp, old, adv, mask, num_tokens=0)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(lp, old, adv[:1], mask, num_tokens=5)
    with pytest.raises(ValueError, match="same"):
        grpo_loss(lp, old[:, :2], adv, mask, num_tokens=5)


def test_sft_loss():
    # -(ln .5 + ln .25 + ln 1) / 3 = (0.693147 + 1.386294) / 3 = 0.693147 ; masked -inf ignored.
    lp = torch.log(torch.tensor([[0.5, 0.25], [1.0, 0.0]], dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[1, 1], [1, 0]])
    loss = sft_loss(lp, mask, num_tokens=3)
    assert loss.item() == pytest.approx(LN2, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 3, -1 / 3], [-1 / 3, 0.0]], dtype=torch.float64))


def _group(temperatures):
    results = [Result(uid=5, sample_idx=i, prompt_ids=[1, 2], tokens=[3, 4], logprobs=[-0.5, -0.25],
                      entropies=[0.1, 0.2], finish_reason="stop", n_forwards=2, temperature=t)
               for i, t in enumerate(temperatures)]
    return types.SimpleNamespace(results=results, rewards=[1.0, 0.0][:len(results)])


def test_grpo_batch_checks_the_temperature_responses_were_sampled_at():
    """The trainer scores at its temperature; a response sampled at another one is refused with one
    error naming it (and the batch is built when they agree, greedy included)."""
    batch = grpo_batch([_group([0.7, 0.7])], 2, 0, True, 0.7)
    assert batch["rollout_logprobs"][0, 1:3].tolist() == [-0.5, -0.25]
    grpo_batch([_group([0.0, 0.0])], 2, 0, True, 0.0)  # greedy sampled, greedy scored (both read as T = 1)
    with pytest.raises(ValueError, match=r"1 of 2 responses .* uid=5 sample_idx=1 at temperature 1.0, "
                                         r"the trainer at 0.7 \(rollout.temperature\)"):
        grpo_batch([_group([0.7, 1.0])], 2, 0, True, 0.7)
    with pytest.raises(ValueError, match="sample_idx=0 at temperature 0.0, the trainer at 1.0"):
        grpo_batch([_group([0.0, 0.0])], 2, 0, True, 1.0)
