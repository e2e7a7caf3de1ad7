"""The algorithms' pure functions against hand-computed values and independent brute-force loops."""

import functools
import math

import pytest
import torch

from twinplane.algos import (
    AdvantageSettings,
    LossSettings,
    advantages,
    aggregate,
    kl_penalty,
    normaliser,
    policy_loss,
    token_policy_loss,
    value_loss,
)
from twinplane.algos.dapo import informative, overlong_penalty
from twinplane.algos.ppo import KLController, outcome_token_rewards

# Rows: two groups labelled 7 and 3, interleaved (not contiguous); row 4 has a gap (tool tokens); row 5 is empty.
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 1], [0, 0, 0, 0]]).float()
GROUPS = torch.tensor([7, 3, 7, 3, 7, 3])
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # group 7: 1, 0, 1 (a tie); group 3: 0, 1, 1


def _brute_whiten(x, mask):
    vals = [float(x[i, j]) for i in range(x.shape[0]) for j in range(x.shape[1]) if mask[i, j]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return torch.tensor([[(float(x[i, j]) - mean) / math.sqrt(var + 1e-8) if mask[i, j] else 0.0
                          for j in range(x.shape[1])] for i in range(x.shape[0])])


def test_grpo_and_rloo_by_label_with_ties():
    tr = outcome_token_rewards(SCORES, MASK)
    assert tr.sum(-1).tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]  # the empty row has no token to carry its score
    tr[5, 0] = 1.0  # put the empty row's score somewhere: the estimators read token_rewards.sum(-1)
    adv, ret = advantages("grpo", tr, MASK, group_ids=GROUPS)
    # group 7: scores 1, 0, 1 -> mean 2/3, unbiased std sqrt(1/3); group 3: 0, 1, 1 likewise
    std = math.sqrt(1 / 3)
    want = {0: (1 - 2 / 3) / (std + 1e-6), 1: (0 - 2 / 3) / (std + 1e-6), 2: (0 - 2 / 3) / (std + 1e-6),
            3: (1 - 2 / 3) / (std + 1e-6), 4: (1 - 2 / 3) / (std + 1e-6)}
    for i, v in want.items():
        torch.testing.assert_close(adv[i], v * MASK[i])
    assert torch.equal(adv[5], torch.zeros(4)) and torch.equal(ret, adv)
    dr, _ = advantages("grpo", tr, MASK, AdvantageSettings(norm_by_std=False), group_ids=GROUPS)
    torch.testing.assert_close(dr[0], (1 - 2 / 3) * MASK[0])
    rloo, _ = advantages("rloo", tr, MASK, group_ids=GROUPS)
    # s - mean(others): row 0 (group 7, others 0 and 1) = 1 - 0.5; row 2 = 0 - 1; row 1 (group 3) = 0 - 1
    for i, v in {0: 0.5, 2: -1.0, 4: 0.5, 1: -1.0, 3: 0.5}.items():
        torch.testing.assert_close(rloo[i], v * MASK[i])


def test_all_equal_group_and_single_sample_group_give_zero():
    mask = torch.ones(5, 2)
    tr = torch.tensor([[0, 2.0], [0, 2.0], [0, 2.0], [0, 1.0], [0, 0.0]])
    groups = torch.tensor([0, 0, 0, 1, 1])
    for name in ("grpo", "rloo", "reinforce_pp_baseline"):
        adv, _ = advantages(name, tr, mask, group_ids=groups)
        assert torch.equal(adv[:3, 0], torch.zeros(3)), name
    adv, _ = advantages("grpo", tr[:1], mask[:1], group_ids=torch.tensor([5]))  # a group of one: no baseline
    assert torch.equal(adv, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="group_ids"):
        advantages("grpo", tr, mask)
    with pytest.raises(ValueError, match="unknown"):
        advantages("nope", tr, mask, group_ids=groups)


def test_reinforce_pp_brute_force():
    g = torch.Generator().manual_seed(0)
    tr = torch.randn(6, 4, generator=g) * MASK
    gamma = 0.9
    adv, ret = advantages("reinforce_pp", tr, MASK, AdvantageSettings(gamma=gamma))
    # brute force: walk each row backwards over its masked tokens only (gaps carry G through)
    want = torch.zeros(6, 4)
    for i in range(6):
        G = 0.0
        for t in reversed(range(4)):
            if MASK[i, t]:
                G = float(tr[i, t]) + gamma * G
                want[i, t] = G
    torch.testing.assert_close(ret, want)
    assert ret[4, 1] == 0 and ret[4, 0] == pytest.approx(float(tr[4, 0]) + gamma * float(want[4, 2]))
    torch.testing.assert_close(adv, _brute_whiten(want, MASK))
    base, _ = advantages("reinforce_pp_baseline", outcome_token_rewards(SCORES, MASK), MASK, group_ids=GROUPS)
    s = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    means = {7: 2 / 3, 3: 1 / 3}  # row 5 (empty) scores 0 here: group 3 is 0, 1, 0
    raw = torch.tensor([[s[i] - means[int(GROUPS[i])]] * 4 for i in range(6)]) * MASK
    torch.testing.assert_close(base, _brute_whiten(raw, MASK))


def test_gae_brute_force_and_returns_before_whitening():
    g = torch.Generator().manual_seed(1)
    tr = torch.randn(6, 4, generator=g) * MASK
    values = torch.randn(6, 4, generator=g)
    gamma, lam = 0.95, 0.8
    adv, ret = advantages("gae", tr, MASK, AdvantageSettings(gamma=gamma, lam=lam), values=values)
    want = torch.zeros(6, 4)
    for i in range(6):
        steps = [t for t in range(4) if MASK[i, t]]  # the MDP's steps: masked tokens only
        A, next_v = 0.0, 0.0
        for t in reversed(steps):
            delta = float(tr[i, t]) + gamma * next_v - float(values[i, t])
            A = delta + gamma * lam * A
            want[i, t] = A
            next_v = float(values[i, t])
    torch.testing.assert_close(ret, (want + values) * MASK)
    torch.testing.assert_close(adv, _brute_whiten(want, MASK))
    with pytest.raises(ValueError, match="values"):
        advantages("gae", tr, MASK)


def test_ppo_loss_by_hand_with_dual_clip_and_clamps():
    old = torch.zeros(1, 6)
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7, 5.0, 1.0]]))
    lp[0, 5] = 50.0  # an extreme log-ratio: clamped to 20 before exp
    adv = torch.tensor([[1.0, -1.0, -2.0, 1.0, -1.0, -1.0]])
    m = torch.ones(1, 6)
    loss, clipped, ratio = token_policy_loss("ppo", lp, old, adv, m, LossSettings(clip_low=0.2, clip_high=0.3))
    # 0: A>0, r=1.5 -> 1.3: max(-1.5, -1.3) = -1.3 (clipped); 1: A<0, r=0.5 -> 0.8: max(0.5, 0.8) = 0.8 (clipped)
    # 2: A<0, r=1.1 in range: 2.2; 3: A>0, r=0.7: max(-0.7, -0.8) = -0.7; 4: A<0, r=5: 5; 5: A<0, r=e^20
    torch.testing.assert_close(loss, torch.tensor([[-1.3, 0.8, 2.2, -0.7, 5.0, math.exp(20.0)]]))
    assert clipped.tolist() == [[True, True, False, False, False, False]]
    assert ratio[0, 5] == pytest.approx(math.exp(20.0), rel=1e-5)
    dual, clipped, _ = token_policy_loss("ppo", lp, old, adv, m, LossSettings(clip_low=0.2, clip_high=0.3, clip_c=3.0))
    torch.testing.assert_close(dual, torch.tensor([[-1.3, 0.8, 2.2, -0.7, 3.0, 3.0]]))  # A<0 capped at -A c
    assert clipped.tolist() == [[True, True, False, False, True, True]]
    w = torch.tensor([[0.5, 1.0, 1.0, 1.0, 1.0, 2.0]])
    dual_clip = LossSettings(clip_low=0.2, clip_high=0.3, clip_c=3.0)
    weighted, _, _ = token_policy_loss("ppo", lp, old, adv, m, dual_clip, is_weights=w)
    torch.testing.assert_close(weighted, dual * w)
    total, metrics = policy_loss("ppo", lp, old, adv, m, LossSettings(clip_low=0.2, clip_high=0.3, clip_c=3.0))
    torch.testing.assert_close(total, dual.mean())
    assert float(metrics["clip_frac"]) == pytest.approx(4 / 6)


def test_gspo_sequence_ratio_and_gradient():
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    lp = torch.tensor([[0.3, -0.1, 9.0], [30.0, 30.0, 0.0]], requires_grad=True)
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # row 0's last token is masked: its 9.0 must not count
    adv = torch.tensor([[1.0], [-1.0]]).expand(2, 3)
    loss, clipped, ratio = token_policy_loss("gspo", lp, old, adv, m, LossSettings(clip_low=0.2, clip_high=0.2))
    s0 = math.exp((0.3 - 0.1) / 2)  # 1.105: within [0.8, 1.2]
    torch.testing.assert_close(ratio[0], torch.full((3,), s0))
    torch.testing.assert_close(ratio[1], torch.full((3,), math.exp(10.0)))  # mean 20 clamped at 10
    assert not clipped[0].any()
    # seq-mean-token-mean of -A s: d/d lp_t = -A s / |y| for each of the row's tokens (autograd vs by hand)
    aggregate(loss[:1], m[:1], "seq-mean-token-mean").backward()
    torch.testing.assert_close(lp.grad[0], torch.tensor([-s0 / 2, -s0 / 2, 0.0]))


def test_policy_loss_gradient_matches_finite_differences():
    g = torch.Generator().manual_seed(2)
    lp = (0.1 * torch.randn(3, 4, generator=g)).double().requires_grad_()
    old = 0.1 * torch.randn(3, 4, generator=g).double()
    adv = torch.randn(3, 4, generator=g).double()
    m = MASK[:3].double()
    seq_adv = adv[:, :1].expand(3, 4)  # gspo's stop-gradient form is the true gradient for sequence advantages
    for name, a in (("ppo", adv), ("gspo", seq_adv)):
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
            kw = dict(settings=LossSettings(clip_low=0.3, clip_high=0.3), agg=agg)
            f = functools.partial(policy_loss, name, old_logprobs=old, advantages=a, mask=m, **kw)
            assert torch.autograd.gradcheck(lambda x, f=f: f(x)[0], (lp,)), (name, agg)
    v = torch.randn(3, 4, generator=g).double().requires_grad_()
    old_v, ret = torch.randn(3, 4, generator=g).double(), torch.randn(3, 4, generator=g).double()
    assert torch.autograd.gradcheck(lambda x: value_loss(x, old_v, ret, m, clip=0.5)[0], (v,))
    for est in ("k1", "k2", "k3", "abs"):
        assert torch.autograd.gradcheck(lambda x, est=est: (kl_penalty(x, old, est) * m).sum(), (lp,)), est


def test_aggregation_modes_by_hand_and_global_normaliser():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the last row is fully masked
    assert float(aggregate(loss, m, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(loss, m, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(loss, m, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    assert float(aggregate(loss, m, "seq-mean-token-sum-norm")) == pytest.approx((6 + 4) / 2 / 3)
    assert float(aggregate(loss, m, "seq-mean-token-sum-norm", horizon=8)) == pytest.approx((6 + 4) / 2 / 8)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        norm = normaliser(m, mode)
        parts = sum(aggregate(loss[i:i + 1], m[i:i + 1], mode, norm=norm, horizon=3) for i in range(3))
        assert float(parts) == pytest.approx(float(aggregate(loss, m, mode, horizon=3))), mode
    with pytest.raises(ValueError):
        aggregate(loss, m, "mean")


def test_value_loss_by_hand():
    v = torch.tensor([[1.0, 0.0, 2.0]])
    old = torch.tensor([[0.0, 0.0, 1.9]])
    ret = torch.tensor([[2.0, 1.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0]])
    loss, frac = value_loss(v, old, ret, m, clip=0.5)
    # token 0: clipped v = 0.5: max((1-2)^2, (0.5-2)^2) = 2.25 (clipped is larger); token 1: 1; token 2: max(4, 3.61)
    assert float(loss) == pytest.approx(0.5 * (2.25 + 1.0 + 4.0) / 3)
    assert float(frac) == pytest.approx(1 / 3)


def test_kl_estimators_by_hand_and_clamps():
    lp = torch.tensor([math.log(0.5), math.log(0.2), 0.0])
    ref = torch.tensor([math.log(0.25), math.log(0.4), 40.0])
    x = [math.log(2.0), math.log(0.5), -40.0]
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor(x))
    torch.testing.assert_close(kl_penalty(lp, ref, "abs"), torch.tensor([abs(v) for v in x]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([0.5 * v * v for v in x]))
    # k3 = exp(-x) - 1 + x with -x clamped to 20 (inner) and the result to 10 (outer)
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([0.5 - 1 + x[0], 2.0 - 1 + x[1], 10.0]))
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


def test_dapo_filter_and_overlong_penalty():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 5.0])
    groups = torch.tensor([2, 2, 9, 9, 4, 4, 8])  # 2: all equal; 9: informative; 4: all equal; 8: a group of one
    assert informative(scores, groups).tolist() == [False, False, True, True, False, False, False]
    lengths = torch.tensor([4, 6, 7, 8])
    # cap 8, buffer 2: no penalty up to 6 tokens, then -(L - 6) / 2
    torch.testing.assert_close(overlong_penalty(lengths, 8, 2, 1.0), torch.tensor([0.0, 0.0, -0.5, -1.0]))


def test_adaptive_kl_controller_by_hand():
    c = KLController(0.1, True, target=0.05, horizon=100)
    c.update(0.1, 10)  # error clip(0.1 / 0.05 - 1) = 0.2: value * (1 + 0.2 * 10 / 100)
    assert c.value == pytest.approx(0.1 * 1.02)
    fixed = KLController(0.1, False, 0.05, 100)
    fixed.update(5.0, 10)
    assert fixed.value == 0.1
