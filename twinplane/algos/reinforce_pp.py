"""REINFORCE++: discounted token returns whitened over the whole batch (no per-prompt baseline), or with the
group-mean baseline subtracted first (the `_baseline` variant), under the PPO clipped surrogate."""

from twinplane.algos.presets import Preset, register

register(
    Preset("reinforce_pp", "discounted returns whitened over the global batch, no baseline, clipped surrogate",
           "Hu 2025, REINFORCE++ (arXiv:2501.03262)",
           dict(adv_estimator="reinforce_pp", norm_adv_by_std=True, policy_loss="ppo", loss_agg="token-mean",
                clip_low=0.2, clip_high=0.28, dynamic_sampling=False, overlong_buffer=0)),
    Preset("reinforce_pp_baseline", "s - group mean, then whitened over the global batch, clipped surrogate",
           "Hu 2025, REINFORCE++ (arXiv:2501.03262), baseline variant",
           dict(adv_estimator="reinforce_pp_baseline", norm_adv_by_std=True, policy_loss="ppo",
                loss_agg="token-mean", clip_low=0.2, clip_high=0.28, dynamic_sampling=False, overlong_buffer=0)),
)
