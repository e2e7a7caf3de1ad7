"""Algorithms: pure advantage, loss and off-policy correction functions (`advantages`, `losses`, `off_policy`) and
one module per algorithm family, each registering its `algo.name` presets (`PRESETS`). `Algorithm` is what the
controller and trainer call."""

from twinplane.algos import dapo, grpo, gspo, ppo, reinforce_pp, rloo  # noqa: F401  (register the presets)
from twinplane.algos.advantages import ESTIMATORS, advantages, masked_whiten
from twinplane.algos.base import Algorithm
from twinplane.algos.losses import (
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate,
    kl_penalty,
    normaliser,
    policy_loss,
    token_policy_loss,
    token_sum,
    value_loss,
)
from twinplane.algos.off_policy import IS_MASKS, IS_WEIGHTS, truncated_is_weights
from twinplane.algos.presets import PRESETS, Preset

__all__ = ["AGG_MODES", "ESTIMATORS", "IS_MASKS", "IS_WEIGHTS", "KL_ESTIMATORS", "POLICY_LOSSES", "PRESETS",
           "Algorithm", "Preset", "advantages", "aggregate", "kl_penalty", "masked_whiten", "normaliser", "policy_loss",
           "token_policy_loss", "token_sum", "truncated_is_weights", "value_loss"]
