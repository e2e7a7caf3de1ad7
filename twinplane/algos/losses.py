"""Losses as pure per-token functions plus their aggregation; the trainer normalises over the global batch.

Conventions follow verl 0.9's `core_algos`; deviations are in each docstring. Shapes: N sequences, R columns.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
POLICY_LOSSES = ("ppo", "gspo", "cispo", "sapo", "gmpo")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")


def policy_loss(name: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_low: float, clip_high: float, clip_c: float | None = None,
                agg: str = "token-mean", is_weights: torch.Tensor | None = None, horizon: float | None = None,
                norm: float | torch.Tensor | None = None,
                sapo_tau: tuple[float, float] = (1.0, 1.05)) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(aggregated loss, metrics) for policy loss `name`; see `token_policy_loss` for the per-token terms and
    `aggregate` for `agg`, `horizon` and `norm` (the global batch's denominator). Metrics: `clip_frac` and the
    mean `ratio`, token means over this mask."""
    loss, clipped, ratio = token_policy_loss(name, logprobs, old_logprobs, advantages, mask, clip_low=clip_low,
                                             clip_high=clip_high, clip_c=clip_c, is_weights=is_weights,
                                             sapo_tau=sapo_tau)
    m = mask.to(loss.dtype)
    n = m.sum().clamp(min=1)
    return aggregate(loss, m, agg, norm=norm, horizon=horizon), {"clip_frac": (clipped.float() * m).sum() / n,
                                                      "ratio": (ratio.detach() * m).sum() / n}


def token_policy_loss(name: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, *, clip_low: float, clip_high: float, clip_c: float | None = None,
                      is_weights: torch.Tensor | None = None,
                      sapo_tau: tuple[float, float] = (1.0, 1.05)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token (loss [N, R], clipped [N, R] bool, ratio [N, R]).

    ppo   (Schulman et al. 2017): r = exp(clamp(lp - old, -20, 20)), loss = max(-A r, -A clip(r, 1 - clip_low,
          1 + clip_high)) (separate bounds: DAPO's clip-higher); with `clip_c` (dual clip, Ye et al. 2020) a token
          with A < 0 takes min(that, -A clip_c).
    gspo  (Zheng et al. 2025): one ratio per sequence, s = exp(mean_t(lp - old)) over its masked tokens, applied to
          every token as exp(lp - sg(lp) + sg(log s)) so each token's gradient is s * grad lp; the log-ratio is
          clamped at 10 (verl), then clipped like ppo with the paper's small ranges (3e-4 / 4e-4).
    cispo (MiniMax-M1, arXiv:2506.13585): loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) A lp: the clipped
          ratio only weighs the gradient, so clipped tokens still train (a ppo clip would zero them).
    sapo  (arXiv:2511.20347): a smooth gate instead of the clip, loss = -A (4 / tau) sigmoid(tau (r - 1)), with
          tau = `sapo_tau` (positive A, negative A); its gradient equals ppo's at r = 1. Nothing is clipped.
    gmpo  (arXiv:2507.20673): one geometric-mean ratio per sequence, exp(mean_t(x_t)), where the token log-ratio
          x = lp - old is clipped in log space to [-clip_low, clip_high] on the side the advantage moves it
          (sign(A) min(sign(A) x, sign(A) clip(x))), times the sequence's mean advantage; that sequence loss sits
          on each of its tokens, so seq-mean-token-mean gives the mean over sequences (verl's `geo_mean`; verl
          also counts empty rows in that mean).
    `is_weights` [N, R] (importance weights of the off-policy correction, detached) multiply the token losses;
    gmpo takes their geometric mean over each sequence (as verl). `clipped` marks tokens where a clip bound was
    the active branch.
    """
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))
    if name in ("ppo", "gspo"):
        if name == "gspo":
            m = mask.to(logprobs.dtype)
            seq = ((logprobs - old_logprobs) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
            ratio = torch.exp((logprobs - logprobs.detach() + seq.detach()).clamp(max=10.0))  # [N, R]
        unclipped = -advantages * ratio
        clipped_loss = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        loss = torch.maximum(unclipped, clipped_loss)
        clipped = clipped_loss > unclipped
        if clip_c is not None:
            dual = -advantages * clip_c
            take = (advantages < 0) & (dual < loss)
            loss = torch.where(take, dual, loss)
            clipped = clipped | take
    elif name == "cispo":
        kept = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        loss = -kept.detach() * advantages * logprobs
        clipped = kept != ratio
    elif name == "sapo":
        tau = torch.where(advantages > 0, sapo_tau[0], sapo_tau[1]).to(ratio.dtype)
        loss = -advantages * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
        clipped = torch.zeros_like(mask, dtype=torch.bool)
    elif name == "gmpo":
        m = mask.to(logprobs.dtype)
        n = m.sum(-1, keepdim=True) + 1e-8  # [N, 1]
        x, sign = logprobs - old_logprobs, torch.sign(advantages)
        kept = sign * torch.minimum(sign * x, sign * x.clamp(-clip_low, clip_high))
        seq_ratio = torch.exp((kept * m).sum(-1, keepdim=True) / n)  # [N, 1]
        seq_adv = (advantages * m).sum(-1, keepdim=True) / n
        loss = (-seq_adv * seq_ratio).expand_as(logprobs)
        ratio, clipped = seq_ratio.detach().expand_as(logprobs), (kept != x) & (advantages != 0)
        if is_weights is not None:  # the sequence's weight: the geometric mean of its tokens'
            is_weights = torch.exp((torch.log(is_weights + 1e-10) * m).sum(-1, keepdim=True) / n)
    else:
        raise ValueError(f"unknown policy loss {name!r} (choose from {', '.join(POLICY_LOSSES)})")
    if is_weights is not None:
        loss = loss * is_weights
    return loss, clipped, ratio


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, *, norm: float | torch.Tensor | None = None,
              horizon: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss [N, R] to a scalar.

      token-mean               sum L M / sum M
      seq-mean-token-mean      mean over non-empty rows of (row sum / row count)
      seq-mean-token-sum       mean over non-empty rows of row sum
      seq-mean-token-sum-norm  seq-mean-token-sum / `horizon` (default: the padded length R; Dr.GRPO: the max
                               response length)
      token-sum                sum L M (no denominator: `norm` is ignored; verl's token-sum)

    `norm` replaces the denominator (`normaliser(mask, mode)`: tokens, or non-empty rows) with the one of the
    whole global batch, so that summing the result over micro-batches and ranks equals one big batch.
    Deviation: verl's seq-mean-token-sum-norm divides the total (not the row mean) by the horizon; the mean over
    rows is Dr.GRPO's formula (Liu et al. 2025, eq. 3) and keeps the scale independent of the batch size.
    """
    m = mask.to(loss.dtype)
    rows = (loss * m).sum(-1)  # [N]
    if mode == "token-sum":
        return rows.sum()
    if mode == "token-mean":
        num = rows.sum()
    elif mode == "seq-mean-token-mean":
        num = (rows / m.sum(-1).clamp(min=1)).sum()
    elif mode == "seq-mean-token-sum":
        num = rows.sum()
    elif mode == "seq-mean-token-sum-norm":
        num = rows.sum() / (horizon if horizon else loss.shape[-1])
    else:
        raise ValueError(f"unknown aggregation {mode!r} (choose from {', '.join(AGG_MODES)})")
    if norm is None:
        norm = normaliser(m, mode)
    return num / max(float(norm), 1.0)


def normaliser(mask: torch.Tensor, mode: str) -> float:
    """The denominator `aggregate` uses for this mask: response tokens for token-mean, non-empty rows for the seq-mean
    modes (additive over rows, so the global batch's is the sum over micro-batches and ranks); token-sum has none."""
    if mode == "token-sum":
        return 1.0
    if mode == "token-mean":
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())


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


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence"):
    with log-ratio x = log pi - log pi_ref, k1 = x (unbiased, high variance, can be negative), k2 = x^2 / 2,
    k3 = exp(-x) - 1 + x (`low_var_kl`, unbiased and non-negative), abs = |x|. As in verl, k3 clamps -x to
    [-20, 20] before exp and the result to [-10, 10]."""
    x = logprobs - ref_logprobs
    if estimator == "k1":
        return x
    if estimator == "abs":
        return x.abs()
    if estimator == "k2":
        return 0.5 * x.square()
    if estimator == "k3":
        nx = (-x).clamp(-20.0, 20.0)
        return (torch.exp(nx) - 1.0 - nx).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r} (choose from {', '.join(KL_ESTIMATORS)})")


def token_sum(x: torch.Tensor, mask: torch.Tensor, num_tokens: float | torch.Tensor) -> torch.Tensor:
    """Token-mean over the global batch: sum(x * mask) / num_tokens, where num_tokens counts every response token
    of the whole optimizer step (all micro-batches and ranks). Used for metrics."""
    return (x * mask).sum() / num_tokens
