"""Advantage estimators: pure functions from per-token rewards (and values) to per-token advantages and returns.

Each estimator is one function registered under its `algo.adv_estimator` name (`@register_adv_estimator("grpo")`)
that takes its settings as one `AdvantageSettings`; `advantages` looks it up. Conventions follow verl 0.9's
`core_algos` (the reference implementations the field compares against); every deviation is listed in the docstring
of the function that makes it. Shapes: N sequences, R response columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from twinplane.algos.registry import Registry


@dataclass(frozen=True)
class AdvantageSettings:
    """An estimator's own settings, built once from the `algo` section (`from_algo`)."""
    gamma: float = 1.0  # discount of token rewards (reinforce_pp, gae)
    lam: float = 1.0  # GAE lambda
    norm_by_std: bool = True  # grpo: divide by the group std (false: Dr.GRPO)
    eps: float = 1e-6  # grpo: added to the group std

    @classmethod
    def from_algo(cls, algo) -> AdvantageSettings:
        """From a resolved `algo` config section (duck-typed: this package never imports the config)."""
        return cls(gamma=algo.gamma, lam=algo.lam, norm_by_std=algo.norm_adv_by_std)


# (token_rewards [N, R], mask [N, R] in their dtype, group_ids [N] or None, values [N, R] or None, settings)
#   -> (advantages [N, R], returns [N, R])
Estimator = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, AdvantageSettings],
                     tuple[torch.Tensor, torch.Tensor]]
ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")
DEFAULTS = AdvantageSettings()
register_adv_estimator = ESTIMATORS.register


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


def advantages(name: str, token_rewards: torch.Tensor, mask: torch.Tensor, settings: AdvantageSettings = DEFAULTS,
               *, group_ids: torch.Tensor | None = None,
               values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N, R], returns [N, R]) of the registered estimator `name`; both are 0 where `mask` is 0.

    token_rewards [N, R]: the outcome score on a sequence's last token, plus any per-token terms (a KL penalty in
    the reward). mask [N, R]: 1 = a token the policy produced. group_ids [N]: one label per prompt (any order, any
    dtype torch.unique accepts), for the group estimators. values [N, R]: the critic's V(s_t) for `gae`. The
    outcome score is `token_rewards.sum(-1)`. Returns equal the advantages for the critic-free estimators.
    """
    estimator = ESTIMATORS.lookup(name)
    return estimator(token_rewards, mask.to(token_rewards.dtype), group_ids, values, settings)


def outcome_groups(name: str, token_rewards: torch.Tensor,
                   group_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores, group mean, unbiased group std, group size) [N] each, of the outcome scores `token_rewards.sum(-1)`,
    for the group estimator `name`."""
    if group_ids is None:
        raise ValueError(f"the {name} estimator needs group_ids (one label per prompt)")
    s = token_rewards.sum(-1)  # [N]
    return s, *group_stats(s, group_ids.to(s.device))


def on_tokens(a: torch.Tensor, count: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, R]: each sequence's advantage a [N] on its masked tokens; 0 for a group of one sample.
    Deviation from verl, which passes a lone sample's raw score through: with no baseline there is no signal to
    compare against."""
    return a.masked_fill(count < 2, 0.0)[:, None] * mask


@register_adv_estimator("grpo")
def grpo(token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor | None,
         values: torch.Tensor | None, s: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(s - mean_g) / (std_g + eps), unbiased std (Shao et al. 2024); s - mean_g without std (`norm_by_std` false:
    Dr.GRPO, Liu et al. 2025)."""
    score, mean, std, count = outcome_groups("grpo", token_rewards, group_ids)
    a = on_tokens((score - mean) / (std + s.eps) if s.norm_by_std else score - mean, count, mask)
    return a, a


@register_adv_estimator("rloo")
def rloo(token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor | None,
         values: torch.Tensor | None, s: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """s - the mean of the other samples of the group (Ahmadian et al. 2024)."""
    score, mean, _, count = outcome_groups("rloo", token_rewards, group_ids)
    a = on_tokens((score - mean) * count / (count - 1).clamp(min=1), count, mask)  # = s - (sum - s) / (n - 1)
    return a, a


@register_adv_estimator("reinforce_pp")
def reinforce_pp(token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor | None,
                 values: torch.Tensor | None, s: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """G_t = r_t + gamma G_{t+1}, whitened over the batch's masked tokens, no baseline (Hu 2025); returns G.
    Deviation: G carries across mask-0 tokens inside a response (verl resets it after every mask-0 token, which
    cuts a multi-turn response at its first tool output)."""
    ret = discounted_returns(token_rewards, mask, s.gamma)
    return masked_whiten(ret, mask), ret


@register_adv_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline(token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor | None,
                          values: torch.Tensor | None, s: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """s - mean_g on every token, then whitened over the batch's masked tokens (Hu 2025's baseline variant)."""
    score, mean, _, count = outcome_groups("reinforce_pp_baseline", token_rewards, group_ids)
    a = masked_whiten(on_tokens(score - mean, count, mask), mask)
    return a, a


@register_adv_estimator("gae", "critic")
def gae_estimator(token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor | None,
                  values: torch.Tensor | None, s: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE from `values` (`gae`), whitened; returns = A + V before whitening (PPO's critic targets)."""
    if values is None:
        raise ValueError("the gae estimator needs values (a critic)")
    adv, ret = gae(token_rewards, values.to(token_rewards.dtype), mask, s.gamma, s.lam)
    return masked_whiten(adv, mask), ret
