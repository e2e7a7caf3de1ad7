"""Parameters a model holds in fp32 whatever dtype it runs in, as transformers' `_keep_in_fp32_modules_strict` holds
them (DeepSeek-V3's router: its weight and its score-correction bias, whose bf16 rounding would change which
experts a token picks).

A module lists them in `fp32_params` (subclassing `Fp32Params`). Then
- `model.to(dtype)`, `.bfloat16()`, `to_empty` leave them fp32 with their values (`Fp32Params._apply`);
- `lora.cast_base` (the engines' cast, which sets parameters' data directly) leaves them fp32 too;
- `export_weights` yields them in fp32 whatever dtype it casts the rest to, so checkpoints and weight syncs carry
  them exactly (the bucketed broadcast sends them in buckets of their own, `cluster.sync.bucket_plan`);
- FSDP2 shards each such module as a unit of its own, gathered without the compute-dtype cast
  (`train.fsdp.shard_model`).
"""

from __future__ import annotations

import torch
from torch import nn


def _held(p: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """`p`'s data in fp32: `source`'s values on `p`'s device (uninitialised where either is on the meta device)."""
    if source.is_meta or p.is_meta:
        return torch.empty_like(p, dtype=torch.float32)
    return source.to(p.device, torch.float32)


class Fp32Params(nn.Module):
    fp32_params: tuple[str, ...] = ()  # names of this module's own parameters held in fp32

    def _apply(self, fn, recurse=True):
        before = {n: self._parameters[n].detach() for n in self.fp32_params}
        super()._apply(fn, recurse)
        for n, old in before.items():
            p = self._parameters[n]
            if p.dtype != torch.float32:
                p.data = _held(p, old)
        return self


def fp32_names(model: nn.Module) -> frozenset[str]:
    """Full names of the parameters `model` holds in fp32 whatever its dtype."""
    return frozenset(f"{prefix}.{n}" if prefix else n for prefix, m in model.named_modules()
                     if isinstance(m, Fp32Params) for n in m.fp32_params)
