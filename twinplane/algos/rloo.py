"""RLOO: each sample's baseline is the mean reward of the other samples of its group (leave-one-out)."""

from twinplane.algos.presets import Preset, register

register(
    Preset("rloo", "leave-one-out baseline s - mean(others), clipped surrogate, token-mean",
           "Ahmadian et al. 2024, Back to Basics: REINFORCE-style optimisation (arXiv:2402.14740)",
           dict(adv_estimator="rloo", norm_adv_by_std=True, policy_loss="ppo", loss_agg="token-mean", clip_low=0.2,
                clip_high=0.28, dynamic_sampling=False, overlong_buffer=0)),
)
