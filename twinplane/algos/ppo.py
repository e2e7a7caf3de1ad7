"""PPO with a critic (Schulman et al. 2017; the RLHF form of Ouyang et al. 2022): GAE advantages from a learned
value model, the clipped surrogate, and optionally a KL penalty folded into the per-token reward with a fixed or
adaptive coefficient (Ziegler et al. 2019). The value model itself is `twinplane.train.critic`."""

from __future__ import annotations

import math

import torch

from twinplane.algos.losses import kl_penalty
from twinplane.algos.presets import Preset, register

register(
    Preset("ppo", "GAE advantages from a learned critic (value head on the policy's decoder), clipped surrogate",
           "Schulman et al. 2017, PPO (arXiv:1707.06347); Ouyang et al. 2022, InstructGPT (arXiv:2203.02155)",
           dict(adv_estimator="gae", norm_adv_by_std=True, policy_loss="ppo", loss_agg="token-mean", clip_low=0.2,
                clip_high=0.2, dynamic_sampling=False, overlong_buffer=0)),
)


def outcome_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, R]: each sequence's score on its last trained token (0 elsewhere, and for an empty row)."""
    cols = torch.arange(mask.shape[1], device=mask.device)
    last = ((cols + 1) * (mask > 0)).amax(1) - 1  # [N], -1 for an empty row
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = (last >= 0).nonzero().squeeze(1)
    out[rows, last[rows]] = scores.float().to(mask.device)[rows]
    return out


def kl_in_reward(token_rewards: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                 mask: torch.Tensor, coef: float) -> tuple[torch.Tensor, float]:
    """(r_t - coef * kl_t, the batch's mean per-sequence KL): PPO-RLHF's per-token penalty with the k1 estimator
    log pi_old - log pi_ref, as verl's `apply_kl_penalty` with its default estimator."""
    kl = kl_penalty(old_logprobs, ref_logprobs, "k1") * mask  # [N, R]
    per_seq = kl.sum(-1) / mask.sum(-1).clamp(min=1)
    return token_rewards - coef * kl, float(per_seq.mean())


class KLController:
    """The KL-in-reward coefficient: fixed, or adaptive (Ziegler et al. 2019): value *= 1 + clip(kl / target - 1,
    -0.2, 0.2) * n / horizon after each step with mean KL `kl` over `n` sequences."""

    def __init__(self, value: float, adaptive: bool, target: float, horizon: float):
        self.value, self.adaptive, self.target, self.horizon = value, adaptive, target, horizon

    def update(self, kl: float, n: int) -> None:
        if self.adaptive and math.isfinite(kl):
            self.value *= 1.0 + min(max(kl / self.target - 1.0, -0.2), 0.2) * n / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
