"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str, min_ratio: float, decay_fraction: float = 0.3):
    """Linear warmup to 1, then constant, cosine decay to `min_ratio` at `total_steps`, or "wsd"
    (warmup-stable-decay): constant until the last `decay_fraction` of the steps, which decay as a cosine."""
    decay_from = total_steps - int(decay_fraction * total_steps) if schedule == "wsd" else warmup_steps

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant" or step < decay_from:
            return 1.0
        progress = min(1.0, (step - decay_from) / max(1, total_steps - decay_from))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_optimizer(params, lr: float, betas, weight_decay: float, warmup_steps: int, total_steps: int,
                    schedule: str | Callable[[int], float] = "constant", min_ratio: float = 0.1,
                    fused: bool | None = None):
    """AdamW and its schedule: a name for `lr_lambda`, or the factor per step itself. `fused` (None = on GPUs): the
    whole update in one kernel (CUDA and ROCm), instead of torch's per-tensor loop, which on a GPU is a few kernels
    per parameter; off on CPU, where the loop is the reference the bitwise resume tests were written against."""
    params = [p for p in params if p.requires_grad]
    if fused is None:
        fused = bool(params) and params[0].device.type == "cuda"
    # Norms and biases are not decayed (standard for decoder LMs).
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=tuple(betas),
                            fused=fused or None)
    if isinstance(schedule, str):
        schedule = lr_lambda(warmup_steps, total_steps, schedule, min_ratio)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


def named_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """AdamW state keyed by parameter name with full (unsharded) CPU tensors, so a checkpoint loads on any rank
    count or device. A collective when `model` is FSDP-sharded: every rank must call it."""
    from torch.distributed.tensor import DTensor

    state = {}
    for name, p in model.named_parameters():
        if p in opt.state:
            # (an offloaded shard goes back to the parameter's device first: the gather runs there)
            state[name] = {k: (v.to(p.device).full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
                           if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"state": state, "param_groups": groups}


def load_named_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer, saved: dict) -> None:
    """Inverse of `named_optimizer_state`: each rank keeps its shard of every full tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = dict(model.named_parameters())
    unknown = sorted(set(saved["state"]) - set(params))
    if unknown:
        raise ValueError(f"optimizer state names parameters this model does not have: {unknown[:3]}")
    for name, st in saved["state"].items():
        p = params[name]
        out = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and k != "step":
                v = distribute_tensor(v.to(p.device), p.device_mesh, p.placements) if isinstance(p, DTensor) \
                    else v.to(p.device)
            out[k] = v
        opt.state[p] = out
    for group, g in zip(opt.param_groups, saved["param_groups"], strict=True):
        group.update(g)
