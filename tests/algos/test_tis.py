"""Truncated importance sampling: the weights by hand, and their effect on a train step."""

import math

import torch
from conftest import make_batch, tiny_model

from twinplane.algos import truncated_is_weights
from twinplane.config import AlgoSection, TrainSection
from twinplane.train import Trainer
from twinplane.train.logprobs import response_logprobs

ALGO = AlgoSection(clip_low=0.2, clip_high=0.2)


def test_truncated_is_weights_by_hand():
    old = torch.tensor([[0.0, math.log(1.5), math.log(4.0)], [math.log(0.5), -1.0, 30.0]], requires_grad=True)
    rollout = torch.tensor([[0.0, 0.0, 0.0], [0.0, -1.0, -100.0]])
    w = truncated_is_weights(old, rollout, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.5, 2.0], [0.5, 1.0, 2.0]]))  # exp overflow: still the cap
    assert not w.requires_grad and w.grad_fn is None


def step(batch, tis_cap, micro=2):
    model = tiny_model()
    trainer = Trainer(model, TrainSection(micro_batch_size=micro, lr=1e-2, grad_clip=0.0), ALGO, 1.0, 10,
                      tis_cap=tis_cap)
    return model, trainer.train_step(batch)


def test_tis_with_matching_logprobs_changes_nothing():
    batch = make_batch(tiny_model())
    batch.old_logprobs = batch.rollout_logprobs.clone()
    plain, m_plain = step(batch, None)
    tis, m_tis = step(batch, 2.0)
    for p, q in zip(plain.parameters(), tis.parameters(), strict=True):
        assert torch.equal(p, q)
    assert {k: v for k, v in m_tis.items() if "tis" not in k} == m_plain
    assert abs(m_tis["actor/tis_weight_mean"] - 1.0) < 1e-6 and m_tis["actor/tis_clip_frac"] == 0.0

    batch.old_logprobs = None  # nothing to correct: no TIS, no TIS metrics
    assert "actor/tis_weight_mean" not in step(batch, 2.0)[1]


def test_tis_pg_loss_by_hand():
    """pi_old = the model itself (ratio 1, no PPO clip), the engine off by a factor 1.5 on even rows and 4 on odd
    rows: weights 1.5 and the cap 2, so pg_loss = token mean of -A * w."""
    batch = make_batch(tiny_model(), n=6)
    m = batch.response_mask
    with torch.no_grad():
        batch.old_logprobs = response_logprobs(tiny_model(), batch, 1.0)[0] * m
    odd = (torch.arange(6) % 2 == 1)[:, None]  # [N, 1]
    batch.rollout_logprobs = batch.old_logprobs - torch.where(odd, math.log(4.0), math.log(1.5))
    w = torch.where(odd, 2.0, 1.5)
    _, metrics = step(batch, tis_cap=2.0)
    n_tokens = m.sum()
    assert abs(metrics["actor/pg_loss"] - float((-batch.advantages * w * m).sum() / n_tokens)) < 1e-6
    assert abs(metrics["actor/tis_weight_mean"] - float((w * m).sum() / n_tokens)) < 1e-6
    assert abs(metrics["actor/tis_clip_frac"] - float((odd * m).sum() / n_tokens)) < 1e-6
    assert abs(metrics["actor/clip_frac"]) < 1e-12  # the PPO ratio is 1: only TIS acts
