"""The algorithm seam: each `Algorithm` hook the controller calls does what its pure function says, by hand."""

import pytest
import torch

from twinplane.algos import Algorithm
from twinplane.config import AlgoSection


def algorithm(**kw) -> Algorithm:
    return Algorithm(AlgoSection(**kw), 8)


def test_keep_groups_filters_only_under_dynamic_sampling():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 5.0])
    groups = torch.tensor([2, 2, 9, 9, 4, 4, 8])  # 2: all equal; 9: informative; 4: all equal; 8: a group of one
    dapo = algorithm(name="dapo")
    assert dapo.filters_groups
    assert dapo.keep_groups(scores, groups).tolist() == [False, False, True, True, False, False, False]
    grpo = algorithm(name="grpo")
    assert not grpo.filters_groups and grpo.keep_groups(scores, groups).tolist() == [True] * 7


def test_shape_scores_adds_the_overlong_penalty_only_when_set():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    lengths = torch.tensor([4, 6, 7, 8])
    # cap 8, buffer 2, factor 0.5: no penalty up to 6 tokens, then -(L - 6) / 2 * 0.5
    shaped = algorithm(name="dapo", overlong_buffer=2, overlong_penalty=0.5).shape_scores(scores, lengths, 8)
    torch.testing.assert_close(shaped, torch.tensor([1.0, 0.0, 0.75, -0.5]))
    # the dapo preset's buffer (-1) is a fifth of the cap: 1 token at cap 8, so only L = 8 pays the full factor
    shaped = algorithm(name="dapo").shape_scores(scores, lengths, 8)
    torch.testing.assert_close(shaped, torch.tensor([1.0, 0.0, 1.0, -1.0]))
    assert torch.equal(algorithm(name="grpo").shape_scores(scores, lengths, 8), scores)


MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the last row is empty
SCORES = torch.tensor([2.0, -1.0, 3.0])
OLD = torch.tensor([[0.5, 0.1, 9.0], [0.2, 9.0, 9.0], [9.0, 9.0, 9.0]])
REF = torch.tensor([[0.3, 0.3, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_token_rewards_put_each_score_on_its_last_trained_token():
    rewards, metrics = algorithm(name="grpo").token_rewards(SCORES, MASK, OLD, None)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 2.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert metrics == {}


def test_token_rewards_subtract_the_kl_and_the_adaptive_coefficient_moves():
    algo = algorithm(name="ppo", kl_in_reward=True, kl_reward_coef=0.1, kl_ctrl="adaptive", kl_target=0.05,
                     kl_horizon=100)
    rewards, metrics = algo.token_rewards(SCORES, MASK, OLD, REF)
    # k1 = old - ref on the masked tokens: [[0.2, -0.2, 0], [0.2, 0, 0], [0, 0, 0]]; r - 0.1 k1
    torch.testing.assert_close(rewards, torch.tensor([[-0.02, 2.02, 0.0], [-1.02, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    # per-sequence mean KL: 0, 0.2, 0 (empty row); the batch mean 0.2 / 3; the coefficient reported is the one used
    assert metrics["actor/reward_kl"] == pytest.approx(0.2 / 3, rel=1e-5)
    assert metrics["actor/reward_kl_coef"] == 0.1
    # error clip(0.0667 / 0.05 - 1, +-0.2) = 0.2 over 3 sequences: 0.1 * (1 + 0.2 * 3 / 100)
    assert algo.kl_ctrl.value == pytest.approx(0.1 * 1.006)
    assert algo.state_dict() == {"kl_ctrl": {"value": algo.kl_ctrl.value}}  # what checkpoints hold
    fresh = algorithm(name="ppo", kl_in_reward=True, kl_reward_coef=0.1, kl_ctrl="adaptive")
    fresh.load_state_dict(algo.state_dict())
    assert fresh.kl_ctrl.value == algo.kl_ctrl.value
