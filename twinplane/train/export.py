"""The one way weights leave the training plane: full tensors by their Hugging Face names.

Weight sync (in-process and the cluster broadcast), checkpoints and `save_pretrained` all iterate this, so a change
to what leaves (adapter-only export, a dtype) is made once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor


def export_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter, in `named_parameters` order, detached and cast to `dtype` (None =
    as held). An FSDP2-sharded parameter (DTensor) is all-gathered when its turn comes: a collective, so every
    rank must iterate in step, and only one full tensor is alive at a time if the caller lets it go."""
    for name, p in model.named_parameters():
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        yield name, t if dtype is None else t.to(dtype)
