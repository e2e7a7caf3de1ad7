"""Optimizer-state offload: AdamW's moments live in host memory between updates, on the device only for `step()`.

Its two fp32 moments (8 bytes per parameter) weigh as much as fp32 weights and grads together; offloading them
frees that memory for activations at the cost of a host-device round trip per optimizer step.
"""

from __future__ import annotations

import torch


def move_optimizer_state(opt: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every tensor of `opt.state` to `device` in place (DTensor states keep their sharding: `.to` moves the
    local shard). 0-dim tensors (AdamW's `step` counter) stay where the optimizer put them: it keeps them on CPU
    unless `capturable`/`fused`, and then wants them beside the parameters.

    Copies to an accelerator are non-blocking (stream-ordered before the `step()` that reads them); copies back
    to the host block, so the state can be read (e.g. checkpointed) as soon as this returns."""
    device = torch.device(device)
    non_blocking = device.type != "cpu"
    for state in opt.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # `.to` is a no-op when already there
                state[k] = v.to(device, non_blocking=non_blocking)
