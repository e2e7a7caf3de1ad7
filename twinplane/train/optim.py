"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str, min_ratio: float):
    """Linear warmup to 1, then constant or cosine decay to `min_ratio` at `total_steps`."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_optimizer(params, lr: float, betas, weight_decay: float, warmup_steps: int, total_steps: int,
                    schedule: str = "constant", min_ratio: float = 0.1):
    params = [p for p in params if p.requires_grad]
    # Norms and biases are not decayed (standard for decoder LMs).
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=tuple(betas))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup_steps, total_steps, schedule, min_ratio))
    return opt, sched
