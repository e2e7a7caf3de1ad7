"""Algorithms: pure advantage, loss and off-policy correction functions (`advantages`, `losses`, `off_policy`), each
registered under its config name (`registry`), and one module per algorithm family, each registering its `algo.name`
presets (`PRESETS`) and any function of its own. `Algorithm` is what the controller and trainer call."""

import importlib
import pkgutil

from twinplane.algos import dapo, grpo, gspo, ppo, reinforce_pp, rloo  # noqa: F401  (the presets, in this order)
from twinplane.algos.advantages import ESTIMATORS, AdvantageSettings, advantages, masked_whiten, register_adv_estimator
from twinplane.algos.base import Algorithm, as_algorithm
from twinplane.algos.losses import (
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    LossSettings,
    aggregate,
    kl_penalty,
    normaliser,
    policy_loss,
    register_kl_estimator,
    register_loss_agg,
    register_policy_loss,
    token_policy_loss,
    token_sum,
    value_loss,
)
from twinplane.algos.off_policy import (
    IS_MASKS,
    IS_WEIGHTS,
    CorrectionSettings,
    register_is_mask,
    register_is_weight,
    truncated_is_weights,
)
from twinplane.algos.presets import PRESETS, Preset
from twinplane.algos.registry import Registry

# Every module registers what it defines (presets, losses, estimators) when imported: importing them all lets a new
# algorithm module register itself with no line elsewhere.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["AGG_MODES", "ESTIMATORS", "IS_MASKS", "IS_WEIGHTS", "KL_ESTIMATORS", "POLICY_LOSSES", "PRESETS",
           "AdvantageSettings", "Algorithm", "CorrectionSettings", "LossSettings", "Preset", "Registry", "advantages",
           "aggregate", "as_algorithm", "kl_penalty", "masked_whiten", "normaliser", "policy_loss",
           "register_adv_estimator", "register_is_mask", "register_is_weight", "register_kl_estimator",
           "register_loss_agg", "register_policy_loss", "token_policy_loss", "token_sum", "truncated_is_weights",
           "value_loss"]
