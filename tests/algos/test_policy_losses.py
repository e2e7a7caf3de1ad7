"""CISPO, SAPO, GMPO and token-sum aggregation: hand-computed values and gradients, and the numbers of verl's
`core_algos` reproduced by independent few-line references (each names the verl function it follows)."""

import math

import pytest
import torch

from twinplane.algos import LossSettings, aggregate, normaliser, policy_loss, token_policy_loss, value_loss

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1]]).float()  # row 2 has a gap


def _random(seed=0, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    lp = (-1.0 + spread * torch.randn(4, 4, generator=g)).double().requires_grad_()
    old = (-1.0 + spread * torch.randn(4, 4, generator=g)).double()
    adv = torch.randn(4, 4, generator=g).double()
    return lp, old, adv, MASK.double()


def _grad(f, lp):
    (g,) = torch.autograd.grad(f, lp)
    return g


def test_cispo_by_hand():
    old = torch.zeros(1, 3)
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    m = torch.ones(1, 3)
    loss, clipped, ratio = token_policy_loss("cispo", lp, old, adv, m, LossSettings(clip_low=0.2, clip_high=0.3))
    # ratios 1.5, 0.5, 1.1 -> weights 1.3, 0.8, 1.1 (clipped, clipped, inside); loss = -w A log pi
    want = [-1.3 * 1.0 * math.log(1.5), -0.8 * -1.0 * math.log(0.5), -1.1 * 2.0 * math.log(1.1)]
    torch.testing.assert_close(loss, torch.tensor([want]))
    assert clipped.tolist() == [[True, True, False]]
    torch.testing.assert_close(ratio.detach(), torch.tensor([[1.5, 0.5, 1.1]]))
    # the clipped tokens still carry gradient: d/d lp = -w A (a ppo clip would give 0 on the first two)
    torch.testing.assert_close(_grad(loss.sum(), lp), torch.tensor([[-1.3, 0.8, -2.2]]))


def test_cispo_equals_verl():
    """verl `compute_policy_loss_cispo` with `agg_loss(..., "token-mean")`: value and gradient."""
    lp, old, adv, m = _random(1, spread=0.6)
    ratio = torch.exp((lp - old).clamp(-20, 20))
    pg = -ratio.clamp(1 - 0.2, 1 + 0.28).detach() * adv * lp
    want = (pg * m).sum() / m.sum()
    got, metrics = policy_loss("cispo", lp, old, adv, m, LossSettings(clip_low=0.2, clip_high=0.28))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_grad(got, lp), _grad(want, lp))
    verl_clipfrac = ((ratio != ratio.clamp(0.8, 1.28)).double() * m).sum() / m.sum()
    assert 0 < float(metrics["clip_frac"]) == pytest.approx(float(verl_clipfrac))


def test_sapo_by_hand():
    old = torch.zeros(1, 3)
    lp = torch.log(torch.tensor([[1.0, 1.5, 1.0]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, -2.0]])
    m = torch.ones(1, 3)
    s = LossSettings(clip_low=0.2, clip_high=0.2, sapo_tau=(1.0, 1.05))
    loss, clipped, _ = token_policy_loss("sapo", lp, old, adv, m, s)
    # gate(r) = sigmoid(tau (r - 1)) * 4 / tau; loss = -A gate. r = 1: 4 sigmoid(0) / tau = 2 / tau
    sig = 1 / (1 + math.exp(-1.05 * 0.5))
    torch.testing.assert_close(loss, torch.tensor([[-2.0, sig * 4 / 1.05, 2 * 2 / 1.05]]))
    assert not clipped.any()
    # at r = 1 the gradient is ppo's, -A: d gate / d lp = 4 sigmoid'(0) r = 1
    g = _grad(loss.sum(), lp)
    assert float(g[0, 0]) == pytest.approx(-1.0) and float(g[0, 2]) == pytest.approx(2.0)


def test_sapo_equals_verl():
    """verl `compute_policy_loss_sapo` (tau_pos 1.0, tau_neg 1.05; it always aggregates seq-mean-token-mean)."""
    lp, old, adv, m = _random(2, spread=0.5)
    ratio = torch.exp((lp - old).clamp(-20, 20))
    taus = torch.where(adv > 0, torch.tensor(1.0, dtype=adv.dtype), torch.tensor(1.05, dtype=adv.dtype))
    pg = -torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus) * adv
    seq = (pg * m).sum(-1) / (m.sum(-1) + 1e-8)
    want = seq.mean()  # every row has tokens
    got, _ = policy_loss("sapo", lp, old, adv, m, LossSettings(clip_low=0.2, clip_high=0.2), agg="seq-mean-token-mean")
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_grad(got, lp), _grad(want, lp))


def test_gmpo_by_hand():
    old = torch.zeros(2, 3)
    lp = torch.tensor([[0.5, -0.1, 9.0], [0.5, -0.4, 0.0]]).requires_grad_()
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the 9.0 is padding
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0]])
    loss, clipped, ratio = token_policy_loss("gmpo", lp, old, adv, m, LossSettings(clip_low=0.2, clip_high=0.2))
    # A > 0: min(x, clip(x, -0.2, 0.2)) = 0.2, -0.1 -> mean 0.05; A < 0: max(x, clip(x)) = 0.5, -0.2 -> mean 0.15
    torch.testing.assert_close(ratio[:, 0], torch.tensor([math.exp(0.05), math.exp(0.15)]))
    torch.testing.assert_close(loss[:, 0], torch.tensor([-math.exp(0.05), math.exp(0.15)]))
    assert clipped.tolist() == [[True, False, False], [False, True, False]]
    total = aggregate(loss, m, "seq-mean-token-mean")
    assert float(total.detach()) == pytest.approx((-math.exp(0.05) + math.exp(0.15)) / 2)
    # gradient of a row's -A exp(mean x): -A e^mean / |y| on each unclipped token, 0 on the clipped one
    g = _grad(total, lp)
    torch.testing.assert_close(g, torch.tensor([[0.0, -math.exp(0.05) / 4, 0.0], [math.exp(0.15) / 4, 0.0, 0.0]]))


def test_gmpo_equals_verl_with_is_weights():
    """verl `compute_policy_loss_geo_mean` (its `rollout_is_weights` folded in by their geometric mean per row;
    it averages over all rows, which here all have tokens) against gmpo under seq-mean-token-mean."""
    lp, old, adv, m = _random(3, spread=0.3)
    adv = adv[:, :1].expand(4, 4)  # GMPO's sequence advantage
    g = torch.Generator().manual_seed(4)
    w = (0.5 + 1.5 * torch.rand(4, 4, generator=g)).double()
    x = lp - old
    sgn = torch.sign(adv)
    x_min = sgn * torch.min(sgn * x, sgn * torch.clamp(x, -0.4, 0.4))
    n = m.sum(-1)
    ratio = torch.exp((x_min * m).sum(-1) / (n + 1e-8))
    pg = -((adv * m).sum(-1) / (n + 1e-8)) * ratio
    pg = pg * torch.exp((torch.log(w + 1e-10) * m).sum(-1) / (n + 1e-8))
    want = pg.mean()
    got, _ = policy_loss("gmpo", lp, old, adv, m, LossSettings(clip_low=0.4, clip_high=0.4), agg="seq-mean-token-mean",
                         is_weights=w)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_grad(got, lp), _grad(want, lp))


def test_token_sum_aggregation_policy_value_and_plain():
    """token-sum is the masked sum with no denominator (verl's token-sum mode of `agg_loss` was not available to
    compare against: the expected values are that definition)."""
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert float(aggregate(loss, m, "token-sum")) == 10.0
    assert float(aggregate(loss, m, "token-sum", norm=7.0)) == 10.0  # no denominator, global or local
    assert normaliser(m, "token-sum") == 1.0
    parts = sum(aggregate(loss[i:i + 1], m[i:i + 1], "token-sum", norm=1.0) for i in range(3))
    assert float(parts) == 10.0  # additive over micro-batches and ranks
    adv = torch.tensor([[1.0, -2.0, 0.5], [3.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    pg, _ = policy_loss("ppo", torch.zeros(3, 3), torch.zeros(3, 3), adv, m, LossSettings(clip_low=0.2, clip_high=0.2),
                        agg="token-sum")
    assert float(pg) == pytest.approx(-(1.0 - 2.0 + 0.5 + 3.0))  # ratio 1: -A summed over the masked tokens
    v, old_v, ret = torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[0.0, 0.0, 1.9]]), torch.tensor([[2.0, 1.0, 0.0]])
    vf, _ = value_loss(v, old_v, ret, torch.ones(1, 3), clip=0.5, agg="token-sum")
    assert float(vf) == pytest.approx(0.5 * (2.25 + 1.0 + 4.0))  # the terms of test_value_loss_by_hand, summed


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="unknown policy loss 'nope'"):
        token_policy_loss("nope", torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1),
                          LossSettings(clip_low=0.2, clip_high=0.2))
