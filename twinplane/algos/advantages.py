"""Advantage estimators: pure functions over rewards. PPO/GAE, RLOO, REINFORCE++ sit here beside GRPO."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean(group)) / (std(group) + eps).

    rewards: [N] with N = G * group_size, the samples of one prompt contiguous. Returns [N], one value per
    sequence that the caller broadcasts over its response tokens.
    Deviations: std is the unbiased (n-1) estimate, as in TRL and verl; `norm_by_std=False` gives the
    Dr.GRPO variant (Liu et al. 2025), which drops the std division to avoid weighting easy/hard groups.
    A group of one sample has advantage 0 (no baseline to compare against).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)  # [G, n]
    adv = r - r.mean(dim=1, keepdim=True)
    if norm_by_std and group_size > 1:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)
