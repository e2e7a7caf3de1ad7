"""DAPO (Yu et al. 2025): GRPO advantages with clip-higher, token-mean aggregation, dynamic sampling (only groups
whose rewards differ train) and overlong reward shaping, applied through `Algorithm.keep_groups` and `shape_scores`."""

from __future__ import annotations

import torch

from twinplane.algos.advantages import group_stats
from twinplane.algos.presets import Preset, register

register(
    Preset("dapo", "GRPO + clip-higher, token-mean, dynamic sampling of informative groups, overlong shaping",
           "Yu et al. 2025, DAPO (arXiv:2503.14476)",
           dict(adv_estimator="grpo", norm_adv_by_std=True, policy_loss="ppo", loss_agg="token-mean", clip_low=0.2,
                clip_high=0.28, dynamic_sampling=True, overlong_buffer=-1)),
)


def informative(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[N] bool: the sample's group has rewards that are not all equal (it carries a learning signal).
    Deviation: verl also keeps groups of one sample; here a group of one is all-equal (its advantage is 0)."""
    _, std, count = group_stats(scores.double(), group_ids)
    return (std > 0) & (count > 1)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """[N] reward shaping (DAPO eq. 13): 0 up to max_len - buffer tokens, then falling linearly to -factor at the
    cap: min(-(L - (max_len - buffer)) / buffer * factor, 0), as in verl's DAPO reward manager."""
    exceed = lengths.float() - (max_len - buffer)
    return (-exceed / buffer * factor).clamp(max=0.0)


def overlong_buffer(value: int, max_new_tokens: int) -> int:
    """`algo.overlong_buffer` resolved: -1 (the dapo preset) is a fifth of the generation cap, DAPO's 4k of 20k."""
    return max(1, max_new_tokens // 5) if value < 0 else value
