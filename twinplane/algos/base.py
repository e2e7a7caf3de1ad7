"""What an algorithm is to the rest of twinplane: one `Algorithm` object (for a resolved `algo.*` section, whose
defaults an `algo.name` preset set) that says which roles it needs and holds every algorithm-specific step between a
rollout and an update: which groups train, how scores become per-token rewards, the advantages, the loss.

The trainer keeps the mechanics (micro-batches, the global normaliser, backward, clipping, the optimizer step) and
calls `Algorithm.loss`; the controller calls `keep_groups`, `shape_scores`, `token_rewards` and `advantages`, and
imports no algorithm module. The methods call the pure functions of the algorithm modules (`dapo.py`, `ppo.py`, ...)
and the registered policy loss, estimator, aggregation and correction the section names, with the settings objects
built here once.

A run builds its `Algorithm` once (`cluster.build_algorithm`, through `as_algorithm`) and hands the same object to
the trainer, the controller and the producer; a Ray training worker, in a process of its own, rebuilds it from the
run's config through the same function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from twinplane.algos.advantages import AdvantageSettings
from twinplane.algos.advantages import advantages as compute_advantages
from twinplane.algos.dapo import informative, overlong_buffer, overlong_penalty
from twinplane.algos.losses import LossSettings, aggregate, kl_penalty, normaliser, policy_loss, token_sum
from twinplane.algos.off_policy import CorrectionSettings, correction, correction_metrics
from twinplane.algos.ppo import KLController, kl_in_reward, outcome_token_rewards


class Algorithm:
    """The algorithm a resolved `AlgoSection` describes (duck-typed: this module never imports the config)."""

    def __init__(self, algo, max_new_tokens: int = 0):
        """`max_new_tokens`: the generation cap (`rollout.max_new_tokens`), seq-mean-token-sum-norm's constant unless
        `algo.loss_agg_horizon` sets one (both 0: each batch's padded response width, see `loss_horizon`)."""
        self.cfg, self.horizon = algo, algo.loss_agg_horizon or max_new_tokens
        # the registered functions' settings, each one object
        self.loss_settings = LossSettings.from_algo(algo)
        self.adv_settings = AdvantageSettings.from_algo(algo)
        self.correction_settings = CorrectionSettings.from_algo(algo)
        # PPO-RLHF's KL-in-reward coefficient: the one piece of state an algorithm carries from step to step
        self.kl_ctrl = KLController(algo.kl_reward_coef, algo.kl_ctrl == "adaptive", algo.kl_target, algo.kl_horizon)

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0 or self.cfg.kl_in_reward

    @property
    def needs_critic(self) -> bool:
        return self.cfg.adv_estimator == "gae"

    @property
    def filters_groups(self) -> bool:
        """DAPO's dynamic sampling: only groups whose rewards differ train (the controller rolls out more)."""
        return bool(self.cfg.dynamic_sampling)

    def keep_groups(self, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """[N] bool: the samples whose group trains. All of them, or with dynamic sampling those of informative
        groups (`dapo.informative`)."""
        if not self.filters_groups:
            return torch.ones(len(scores), dtype=torch.bool)
        return informative(scores, group_ids)

    def shape_scores(self, scores: torch.Tensor, lengths: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """[N] the scores the policy learns from: the rewards plus DAPO's overlong penalty (`dapo.overlong_penalty`)
        when `algo.overlong_buffer` is set. It steers the policy only: accuracy still counts the verifier."""
        buffer = overlong_buffer(self.cfg.overlong_buffer, max_new_tokens)
        if not buffer:
            return scores
        return scores + overlong_penalty(lengths, max_new_tokens, buffer, self.cfg.overlong_penalty)

    def token_rewards(self, scores: torch.Tensor, mask: torch.Tensor, old_logprobs: torch.Tensor,
                      ref_logprobs: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        """([N, R] per-token rewards, metrics): each score on its sequence's last trained token
        (`ppo.outcome_token_rewards`); with `algo.kl_in_reward` minus the per-token KL to the reference
        (`ppo.kl_in_reward`), after which an adaptive coefficient moves towards `algo.kl_target`."""
        token_rewards = outcome_token_rewards(scores, mask)  # [N, R]
        if not self.cfg.kl_in_reward:
            return token_rewards, {}
        coef = self.kl_ctrl.value
        token_rewards, kl = kl_in_reward(token_rewards, old_logprobs, ref_logprobs, mask, coef)
        self.kl_ctrl.update(kl, len(scores))
        return token_rewards, {"actor/reward_kl": kl, "actor/reward_kl_coef": coef}

    def state_dict(self) -> dict:
        """What a checkpoint needs to continue bitwise: the KL-in-reward coefficient."""
        return {"kl_ctrl": self.kl_ctrl.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "kl_ctrl" in state:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])

    def advantages(self, token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                   values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return compute_advantages(self.cfg.adv_estimator, token_rewards, mask, self.adv_settings,
                                  group_ids=group_ids, values=values)

    def normaliser(self, mask: torch.Tensor) -> float:
        """This mask's share of the loss denominator (summed over micro-batches and ranks by the trainer)."""
        return normaliser(mask, self.cfg.loss_agg)

    def off_policy(self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cap: float,
                   num_tokens: float | None = None, ranks: int = 1) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                                             dict[str, torch.Tensor]]:
        """(importance weights [N, R] or None, keep [N, R] bool or None, metrics' shares) of the off-policy
        correction `algo.is_weight` / `algo.is_mask` (`off_policy.correction`, truncation at `cap`) for a batch
        with behaviour log-probs `rollout_logprobs` and proximal `old_logprobs`; the trainer leaves the tokens
        outside `keep` out of the loss and weights the rest (the decoupled objective). Metrics as
        `off_policy.correction_metrics` over the global batch's `num_tokens` and `ranks` (none when `num_tokens` is
        None: the weights of one micro-batch, whose metrics the trainer takes over the whole batch)."""
        a = self.cfg
        w, keep = correction(old_logprobs, rollout_logprobs, mask, weight=a.is_weight, keep=a.is_mask,
                             settings=replace(self.correction_settings, cap=cap))
        if num_tokens is None:
            return w, keep, {}
        return w, keep, correction_metrics(old_logprobs, rollout_logprobs, mask, w, keep, cap, num_tokens, ranks)

    def loss_horizon(self, width: Callable[[], int] | None = None) -> int | None:
        """seq-mean-token-sum-norm's constant: `algo.loss_agg_horizon`, else the generation cap, else `width()` (the
        global batch's padded response width, asked for only then: a collective); None leaves it to `aggregate`
        (the micro-batch's own width)."""
        return self.horizon or (width() if width is not None else 0) or None

    def loss(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             *, entropy: torch.Tensor, ref_logprobs: torch.Tensor | None, is_weights: torch.Tensor | None,
             norm: float, num_tokens: float,
             horizon: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's share of the step's loss, and its metrics' shares. All inputs [n, R].

        `norm` is the global batch's aggregation denominator and `num_tokens` its response-token count, so each
        term and each metric summed over micro-batches (and ranks) is the value of the whole batch; `horizon` is
        the constant of seq-mean-token-sum-norm for this call (the trainer's `loss_horizon`; None: `loss_horizon()`).
        The policy loss, the KL-to-reference term and the entropy bonus share the aggregation mode, as in verl.
        """
        a = self.cfg
        horizon = horizon or self.loss_horizon()
        agg = dict(agg=a.loss_agg, norm=norm, horizon=horizon)
        pg, stats = policy_loss(a.policy_loss, logprobs, old_logprobs, advantages, mask, self.loss_settings,
                                is_weights=is_weights, **agg)
        # policy_loss's metrics are means over this micro-batch (its share of the tokens: on the device, no host read)
        share = (mask.sum(dtype=torch.float64) / max(num_tokens, 1.0)).to(stats["clip_frac"].dtype)
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


def as_algorithm(algo, max_new_tokens: int = 0) -> Algorithm:
    """`algo` itself if it is an `Algorithm`, else the one its `algo` config section describes with generation cap
    `max_new_tokens`: the one place an `Algorithm` is built (a run's, by `cluster.build_algorithm`; a trainer's
    given only its section)."""
    return algo if isinstance(algo, Algorithm) else Algorithm(algo, max_new_tokens)
