"""Off-policy correction: the engine samples from a behaviour policy pi_rollout (weights some versions stale, or
other kernels and dtypes) while the trainer's clip is centred on the proximal policy pi_old, the log-probs the
trainer recomputes before it updates. The decoupled objective (Hilton et al. 2022, "Batch size-invariance for policy
optimization"; AReaL) keeps the two apart: the policy loss clips pi / pi_old, and each token's loss is weighted by
a correction of the behaviour ratio r = pi_old / pi_rollout, made here: truncated (TIS), masked to a band (drop the
token or its whole sequence), or IcePop's in-band ratio. `Algorithm.off_policy` picks them from `algo.is_*`.

Each function maps log-probs and the response mask, all [N, R], to detached tensors. Log-ratios are clamped to
[-20, 20] before exp, as in verl's `rollout_corr_helper`, except in the token TIS weight, whose overflow goes to the
cap. Deviation from verl: the bands bound r itself; verl's `*_k1` rejection statistics are log(pi_rollout / pi_old),
so verl's threshold "lo_hi" is the band [1 / hi, 1 / lo] here.
"""

from __future__ import annotations

import math

import torch

IS_WEIGHTS = ("token", "sequence", "icepop", "off")
IS_MASKS = ("off", "token", "sequence", "geometric")
BOUND = 20.0  # |log-ratio| limit before exp: e^20 ~ 4.9e8


def truncated_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance-sampling weights [N, R] = min(pi_old / pi_rollout, cap), detached: they correct for
    the rollout engine sampling from a policy that differs from the trainer's pi_old (weight lag in asynchronous
    training, or kernel/precision mismatch), as in Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training", and verl's `compute_rollout_correction_weights` (rollout_is="token").
    exp may overflow to inf for a wild token; the cap then takes it to `cap`."""
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


def _row_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(-1, keepdim=True)  # [N, 1]


def sequence_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                        cap: float) -> torch.Tensor:
    """[N, R]: each row's min(prod_t r_t, cap) over its masked tokens, on every column: the unbiased sequence-level
    weight, truncated (verl's `compute_rollout_correction_weights`, rollout_is="sequence")."""
    log_w = _row_sum(old_logprobs - rollout_logprobs, mask.to(old_logprobs.dtype)).clamp(-BOUND, BOUND)
    return torch.exp(log_w).clamp(max=cap).expand_as(old_logprobs).detach()


def icepop_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, low: float,
                   high: float) -> torch.Tensor:
    """[N, R] IcePop (Ling Team 2025, Ring-1T): r_t where low <= r_t <= high, else 0; the dropped tokens stay in
    the loss's denominator. The ratio is not truncated inside the band. (verl has no function of this name.)"""
    r = torch.exp((old_logprobs - rollout_logprobs).clamp(-BOUND, BOUND))
    return torch.where((r >= low) & (r <= high), r, torch.zeros_like(r)).detach()


def band_keep(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, level: str,
              low: float, high: float) -> torch.Tensor:
    """[N, R] bool, masked importance sampling: False where the ratio leaves [low, high]. `level`: token (r_t:
    drop the token), sequence (prod_t r_t over the row's masked tokens: drop the row) or geometric (the
    geometric mean (prod_t r_t)^(1/|y|): drop the row; independent of the length, so one band suits short and
    long answers). As verl's `compute_rollout_rejection_mask` with token_k1, seq_sum_k1, seq_mean_k1."""
    x = (old_logprobs - rollout_logprobs).clamp(-BOUND, BOUND)
    m = mask.to(x.dtype)
    if level == "sequence":
        x = _row_sum(x, m)
    elif level == "geometric":
        x = _row_sum(x, m) / (m.sum(-1, keepdim=True) + 1e-8)
    elif level != "token":
        raise ValueError(f"unknown mask level {level!r} (choose from {', '.join(IS_MASKS[1:])})")
    return ((x >= math.log(low)) & (x <= math.log(high))).expand_as(old_logprobs)


def correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *, weight: str,
               keep: str, cap: float, low: float, high: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(weights [N, R] or None, keep [N, R] bool or None): the importance weight `weight` (`IS_WEIGHTS`; token and
    sequence truncated at `cap`, icepop in the band [low, high]) and the band mask `keep` (`IS_MASKS`)."""
    if weight == "token":
        w = truncated_is_weights(old_logprobs, rollout_logprobs, cap)
    elif weight == "sequence":
        w = sequence_is_weights(old_logprobs, rollout_logprobs, mask, cap)
    elif weight == "icepop":
        w = icepop_weights(old_logprobs, rollout_logprobs, low, high)
    elif weight == "off":
        w = None
    else:
        raise ValueError(f"unknown importance weight {weight!r} (choose from {', '.join(IS_WEIGHTS)})")
    kept = None if keep == "off" else band_keep(old_logprobs, rollout_logprobs, mask, keep, low, high)
    return w, kept


def masked_quantiles(x: torch.Tensor, mask: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
    """[len(qs)] quantiles of x's masked entries, linearly interpolated as `torch.quantile`, computed where x is
    without reading anything back (masked-out entries sort last, the count stays a tensor); 0 for an empty mask."""
    keep = mask.flatten() > 0
    v = torch.where(keep, x.flatten(), torch.full_like(x.flatten(), math.inf)).sort().values
    last = (keep.sum() - 1).clamp(min=0)
    pos = torch.tensor(qs, dtype=v.dtype, device=v.device) * last  # [Q]
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, last)
    out = v[lo] + (v[hi] - v[lo]) * (pos - lo)
    return torch.where(keep.any(), out, torch.zeros_like(out))


def correction_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       weights: torch.Tensor | None, keep: torch.Tensor | None, cap: float,
                       num_tokens: float, ranks: int = 1) -> dict[str, torch.Tensor]:
    """This rank's shares (summed over ranks they are the global batch's) of: tis_weight_mean, tis_clip_frac
    (weights at the cap), tis_masked_frac (tokens dropped by the mask or with weight 0), token means over the
    `num_tokens` response tokens of the global batch; tis_ratio_p05/p50/p95, quantiles of r_t over this rank's
    tokens, divided by `ranks` (summed: their mean over ranks)."""
    m = mask.to(old_logprobs.dtype)
    out = {}
    dropped = torch.zeros_like(m)
    if weights is not None:
        out["tis_weight_mean"] = (weights * m).sum() / num_tokens
        out["tis_clip_frac"] = ((weights >= cap).to(m.dtype) * m).sum() / num_tokens
        dropped = (weights == 0).to(m.dtype)
    if keep is not None:
        dropped = torch.maximum(dropped, (~keep).to(m.dtype))
    out["tis_masked_frac"] = (dropped * m).sum() / num_tokens
    r = torch.exp((old_logprobs - rollout_logprobs).clamp(-BOUND, BOUND))
    for name, q in zip(("tis_ratio_p05", "tis_ratio_p50", "tis_ratio_p95"),
                       masked_quantiles(r, m, (0.05, 0.5, 0.95)), strict=True):
        out[name] = q / ranks
    return out
