"""GSPO: GRPO advantages under a sequence-level importance ratio with small clip ranges."""

from twinplane.algos.presets import Preset, register

register(
    Preset("gspo", "sequence-level ratio exp(mean_t log-ratio), clip 3e-4/4e-4, seq-mean-token-mean",
           "Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071)",
           dict(adv_estimator="grpo", norm_adv_by_std=True, policy_loss="gspo", loss_agg="seq-mean-token-mean",
                clip_low=3e-4, clip_high=4e-4, dynamic_sampling=False, overlong_buffer=0)),
)
