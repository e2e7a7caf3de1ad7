"""Linears whose weights are also held pre-packed for oneDNN: the rollout engine's GEMMs on CPU.

`F.linear` on CPU calls MKL, which re-blocks the weight for every call; at decode batch sizes (a few to a hundred
rows) that is a large share of the work. oneDNN keeps the weight in its blocked layout once
(`_reorder_linear_weight`) and runs the GEMM from it (`_linear_pointwise`), the kernels inductor emits for frozen
CPU linears. Inference only (no autograd), so only the engine's own copy of the model is packed; the platform
decides where it applies (`platform.packed_linear_ok`: CPU fp32), and everywhere else stays `F.linear`.

The packed copy follows the weight: the engine re-packs right after loading weights (`repack`; vLLM likewise
processes weights when they are loaded), and a forward re-packs any weight changed in place since (a `copy_` bumps
the tensor's version counter). It costs one more copy of the weights in host memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twinplane.model.lora import LoraLinear


class PackedWeight:
    """`F.linear(x, weight, bias)` from a packed copy of `weight`, refreshed whenever `weight` changes."""

    def __init__(self):
        self.key: tuple[int, int] | None = None
        self.packed: torch.Tensor | None = None

    def refresh(self, weight: torch.Tensor) -> None:
        """Re-pack if `weight` changed since the last packing (~0.1-0.2 ms a weight, mostly fixed cost)."""
        key = (weight.data_ptr(), weight._version)
        if key != self.key:
            self.packed = None  # free the old copy first: the new one can take its memory
            self.packed, self.key = torch.ops.mkldnn._reorder_linear_weight(weight.detach()), key

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.refresh(weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def __deepcopy__(self, memo) -> PackedWeight:
        return PackedWeight()  # the packed tensor is opaque (not copyable); the copy packs its own weight


class PackedLinear(nn.Linear):
    """An `nn.Linear` (same parameters, same state dict) computed from a packed weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)  # the packed ops have no backward
        return self.pack()(x, self.weight, self.bias)

    def pack(self) -> PackedWeight:
        pack = self.__dict__.get("_pack")
        if pack is None:  # modules become PackedLinear by a class swap (no __init__)
            pack = self.__dict__["_pack"] = PackedWeight()
        return pack


class PackedLoraLinear(LoraLinear, PackedLinear):
    """A LoRA linear whose frozen base runs packed (`LoraLinear.forward`'s `super().forward` lands in PackedLinear);
    the adapters stay plain `F.linear` (rank-r GEMMs)."""


# Both dimensions at least this: below it oneDNN's per-call cost (~25 us) outweighs its faster blocking (the demo's
# 128-wide model rolled out 12% slower packed; the 256-wide one of grpo_vs_trl 13% faster, side by side).
MIN_PACKED_DIM = 256


def worth_packing(weight: torch.Tensor) -> bool:
    return min(weight.shape) >= MIN_PACKED_DIM


def pack_linears(model: nn.Module) -> int:
    """Make the plain and LoRA linears of an inference-only `model` that are `worth_packing` packed, in place;
    returns how many. Weights, names and state dict are unchanged."""
    count = 0
    for m in model.modules():
        if type(m) in (nn.Linear, LoraLinear) and worth_packing(m.weight):
            m.__class__ = PackedLinear if type(m) is nn.Linear else PackedLoraLinear
            count += 1
    return count


def repack(model: nn.Module) -> None:
    """Bring every packed copy up to date now (after a weight sync), instead of in the next forward."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.pack().refresh(m.weight)


def linear(x: torch.Tensor, weight: torch.Tensor, pack: PackedWeight | None) -> torch.Tensor:
    """`F.linear(x, weight)`, through `pack` when given (the engine's LM head, whose weight may be the embedding)."""
    return F.linear(x, weight) if pack is None else pack(x, weight)
