from twinplane.algos.advantages import grpo_advantages
from twinplane.algos.losses import KL_ESTIMATORS, clipped_policy_loss, kl_penalty, token_sum, truncated_is_weights

__all__ = ["KL_ESTIMATORS", "clipped_policy_loss", "grpo_advantages", "kl_penalty", "token_sum", "truncated_is_weights"]
