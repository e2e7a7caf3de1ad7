"""Advantages, the clipped loss and the KL estimators against hand-computed values."""

import math

import pytest
import torch

from twinplane.algos import clipped_policy_loss, grpo_advantages, kl_penalty, token_sum


def test_grpo_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = grpo_advantages(r, group_size=4)
    # group 1: mean 0.25, unbiased std = sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    want = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6)
    torch.testing.assert_close(adv[:4], want)
    assert torch.equal(adv[4:], torch.zeros(4))  # zero-variance group: no signal
    torch.testing.assert_close(grpo_advantages(r, 4, norm_by_std=False)[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    with pytest.raises(ValueError):
        grpo_advantages(r, 3)


def test_clipped_loss_by_hand():
    old = torch.zeros(1, 4)
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]]))  # ratios
    adv = torch.tensor([[1.0, -1.0, -2.0, 1.0]])
    loss, clipped = clipped_policy_loss(lp, old, adv, clip_low=0.2, clip_high=0.3)
    # token 0: A>0, r=1.5 -> clip to 1.3: max(-1.5, -1.3) = -1.3 (clipped)
    # token 1: A<0, r=0.5 -> clip to 0.8: max(0.5, 0.8) = 0.8 (clipped)
    # token 2: A<0, r=1.1 in range: 2.2 (not clipped)
    # token 3: A>0, r=0.7 -> clip 0.8: max(-0.7, -0.8) = -0.7 (not clipped: pessimistic bound is the unclipped)
    torch.testing.assert_close(loss, torch.tensor([[-1.3, 0.8, 2.2, -0.7]]))
    assert clipped.tolist() == [[True, True, False, False]]


def test_kl_estimators_by_hand():
    lp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.4)])
    x = [math.log(2.0), math.log(0.5)]
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor(x))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([0.5 * v * v for v in x]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([0.5 - 1 + x[0], 2.0 - 1 + x[1]]))
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k4")


def test_kl_estimators_brute_force():
    """Sample means of k1 and k3 approach the exact KL(p || q); k2 approaches it to second order."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.4, 0.4, 0.2])
    exact = float((p * (p / q).log()).sum())
    idx = torch.multinomial(p, 200_000, replacement=True, generator=g)
    lp, lq = p.log()[idx], q.log()[idx]
    for est, tol in (("k1", 2e-3), ("k3", 2e-3), ("k2", 5e-3)):
        assert abs(float(kl_penalty(lp, lq, est).mean()) - exact) < tol, est


def test_token_sum_is_global_token_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    parts = token_sum(x[:1], m[:1], 3) + token_sum(x[1:], m[1:], 3)
    assert float(parts) == pytest.approx((1 + 2 + 4) / 3)
