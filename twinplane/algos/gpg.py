"""GPG, Group Policy Gradient (Chu et al. 2025, arXiv:2504.02546): the plain policy gradient -A log pi on every
token, with no importance ratio and no clip. `algo.policy_loss=gpg`; the advantages are any estimator's (the paper
pairs it with group-relative ones: `algo.adv_estimator=grpo`)."""

from __future__ import annotations

import torch

from twinplane.algos.losses import LossSettings, register_policy_loss, token_ratio, weighted


@register_policy_loss("gpg", "-A log pi: no ratio, no clip")
def gpg(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
        s: LossSettings, is_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """loss = -A lp [N, R], as verl's `compute_policy_loss_gpg`: its gradient is -A grad lp, the REINFORCE update
    at the policy's own samples. pi_old plays no part, so with `train.mini_batches` > 1 the later mini-batches are
    not corrected for having moved off it; the clip settings are unused. Nothing is clipped; the ratio pi / pi_old is
    reported only (detached). The paper's rescaling of the advantages by the share of groups with a signal is not
    part of the loss (verl leaves it out too)."""
    loss = -advantages * logprobs
    clipped = torch.zeros_like(mask, dtype=torch.bool)
    return weighted(loss, is_weights), clipped, token_ratio(logprobs.detach(), old_logprobs)
