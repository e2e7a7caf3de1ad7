"""What an algorithm is to the rest of twinplane: a preset of `algo.*` defaults plus one `Algorithm` object that
says which roles it needs, computes advantages from rewards (and values) and composes the per-micro-batch loss.

The trainer keeps the mechanics (micro-batches, the global normaliser, backward, clipping, the optimizer step) and
calls `Algorithm.loss`; the controller calls `Algorithm.advantages`. An algorithm module (`grpo.py`, `ppo.py`, ...)
registers its presets; anything algorithm-specific beyond the shared pieces (DAPO's sampling filter, PPO's KL
controller) lives in its own module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from twinplane.algos.advantages import advantages as compute_advantages
from twinplane.algos.losses import aggregate, kl_penalty, normaliser, policy_loss, token_sum


@dataclass(frozen=True)
class Preset:
    """`algo.name`: its one-line summary, the paper, and the `algo.*` values it sets (overridable key by key)."""
    name: str
    summary: str
    paper: str
    values: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {}


def register(*presets: Preset) -> None:
    for p in presets:
        PRESETS[p.name] = p


class Algorithm:
    """The algorithm a resolved `AlgoSection` describes (duck-typed: this module never imports the config)."""

    def __init__(self, algo, horizon: int):
        """`horizon`: the constant of seq-mean-token-sum-norm (`algo.loss_agg_horizon`, else the generation cap)."""
        self.cfg, self.horizon = algo, horizon

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0 or self.cfg.kl_in_reward

    @property
    def needs_critic(self) -> bool:
        return self.cfg.adv_estimator == "gae"

    def advantages(self, token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                   values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.cfg
        return compute_advantages(a.adv_estimator, token_rewards, mask, group_ids=group_ids, values=values,
                                  gamma=a.gamma, lam=a.lam, norm_by_std=a.norm_adv_by_std)

    def normaliser(self, mask: torch.Tensor) -> float:
        """This mask's share of the loss denominator (summed over micro-batches and ranks by the trainer)."""
        return normaliser(mask, self.cfg.loss_agg)

    def loss(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             *, entropy: torch.Tensor, ref_logprobs: torch.Tensor | None, is_weights: torch.Tensor | None,
             norm: float, num_tokens: float,
             horizon: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's share of the step's loss, and its metrics' shares. All inputs [n, R].

        `norm` is the global batch's aggregation denominator and `num_tokens` its response-token count, so each
        term and each metric summed over micro-batches (and ranks) is the value of the whole batch; `horizon`
        replaces the constant of seq-mean-token-sum-norm for this call. The policy
        loss, the KL-to-reference term and the entropy bonus share the aggregation mode, as in verl.
        """
        a = self.cfg
        horizon = horizon or self.horizon or None
        agg = dict(agg=a.loss_agg, norm=norm, horizon=horizon)
        pg, stats = policy_loss(a.policy_loss, logprobs, old_logprobs, advantages, mask, clip_low=a.clip_low,
                                clip_high=a.clip_high, clip_c=a.clip_c or None, is_weights=is_weights, **agg)
        share = float(mask.sum()) / max(num_tokens, 1.0)  # policy_loss's metrics are means over this micro-batch
        out = {"pg_loss": pg.detach(), "clip_frac": stats["clip_frac"] * share, "ratio": stats["ratio"] * share,
               "entropy": token_sum(entropy.detach(), mask, num_tokens)}
        loss = pg
        if a.kl_coef > 0:
            kl = kl_penalty(logprobs, ref_logprobs, a.kl_estimator)
            loss = loss + a.kl_coef * aggregate(kl, mask, a.loss_agg, norm=norm, horizon=horizon)
            out["kl"] = token_sum(kl.detach(), mask, num_tokens)
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * aggregate(entropy, mask, a.loss_agg, norm=norm, horizon=horizon)
        return loss, out
