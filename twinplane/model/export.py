"""The one way weights leave the training plane: full tensors by their Hugging Face names.

Weight sync (in-process and the cluster broadcast), checkpoints and `save_pretrained` all iterate this, so a change
to what leaves (adapter-only export, a dtype) is made once.

With LoRA the trainer's model holds frozen base weights and adapter tensors (`...q_proj.lora_A`/`lora_B`, or
PEFT's `...base_layer.weight` and `...lora_A.default.weight` on a model run with transformers' code);
`adapters_only` yields just the adapters (the engines already hold the base), `merged` yields base names only,
each targeted weight with its adapter folded in (W + scaling * B A), for engines or exports without adapters.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from twinplane.model.lora import adapted, is_adapter, merged_names
from twinplane.model.precision import fp32_names


def _full(p: torch.Tensor) -> torch.Tensor:
    p = p.detach()
    return p.full_tensor() if isinstance(p, DTensor) else p


def exported(name: str, adapters_only: bool = False, merged: bool = False) -> bool:
    """Whether `export_weights` yields the parameter `name` (both ends of a sync derive the same list from it)."""
    return is_adapter(name) if adapters_only else not (merged and is_adapter(name))


def export_shapes(model: torch.nn.Module, adapters_only: bool = False,
                  merged: bool = False) -> list[tuple[str, torch.Size]]:
    """(name, full shape) of what `export_weights` yields, in the same order, without gathering anything."""
    names = merged_names(model) if merged else {}
    return [(names.get(n, n), p.shape) for n, p in model.named_parameters() if exported(n, adapters_only, merged)]


@torch.no_grad()
def export_weights(model: torch.nn.Module, dtype: torch.dtype | None = None, *, adapters_only: bool = False,
                   merged: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) in parameter order, cast to `dtype` if given (adapters keep fp32 unless merged away, and
    so do the parameters a model holds in fp32, `precision.fp32_names`).

    FSDP-sharded parameters are gathered one tensor at a time: a collective, so every rank must consume the whole
    iterator in the same order. Tensors may be views of the live parameters: copy before changing them."""
    merge = {f"{a.base}.weight": a for a in adapted(model)} if merged else {}
    names = merged_names(model) if merged else {}
    fp32 = fp32_names(model) if dtype is not None else frozenset()
    for name, p in model.named_parameters():
        if not exported(name, adapters_only, merged):
            continue
        t = _full(p)
        a = merge.get(name)
        if a is not None:
            t = (t.float() + a.delta(_full(a.a), _full(a.b))).to(t.dtype)
        if dtype is not None and not is_adapter(name) and name not in fp32:
            t = t.to(dtype)
        yield names.get(name, name), t
