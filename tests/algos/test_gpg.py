"""GPG's loss by hand: -A log pi, no ratio and no clip; its gradient, and its place in the config and a train step."""

import math

import pytest
import torch

from twinplane.algos import Algorithm, LossSettings, policy_loss, token_policy_loss
from twinplane.config import ConfigError, load_config

LP = torch.tensor([[-0.5, -1.0, -2.0], [-0.3, -0.7, -9.0]])
ADV = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # row 1's last token is padding


def test_gpg_by_hand():
    old = LP + math.log(2.0)  # pi / pi_old = 1/2 everywhere: no clip would let a ppo token train at that ratio
    loss, clipped, ratio = token_policy_loss("gpg", LP, old, ADV, MASK, LossSettings())
    torch.testing.assert_close(loss, torch.tensor([[0.5, 1.0, 2.0], [-0.6, -1.4, -18.0]]))
    assert not clipped.any()
    torch.testing.assert_close(ratio, torch.full((2, 3), 0.5))
    # token-mean over the 5 masked tokens: (0.5 + 1 + 2 - 0.6 - 1.4) / 5
    total, metrics = policy_loss("gpg", LP, old, ADV, MASK, LossSettings())
    assert float(total) == pytest.approx(0.3)
    assert float(metrics["clip_frac"]) == 0.0 and float(metrics["ratio"]) == pytest.approx(0.5)
    # the off-policy correction's weights multiply the token losses: (1 + 1 + 2 - 0.3 - 1.4) / 5
    w = torch.tensor([[2.0, 1.0, 1.0], [0.5, 1.0, 1.0]])
    weighted, _ = policy_loss("gpg", LP, old, ADV, MASK, LossSettings(), is_weights=w)
    assert float(weighted) == pytest.approx(0.46)


def test_gpg_ignores_pi_old_and_the_clip_settings():
    base, _ = policy_loss("gpg", LP, LP, ADV, MASK, LossSettings())
    other, _ = policy_loss("gpg", LP, LP - 3.0, ADV, MASK, LossSettings(clip_low=1e-4, clip_high=1e-4))
    assert torch.equal(base, other)


def test_gpg_gradient():
    lp = LP.clone().requires_grad_()
    total, _ = policy_loss("gpg", lp, LP - 1.0, ADV, MASK, LossSettings(), agg="token-mean")
    total.backward()
    # d/d lp of -sum(A lp M) / 5 = -A M / 5
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.2, -0.2, -0.2], [0.4, 0.4, 0.0]]))
    g = torch.Generator().manual_seed(0)
    lp = (0.1 * torch.randn(3, 4, generator=g)).double().requires_grad_()
    adv, m = torch.randn(3, 4, generator=g).double(), (torch.rand(3, 4, generator=g) > 0.3).double()
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"):
        assert torch.autograd.gradcheck(
            lambda x, agg=agg: policy_loss("gpg", x, x.detach(), adv, m, LossSettings(), agg=agg)[0], (lp,)), agg


def test_gpg_is_a_policy_loss_the_config_takes():
    cfg = load_config(None, ["algo.policy_loss=gpg"])
    kw = dict(entropy=torch.zeros(2, 3), ref_logprobs=None, is_weights=None, norm=5.0, num_tokens=5.0)
    loss, stats = Algorithm(cfg.algo, 3).loss(LP, LP, ADV, MASK, **kw)
    assert float(loss) == pytest.approx(0.3) and float(stats["clip_frac"]) == 0.0
    with pytest.raises(ConfigError, match=r", got 'gpgo' \(did you mean gpg\?\)$"):
        load_config(None, ["algo.policy_loss=gpgo"])
