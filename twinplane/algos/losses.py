"""Policy-loss pieces as pure per-token functions; the trainer aggregates them over the global batch."""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token (Schulman et al. 2017), with separate lower/upper clip ranges as in
    DAPO's clip-higher (Yu et al. 2025): loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)).

    logprobs, old_logprobs: [N, R]; advantages: [N, R] (or [N, 1], broadcast).
    Returns (loss [N, R], clipped [N, R] bool: the clipped branch was the active one).
    Deviation: the log-ratio is clamped to [-20, 20] before exp so one wild token cannot overflow.
    """
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def truncated_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance-sampling weights [N, R] = min(pi_old / pi_rollout, cap), detached: they correct for
    the rollout engine sampling from a policy that differs from the trainer's pi_old (a one-step weight lag in
    asynchronous training, or kernel/precision mismatch), as in Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training", and verl's TIS. They multiply the per-token policy loss.
    exp may overflow to inf for a wild token; the cap then takes it to `cap`."""
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence"):
    with log-ratio x = log pi - log pi_ref,
      k1 = x (unbiased, high variance, can be negative), k2 = x^2 / 2, k3 = exp(-x) - 1 + x (`low_var_kl`,
    unbiased and non-negative). Deviation: k3 is clamped to [-10, 10] as in verl, for stability."""
    x = logprobs - ref_logprobs
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x.square()
    if estimator == "k3":
        return (torch.exp(-x) - 1.0 + x).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r} (choose from {', '.join(KL_ESTIMATORS)})")


def token_sum(x: torch.Tensor, mask: torch.Tensor, num_tokens: float | torch.Tensor) -> torch.Tensor:
    """Token-mean aggregation over the global batch: sum(x * mask) / num_tokens, where num_tokens counts
    every response token of the whole optimizer step (all micro-batches, later all ranks). Summing this
    over micro-batches equals the mean over one big batch, so gradient accumulation changes nothing."""
    return (x * mask).sum() / num_tokens
