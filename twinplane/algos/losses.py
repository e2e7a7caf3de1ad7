"""Losses as pure per-token functions plus their aggregation; the trainer normalises over the global batch.

Each policy loss, aggregation mode and KL estimator is one function registered under the name the config uses for
it (`@register_policy_loss("cispo")`, `@register_loss_agg("token-mean", per=count_tokens)`,
`@register_kl_estimator("k3")`); `policy_loss`, `aggregate` and `kl_penalty` look them up. Every policy loss takes
its settings as one `LossSettings`. Conventions follow verl 0.9's `core_algos`; deviations are in each function's
docstring. Shapes: N sequences, R columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from twinplane.algos.registry import Registry


@dataclass(frozen=True)
class LossSettings:
    """A policy loss's own settings, built once from the `algo` section (`from_algo`); each loss reads the fields
    it uses."""
    clip_low: float = 0.2  # ratio clip below 1: 1 - clip_low
    clip_high: float = 0.2  # ratio clip above 1: 1 + clip_high (larger than clip_low: DAPO's clip-higher)
    clip_c: float | None = None  # dual clip of ppo and gspo (None: off)
    sapo_tau: tuple[float, float] = (1.0, 1.05)  # sapo's gate temperatures (A > 0, A < 0)

    @classmethod
    def from_algo(cls, algo) -> LossSettings:
        """From a resolved `algo` config section (duck-typed: this package never imports the config)."""
        return cls(algo.clip_low, algo.clip_high, algo.clip_c or None, (algo.sapo_tau_pos, algo.sapo_tau_neg))


# (logprobs, old_logprobs, advantages, mask, settings, is_weights or None), all [N, R]
#   -> (loss [N, R], clipped [N, R] bool, ratio [N, R])
PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossSettings, torch.Tensor | None],
                      tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register


def token_policy_loss(name: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, settings: LossSettings,
                      is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token (loss [N, R], clipped [N, R] bool, ratio [N, R]) of the registered policy loss `name`.

    `is_weights` [N, R] (importance weights of the off-policy correction, detached) multiply the token losses.
    `clipped` marks tokens where a clip bound was the active branch."""
    return POLICY_LOSSES.lookup(name)(logprobs, old_logprobs, advantages, mask, settings, is_weights)


def policy_loss(name: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, settings: LossSettings, *, agg: str = "token-mean",
                is_weights: torch.Tensor | None = None, horizon: float | None = None,
                norm: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(aggregated loss, metrics) for policy loss `name`; see `token_policy_loss` for the per-token terms and
    `aggregate` for `agg`, `horizon` and `norm` (the global batch's denominator). Metrics: `clip_frac` and the
    mean `ratio`, token means over this mask."""
    loss, clipped, ratio = token_policy_loss(name, logprobs, old_logprobs, advantages, mask, settings, is_weights)
    m = mask.to(loss.dtype)
    n = m.sum().clamp(min=1)
    return aggregate(loss, m, agg, norm=norm, horizon=horizon), {"clip_frac": (clipped.float() * m).sum() / n,
                                                                "ratio": (ratio.detach() * m).sum() / n}


def weighted(loss: torch.Tensor, is_weights: torch.Tensor | None) -> torch.Tensor:
    """[N, R] each token's loss times its off-policy correction weight, when there is one."""
    return loss if is_weights is None else loss * is_weights


def token_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """[N, R] r = pi / pi_old = exp(lp - old), the log-ratio clamped to [-20, 20] first (verl)."""
    return torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor,
                      s: LossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, clipped) [N, R]: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) (separate bounds: DAPO's
    clip-higher); with `clip_c` (dual clip, Ye et al. 2020) a token with A < 0 takes min(that, -A clip_c)."""
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if s.clip_c is not None:
        dual = -advantages * s.clip_c
        take = (advantages < 0) & (dual < loss)
        loss = torch.where(take, dual, loss)
        clipped = clipped | take
    return loss, clipped


@register_policy_loss("ppo", "token ratio")
def ppo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
        s: LossSettings, is_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO (Schulman et al. 2017): the clipped surrogate (`clipped_surrogate`) of the token ratio."""
    ratio = token_ratio(logprobs, old_logprobs)
    loss, clipped = clipped_surrogate(ratio, advantages, s)
    return weighted(loss, is_weights), clipped, ratio


@register_policy_loss("gspo", "sequence ratio")
def gspo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         s: LossSettings, is_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): one ratio per sequence, s = exp(mean_t(lp - old)) over its masked tokens, applied
    to every token as exp(lp - sg(lp) + sg(log s)) so each token's gradient is s * grad lp; the log-ratio is
    clamped at 10 (verl), then clipped like ppo with the paper's small ranges (3e-4 / 4e-4)."""
    m = mask.to(logprobs.dtype)
    seq = ((logprobs - old_logprobs) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)  # [N, 1]
    ratio = torch.exp((logprobs - logprobs.detach() + seq.detach()).clamp(max=10.0))  # [N, R]
    loss, clipped = clipped_surrogate(ratio, advantages, s)
    return weighted(loss, is_weights), clipped, ratio


@register_policy_loss("cispo", "clipped ratio as a weight")
def cispo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
          s: LossSettings, is_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) A lp: the clipped
    ratio only weighs the gradient, so clipped tokens still train (a ppo clip would zero them)."""
    ratio = token_ratio(logprobs, old_logprobs)
    kept = ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)
    loss = -kept.detach() * advantages * logprobs
    return weighted(loss, is_weights), kept != ratio, ratio


@register_policy_loss("sapo", "smooth gate")
def sapo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         s: LossSettings, is_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SAPO (arXiv:2511.20347): a smooth gate instead of the clip, loss = -A (4 / tau) sigmoid(tau (r - 1)), with
    tau = `sapo_tau` (positive A, negative A); its gradient equals ppo's at r = 1. Nothing is clipped."""
    ratio = token_ratio(logprobs, old_logprobs)
    tau = torch.where(advantages > 0, s.sapo_tau[0], s.sapo_tau[1]).to(ratio.dtype)
    loss = -advantages * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return weighted(loss, is_weights), torch.zeros_like(mask, dtype=torch.bool), ratio


@register_policy_loss("gmpo", "geometric-mean ratio, log-space clip")
def gmpo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         s: LossSettings, is_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GMPO (arXiv:2507.20673): one geometric-mean ratio per sequence, exp(mean_t(x_t)), where the token log-ratio
    x = lp - old is clipped in log space to [-clip_low, clip_high] on the side the advantage moves it
    (sign(A) min(sign(A) x, sign(A) clip(x))), times the sequence's mean advantage; that sequence loss sits on each
    of its tokens, so seq-mean-token-mean gives the mean over sequences (verl's `geo_mean`; verl also counts empty
    rows in that mean). The importance weight of a sequence is the geometric mean of its tokens' (as verl); the
    ratio reported is the sequence's."""
    m = mask.to(logprobs.dtype)
    n = m.sum(-1, keepdim=True) + 1e-8  # [N, 1]
    x, sign = logprobs - old_logprobs, torch.sign(advantages)
    kept = sign * torch.minimum(sign * x, sign * x.clamp(-s.clip_low, s.clip_high))
    seq_ratio = torch.exp((kept * m).sum(-1, keepdim=True) / n)  # [N, 1]
    seq_adv = (advantages * m).sum(-1, keepdim=True) / n
    loss = (-seq_adv * seq_ratio).expand_as(logprobs)
    if is_weights is not None:
        is_weights = torch.exp((torch.log(is_weights + 1e-10) * m).sum(-1, keepdim=True) / n)  # [N, 1]
    clipped = (kept != x) & (advantages != 0)
    return weighted(loss, is_weights), clipped, seq_ratio.detach().expand_as(logprobs)


@dataclass(frozen=True)
class AggMode:
    """A loss aggregation: its numerator over the row sums of the masked loss, and what its denominator counts."""
    numerator: Callable[[torch.Tensor, torch.Tensor, float | None], torch.Tensor]  # (rows [N], mask, horizon) -> []
    per: Callable[[torch.Tensor], float] | None  # mask [N, R] -> its share of the denominator; None: no denominator


AGG_MODES: Registry[AggMode] = Registry("aggregation")


def register_loss_agg(name: str, *, per: Callable[[torch.Tensor], float] | None, note: str = ""):
    """Decorator: the numerator function of aggregation `name`, divided by the global batch's `per` (`count_tokens`,
    `count_rows`; additive over rows, so the sum over micro-batches and ranks); None: no denominator."""
    def add(fn):
        AGG_MODES.add(name, AggMode(fn, per), note)
        return fn
    return add


def count_tokens(mask: torch.Tensor) -> float:
    """The response tokens of this mask."""
    return float(mask.sum())


def count_rows(mask: torch.Tensor) -> float:
    """The non-empty rows of this mask."""
    return float((mask.sum(-1) > 0).sum())


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, *, norm: float | torch.Tensor | None = None,
              horizon: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss [N, R] to a scalar with the registered aggregation `mode`: its numerator over the
    row sums, divided by `norm`.

    `norm` replaces the denominator (`normaliser(mask, mode)`: tokens, or non-empty rows) with the one of the
    whole global batch, so that summing the result over micro-batches and ranks equals one big batch; a mode with
    no denominator (token-sum) ignores it.
    """
    agg = AGG_MODES.lookup(mode)
    m = mask.to(loss.dtype)
    num = agg.numerator((loss * m).sum(-1), m, horizon)
    if agg.per is None:
        return num
    if norm is None:
        norm = agg.per(m)
    return num / max(float(norm), 1.0)


def normaliser(mask: torch.Tensor, mode: str) -> float:
    """The denominator `aggregate` uses for this mask: response tokens for token-mean, non-empty rows for the seq-mean
    modes (additive over rows, so the global batch's is the sum over micro-batches and ranks); token-sum has none."""
    per = AGG_MODES.lookup(mode).per
    return 1.0 if per is None else per(mask)


@register_loss_agg("token-mean", per=count_tokens)
def token_mean(rows: torch.Tensor, mask: torch.Tensor, horizon: float | None) -> torch.Tensor:
    """sum L M / sum M."""
    return rows.sum()


@register_loss_agg("seq-mean-token-mean", per=count_rows)
def seq_mean_token_mean(rows: torch.Tensor, mask: torch.Tensor, horizon: float | None) -> torch.Tensor:
    """The mean over non-empty rows of (row sum / row count)."""
    return (rows / mask.sum(-1).clamp(min=1)).sum()


@register_loss_agg("seq-mean-token-sum", per=count_rows)
def seq_mean_token_sum(rows: torch.Tensor, mask: torch.Tensor, horizon: float | None) -> torch.Tensor:
    """The mean over non-empty rows of the row sum."""
    return rows.sum()


@register_loss_agg("seq-mean-token-sum-norm", per=count_rows)
def seq_mean_token_sum_norm(rows: torch.Tensor, mask: torch.Tensor, horizon: float | None) -> torch.Tensor:
    """seq-mean-token-sum / `horizon` (default: the padded length R; Dr.GRPO: the max response length).
    Deviation: verl divides the total (not the row mean) by the horizon; the mean over rows is Dr.GRPO's formula
    (Liu et al. 2025, eq. 3) and keeps the scale independent of the batch size."""
    return rows.sum() / (horizon if horizon else mask.shape[-1])


@register_loss_agg("token-sum", per=None, note="no divisor")
def token_sum_agg(rows: torch.Tensor, mask: torch.Tensor, horizon: float | None) -> torch.Tensor:
    """sum L M: no denominator (`norm` is ignored; verl's token-sum)."""
    return rows.sum()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               clip: float, agg: str = "token-mean",
               norm: float | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO, as in verl's `compute_value_loss`): (0.5 agg(max((v - R)^2, (v_clip - R)^2)),
    clip fraction) with v_clip = old_v + clamp(v - old_v, -clip, clip). All [N, R]. The clip fraction counts tokens
    where the clipped error was the larger (a token mean over this mask)."""
    clipped_v = old_values + (values - old_values).clamp(-clip, clip)
    l1, l2 = (values - returns) ** 2, (clipped_v - returns) ** 2
    m = mask.to(values.dtype)
    frac = ((l2 > l1).float() * m).sum() / m.sum().clamp(min=1)
    return 0.5 * aggregate(torch.maximum(l1, l2), m, agg, norm=norm), frac


KL_ESTIMATORS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("KL estimator")
register_kl_estimator = KL_ESTIMATORS.register


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate [N, R] of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence")
    by the registered `estimator`, a function of the log-ratio x = log pi - log pi_ref."""
    return KL_ESTIMATORS.lookup(estimator)(logprobs - ref_logprobs)


@register_kl_estimator("k1")
def k1(x: torch.Tensor) -> torch.Tensor:
    """x: unbiased, high variance, can be negative."""
    return x


@register_kl_estimator("k2")
def k2(x: torch.Tensor) -> torch.Tensor:
    """x^2 / 2."""
    return 0.5 * x.square()


@register_kl_estimator("k3", "low_var_kl")
def k3(x: torch.Tensor) -> torch.Tensor:
    """exp(-x) - 1 + x (verl's `low_var_kl`): unbiased and non-negative. As in verl, -x is clamped to [-20, 20]
    before exp and the result to [-10, 10]."""
    nx = (-x).clamp(-20.0, 20.0)
    return (torch.exp(nx) - 1.0 - nx).clamp(-10.0, 10.0)


@register_kl_estimator("abs")
def abs_kl(x: torch.Tensor) -> torch.Tensor:
    """|x|."""
    return x.abs()


def token_sum(x: torch.Tensor, mask: torch.Tensor, num_tokens: float | torch.Tensor) -> torch.Tensor:
    """Token-mean over the global batch: sum(x * mask) / num_tokens, where num_tokens counts every response token
    of the whole optimizer step (all micro-batches and ranks). Used for metrics."""
    return (x * mask).sum() / num_tokens
