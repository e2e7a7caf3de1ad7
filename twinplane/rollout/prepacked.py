"""Linears whose weights are also held prepacked for oneDNN: the rollout engine's GEMMs on CPU.

`F.linear` on CPU calls MKL, which re-blocks the weight for every call; at decode batch sizes (a few to a hundred
rows) that is a large share of the work. oneDNN keeps the weight in its blocked layout once
(`_reorder_linear_weight`) and runs the GEMM from it (`_linear_pointwise`), the kernels inductor emits for frozen
CPU linears. Inference only (no autograd), so only the engine's own copy of the model is prepacked; the platform
decides where it applies (`platform.backends.prepacked_linear_ok`: CPU fp32), and everywhere else stays `F.linear`.
Attention's q/k/v and an MLP's gate/up are stacked into one prepacked GEMM each (`PrepackedAttention`,
`PrepackedMLP`): at decode batch sizes a per-call cost dominates small GEMMs, and one wide GEMM runs closer to the
machine's rate.

The prepacked copy follows the weight through `repack`, which re-packs what changed since (a `copy_` bumps a tensor's
version counter): the engine calls it right after loading weights (vLLM likewise processes weights when they are
loaded) and at the start of every generate call, so a weight changed in place between calls is followed too. The
GEMMs in between read the prepacked copy unchecked: a check per GEMM (reading each linear's parameters back) cost ~2%
of a small model's rollout. It costs one more copy of the weights in host memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from twinplane.model.blocks import MLP, Attention, rope
from twinplane.model.lora import LoraLinear


class PrepackedWeight:
    """`F.linear(x, cat(weights), cat(biases))` from a prepacked copy of the stacked weights (one weight: one linear),
    refreshed whenever one of them changes."""

    def __init__(self):
        self.key: tuple[tuple[int, int], ...] | None = None
        self.prepacked: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def refresh(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor] = ()) -> None:
        """Re-pack if a weight or bias changed since the last prepacking (~0.1-0.2 ms a weight, mostly fixed cost)."""
        key = [(t.data_ptr(), t._version) for t in weights] + [(t.data_ptr(), t._version) for t in biases]
        if key != self.key:
            self.prepacked = None  # free the old copy first: the new one can take its memory
            self.prepacked = torch.ops.mkldnn._reorder_linear_weight(_stack(weights))
            self.bias = _stack(biases) if biases else None
            self.key = key

    def __call__(self, x: torch.Tensor, weights: Sequence[torch.Tensor],
                 biases: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        self.refresh(weights, biases)
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The GEMM from the prepacked copy as of the last `refresh`."""
        return torch.ops.mkldnn._linear_pointwise(x, self.prepacked, self.bias, "none", [], "")

    def __deepcopy__(self, memo) -> PrepackedWeight:
        return PrepackedWeight()  # the prepacked tensor is opaque (not copyable); the copy prepacks its own weight


def _stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One tensor as is (a view: the prepacked bias follows it), several concatenated (a copy, re-made on change)."""
    return tensors[0].detach() if len(tensors) == 1 else torch.cat([t.detach() for t in tensors])


class Prepacked:
    """A module whose `prepacked_linears()` (plain `nn.Linear`s of one input) run as one prepacked GEMM. Modules become
    prepacked by a class swap (no __init__), so the prepacking lives in the instance dict, made on first use."""

    def prepacked_linears(self) -> tuple[nn.Linear, ...]:
        raise NotImplementedError

    def _packing(self) -> tuple[PrepackedWeight, list[torch.Tensor], list[torch.Tensor]]:
        """The prepacking and the linears' current weights and biases (read each time: a parameter may be replaced).
        The linears themselves are looked up once."""
        state = self.__dict__.get("_pack")
        if state is None:
            state = self.__dict__["_pack"] = PrepackedWeight(), self.prepacked_linears()
        pack, linears = state
        return pack, [m.weight for m in linears], [m.bias for m in linears if m.bias is not None]

    def refresh(self) -> None:
        """Re-pack if a weight or bias changed (in place or replaced) since the last prepacking."""
        pack, weights, biases = self._packing()
        pack.refresh(weights, biases)

    def prepacked_gemm(self, x: torch.Tensor) -> torch.Tensor | None:
        """The linears' outputs side by side [..., sum of out_features], from the prepacking as of the last `refresh`
        (prepacked on first use); None with autograd on (the prepacked ops have no backward: the caller takes the plain
        path)."""
        state = self.__dict__.get("_pack")
        if state is not None and state[0].prepacked is not None and not torch.is_grad_enabled():
            return state[0].run(x)  # the decode loop
        pack, weights, biases = self._packing()  # first use (a deep copy prepacks its own), or autograd on
        if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
            return None
        pack.refresh(weights, biases)
        return pack.run(x)


class PrepackedLinear(Prepacked, nn.Linear):
    """An `nn.Linear` (same parameters, same state dict) computed from a prepacked weight."""

    def prepacked_linears(self) -> tuple[nn.Linear, ...]:
        return (self,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.prepacked_gemm(x)
        return F.linear(x, self.weight, self.bias) if y is None else y


class PrepackedLoraLinear(LoraLinear, PrepackedLinear):
    """A LoRA linear whose frozen base runs prepacked (`LoraLinear.forward`'s `super().forward` lands in
    PrepackedLinear); the adapters stay plain `F.linear` (rank-r GEMMs)."""


class PrepackedAttention(Prepacked, Attention):
    """q, k and v from one GEMM over the stacked projections."""

    def prepacked_linears(self) -> tuple[nn.Linear, ...]:
        return self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.prepacked_gemm(x)
        if y is None:
            return super().project(x)
        cfg = self.cfg
        return y.unflatten(-1, (-1, cfg.head_dim)).split((cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads), dim=-2)

    def qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `Attention.qkv`, with q and k roped in one pass over the GEMM's adjacent q and k heads: the same
        values, half the elementwise kernels (each costs more than its arithmetic at decode sizes)."""
        cfg = self.cfg
        y = None if cfg.qk_norm else self.prepacked_gemm(x)  # (q/k norms have their own weights: the plain path)
        if y is None:
            return super().qkv(x, cos, sin)
        y = y.unflatten(-1, (-1, cfg.head_dim)).transpose(1, 2)  # [B, H + 2 H_kv, T, hd]
        qk = rope(y[:, :cfg.num_heads + cfg.num_kv_heads], cos, sin)
        return qk[:, :cfg.num_heads], qk[:, cfg.num_heads:], y[:, cfg.num_heads + cfg.num_kv_heads:]


class PrepackedMLP(Prepacked, MLP):
    """gate and up from one GEMM over the stacked projections."""

    def prepacked_linears(self) -> tuple[nn.Linear, ...]:
        return self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, routing=None) -> torch.Tensor:
        y = self.prepacked_gemm(x)
        if y is None:
            return super().forward(x)
        gate, up = y.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))  # in place: no autograd here


# Both dimensions at least this: below it oneDNN's per-call cost (~25 us) outweighs its faster blocking (the demo's
# 128-wide model rolled out 12% slower prepacked; the 256-wide one of grpo_vs_trl 13% faster, side by side).
MIN_PREPACKED_DIM = 256


def worth_prepacking(shape: Sequence[int], min_dim: int = MIN_PREPACKED_DIM) -> bool:
    return min(shape) >= min_dim


FUSED = {Attention: PrepackedAttention, MLP: PrepackedMLP}


def prepack_linears(model: nn.Module, min_dim: int = MIN_PREPACKED_DIM) -> int:
    """Make an inference-only `model` prepacked, in place; returns how many GEMMs run prepacked. Attention's q/k/v
    and an MLP's gate/up become one GEMM each where they are plain linears (LoRA adapters keep them apart: the adapters
    add per projection); every other plain or LoRA linear that is `worth_prepacking` is prepacked on its own. Weights,
    names and state dict are unchanged. `min_dim=1` prepacks every linear: oneDNN's rows do not depend on how many
    rows share the call, MKL's (behind `F.linear`) do on some CPUs, so that is the batch-invariant engine."""
    count, fused = 0, set()
    for m in model.modules():
        cls = FUSED.get(type(m))
        if cls is None:
            continue
        linears = cls.prepacked_linears(m)
        if all(type(x) is nn.Linear for x in linears) \
                and worth_prepacking((sum(x.out_features for x in linears), linears[0].in_features), min_dim):
            m.__class__ = cls
            fused.update(id(x) for x in linears)
            count += 1
    for m in model.modules():
        if id(m) not in fused and type(m) in (nn.Linear, LoraLinear) and worth_prepacking(m.weight.shape, min_dim):
            m.__class__ = PrepackedLinear if type(m) is nn.Linear else PrepackedLoraLinear
            count += 1
    return count


def repack(model: nn.Module) -> None:
    """Bring every prepacked copy up to date: after a weight sync, and before a rollout (a weight changed in place)."""
    for m in model.modules():
        if isinstance(m, Prepacked):
            m.refresh()


def lm_head(x: torch.Tensor, weight: torch.Tensor, pack: PrepackedWeight | None) -> torch.Tensor:
    """`F.linear(x, weight)`, through `pack` when given (the engine's LM head, whose weight may be the embedding;
    refreshed with the rest of the engine's prepacking)."""
    return F.linear(x, weight) if pack is None else pack.run(x)
