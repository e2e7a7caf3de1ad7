"""Advantage estimators: pure functions from per-token rewards (and values) to per-token advantages and returns.

Conventions follow verl 0.9's `core_algos` (the reference implementations the field compares against); every
deviation is listed in the docstring of the function that makes it. Shapes: N sequences, R response columns.
"""

from __future__ import annotations

import torch

ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")


def group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, unbiased group std, group size) [N] each, groups by label (not by position)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [N] -> 0..G-1
    G = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(G, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, torch.ones_like(scores))
    total = torch.zeros(G, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, scores)
    mean = total / count
    sq = torch.zeros(G, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, (scores - mean[inverse]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return mean[inverse], std[inverse], count[inverse]


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) * rsqrt(var + 1e-8) over the masked tokens of the whole batch, unbiased variance (verl's
    `masked_whiten`); masked-out tokens come back as 0."""
    n = mask.sum()
    mean = (x * mask).sum() / n.clamp(min=1)
    var = (((x - mean) ** 2) * mask).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over the response tokens [N, R]; a mask-0 token (padding, tool output) adds no
    reward, does not discount, carries G through to the token before it, and outputs 0."""
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])  # [N]
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        running = torch.where(m > 0, token_rewards[:, t] + gamma * running, running)
        out[:, t] = running * m
    return out


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens, unwhitened: (A, A + V) [N, R].

    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}; V after the last token is 0. A mask-0
    token carries the next value and advantage through, as in verl (so tool output between two model turns is
    skipped, not treated as a step). Returns are taken before any whitening."""
    adv = torch.zeros_like(token_rewards)
    next_v = torch.zeros_like(token_rewards[:, 0])  # [N]
    last = torch.zeros_like(next_v)
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * last
        next_v = torch.where(m > 0, values[:, t], next_v)
        last = torch.where(m > 0, a, last)
        adv[:, t] = last
    return adv * mask, (adv + values) * mask


def advantages(name: str, token_rewards: torch.Tensor, mask: torch.Tensor, *, group_ids: torch.Tensor | None = None,
               values: torch.Tensor | None = None, gamma: float = 1.0, lam: float = 1.0, norm_by_std: bool = True,
               eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N, R], returns [N, R]) for estimator `name`; both are 0 where `mask` is 0.

    token_rewards [N, R]: the outcome score on a sequence's last token, plus any per-token terms (a KL penalty in
    the reward). mask [N, R]: 1 = a token the policy produced. group_ids [N]: one label per prompt (any order, any
    dtype torch.unique accepts). values [N, R]: the critic's V(s_t) for `gae`. The outcome score is
    `token_rewards.sum(-1)`.

      grpo                   (s - mean_g) / (std_g + eps), unbiased std (Shao et al. 2024); s - mean_g without std
                             (Dr.GRPO, Liu et al. 2025)
      rloo                   s - mean of the other samples of the group (Ahmadian et al. 2024)
      reinforce_pp           G_t = r_t + gamma G_{t+1}, whitened over the batch's masked tokens, no baseline (Hu 2025)
      reinforce_pp_baseline  s - mean_g on every token, then the same batch whitening
      gae                    GAE from `values`, whitened; returns = A + V before whitening (PPO critic targets)

    Deviations from verl: a group of one sample gets advantage 0 under grpo/rloo/reinforce_pp_baseline (verl
    passes its raw score through: with no baseline there is no signal to compare against); reinforce_pp carries G
    across mask-0 tokens inside a response (verl resets it after every mask-0 token, which cuts a multi-turn
    response at its first tool output). Returns equal the advantages for the critic-free estimators.
    """
    mask = mask.to(token_rewards.dtype)
    if name in ("reinforce_pp", "gae"):
        if name == "reinforce_pp":
            ret = discounted_returns(token_rewards, mask, gamma)
            return masked_whiten(ret, mask), ret
        if values is None:
            raise ValueError("the gae estimator needs values (a critic)")
        adv, ret = gae(token_rewards, values.to(token_rewards.dtype), mask, gamma, lam)
        return masked_whiten(adv, mask), ret
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r} (choose from {', '.join(ESTIMATORS)})")
    if group_ids is None:
        raise ValueError(f"the {name} estimator needs group_ids (one label per prompt)")
    s = token_rewards.sum(-1)  # [N]
    mean, std, count = group_stats(s, group_ids.to(s.device))
    alone = count < 2
    if name == "grpo":
        a = (s - mean) / (std + eps) if norm_by_std else s - mean
    elif name == "rloo":
        a = (s - mean) * count / (count - 1).clamp(min=1)  # = s - (sum - s) / (n - 1)
    else:
        a = s - mean
    a = a.masked_fill(alone, 0.0)[:, None] * mask  # [N, R]
    if name == "reinforce_pp_baseline":
        a = masked_whiten(a, mask)
    return a, a
