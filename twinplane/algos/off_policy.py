"""Off-policy correction: the engine samples from a behaviour policy pi_rollout (weights some versions stale, or
other kernels and dtypes) while the trainer's clip is centred on the proximal policy pi_old, the log-probs the
trainer recomputes before it updates. The decoupled objective (Hilton et al. 2022, "Batch size-invariance for policy
optimization"; AReaL) keeps the two apart: the policy loss clips pi / pi_old, and each token's loss is weighted by
a correction of the behaviour ratio r = pi_old / pi_rollout, made here: truncated (TIS), masked to a band (drop the
token or its whole sequence), or IcePop's in-band ratio. `Algorithm.off_policy` picks them from `algo.is_*`.

Each importance weight and each band mask is one function registered under its `algo.is_weight` / `algo.is_mask`
name (`@register_is_weight("token")`, `@register_is_mask("geometric")`) that maps log-probs and the response mask,
all [N, R], and one `CorrectionSettings` to detached tensors (or None: off). Log-ratios are clamped to [-20, 20]
before exp, as in verl's `rollout_corr_helper`, except in the token TIS weight, whose overflow goes to the cap.
Deviation from verl: the bands bound r itself; verl's `*_k1` rejection statistics are log(pi_rollout / pi_old), so
verl's threshold "lo_hi" is the band [1 / hi, 1 / lo] here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from twinplane.algos.registry import Registry

BOUND = 20.0  # |log-ratio| limit before exp: e^20 ~ 4.9e8


@dataclass(frozen=True)
class CorrectionSettings:
    """The correction's own settings (`algo.tis_cap`, `algo.is_low`, `algo.is_high`), built once from the `algo`
    section (`from_algo`)."""
    cap: float = 2.0  # truncation of the token and sequence weights
    low: float = 0.5  # the ratio band [low, high] of the masks and icepop
    high: float = 2.0

    @classmethod
    def from_algo(cls, algo) -> CorrectionSettings:
        """From a resolved `algo` config section (duck-typed: this package never imports the config)."""
        return cls(cap=algo.tis_cap, low=algo.is_low, high=algo.is_high)


# (old_logprobs, rollout_logprobs, mask, settings), all [N, R] -> detached [N, R] (weights; keep, bool) or None
Correction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, CorrectionSettings], torch.Tensor | None]
IS_WEIGHTS: Registry[Correction] = Registry("importance weight")
IS_MASKS: Registry[Correction] = Registry("mask level")
register_is_weight = IS_WEIGHTS.register
register_is_mask = IS_MASKS.register


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


@register_is_weight("token")
def token_weight(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                 s: CorrectionSettings) -> torch.Tensor:
    """min(r_t, cap) (`truncated_is_weights`)."""
    return truncated_is_weights(old_logprobs, rollout_logprobs, s.cap)


@register_is_weight("sequence", "prod r")
def sequence_weight(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                    s: CorrectionSettings) -> torch.Tensor:
    """min(prod_t r_t, cap) on every token of the row (`sequence_is_weights`)."""
    return sequence_is_weights(old_logprobs, rollout_logprobs, mask, s.cap)


@register_is_weight("icepop", "r in [is_low, is_high], else 0")
def icepop_weight(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                  s: CorrectionSettings) -> torch.Tensor:
    """r_t inside the band [low, high], 0 outside (`icepop_weights`)."""
    return icepop_weights(old_logprobs, rollout_logprobs, s.low, s.high)


@register_is_weight("off")
def no_weight(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
              s: CorrectionSettings) -> None:
    """No importance weight."""
    return None


def in_band(x: torch.Tensor, like: torch.Tensor, s: CorrectionSettings) -> torch.Tensor:
    """[N, R] bool: the log-ratio statistic x ([N, R], or [N, 1] per row) within [log low, log high], on every
    column of `like`."""
    return ((x >= math.log(s.low)) & (x <= math.log(s.high))).expand_as(like)


def _log_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    return (old_logprobs - rollout_logprobs).clamp(-BOUND, BOUND)  # [N, R]


@register_is_mask("off")
def no_mask(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
            s: CorrectionSettings) -> None:
    """No band mask."""
    return None


@register_is_mask("token", "the token's r")
def token_mask(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
               s: CorrectionSettings) -> torch.Tensor:
    """Drop the tokens whose r_t leaves the band (verl's token_k1)."""
    return in_band(_log_ratio(old_logprobs, rollout_logprobs), old_logprobs, s)


@register_is_mask("sequence", "the row's prod r")
def sequence_mask(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                  s: CorrectionSettings) -> torch.Tensor:
    """Drop the rows whose prod_t r_t over their masked tokens leaves the band (verl's seq_sum_k1)."""
    x = _log_ratio(old_logprobs, rollout_logprobs)
    return in_band(_row_sum(x, mask.to(x.dtype)), old_logprobs, s)


@register_is_mask("geometric", "the row's geometric mean")
def geometric_mask(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                   s: CorrectionSettings) -> torch.Tensor:
    """Drop the rows whose geometric mean (prod_t r_t)^(1/|y|) leaves the band: independent of the length, so one
    band suits short and long answers (verl's seq_mean_k1)."""
    x = _log_ratio(old_logprobs, rollout_logprobs)
    m = mask.to(x.dtype)
    return in_band(_row_sum(x, m) / (m.sum(-1, keepdim=True) + 1e-8), old_logprobs, s)


def band_keep(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, level: str,
              low: float, high: float) -> torch.Tensor | None:
    """[N, R] bool, masked importance sampling: False where the ratio of the registered mask `level` (token,
    sequence, geometric) leaves [low, high]; None for off."""
    return IS_MASKS.lookup(level)(old_logprobs, rollout_logprobs, mask, CorrectionSettings(low=low, high=high))


def correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *, weight: str,
               keep: str, settings: CorrectionSettings) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(weights [N, R] or None, keep [N, R] bool or None): the registered importance weight `weight` and band mask
    `keep` (None: off)."""
    return (IS_WEIGHTS.lookup(weight)(old_logprobs, rollout_logprobs, mask, settings),
            IS_MASKS.lookup(keep)(old_logprobs, rollout_logprobs, mask, settings))


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
