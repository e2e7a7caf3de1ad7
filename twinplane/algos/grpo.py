"""GRPO and Dr.GRPO: group-relative outcome advantages, the clipped surrogate, no critic."""

from twinplane.algos.presets import Preset, register

register(
    Preset("grpo", "group-normalised outcome advantages (s - mean) / std, clipped surrogate, token-mean",
           "Shao et al. 2024, DeepSeekMath (arXiv:2402.03300)",
           dict(adv_estimator="grpo", norm_adv_by_std=True, policy_loss="ppo", loss_agg="token-mean", clip_low=0.2,
                clip_high=0.28, dynamic_sampling=False, overlong_buffer=0)),
    Preset("dr_grpo", "GRPO without the std division and with a constant length normaliser (unbiased lengths)",
           "Liu et al. 2025, Understanding R1-Zero-Like Training (arXiv:2503.20783)",
           dict(adv_estimator="grpo", norm_adv_by_std=False, policy_loss="ppo", loss_agg="seq-mean-token-sum-norm",
                clip_low=0.2, clip_high=0.28, dynamic_sampling=False, overlong_buffer=0)),
)
