"""Parameter counts of a native model, from its decoder layers built on the meta device (nothing is allocated):
exact for every family by construction, its biases, sinks, extra norms, latent attention's norms and DeltaNet's
convolution and gates included, and for any family added later.

- `total`: every parameter (what memory holds, `ModelConfig.num_params`);
- `active`: the parameters one token runs through, each sparse layer's routed experts counted k of E
  (`ModelConfig.active_params`);
- `layer_matmul`: the decoder layers' weights a token multiplies by, active experts only (2-D and stacked weights,
  the depthwise convolution's taps; not biases, norms or other vectors): what FLOP counts take
  (`flops.matmul_params`);
- `expert`: one routed expert's parameters, per sparse layer (what a decode step may read, `flops.decode_read_params`).
A layer's routed experts are the parameters under a module named `experts` (stacked [E, ...]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from twinplane.model.families import family

if TYPE_CHECKING:
    from twinplane.model.config import ModelConfig


@dataclass(frozen=True)
class Counts:
    total: int
    active: int
    layer_matmul: int
    expert: tuple[int, ...]  # per sparse layer, in order


@dataclass(frozen=True)
class _Layer:
    total: int
    matmul: int
    routed: int  # all routed experts' parameters
    routed_matmul: int


_CACHE: dict[str, Counts] = {}


def counts(cfg: ModelConfig) -> Counts:
    """The model's counts, computed once per configuration (keyed by its fields)."""
    key = repr(cfg)
    if key not in _CACHE:
        if len(_CACHE) >= 64:
            _CACHE.clear()
        _CACHE[key] = _count(cfg)
    return _CACHE[key]


def _layer(cfg: ModelConfig, index: int) -> _Layer:
    with torch.device("meta"):
        layer = family(cfg.model_type).layer(cfg, index)
    total = matmul = routed = routed_matmul = 0
    for name, p in layer.named_parameters():
        n, is_matmul, is_routed = p.numel(), p.ndim >= 2 and not name.endswith("bias"), "experts" in name.split(".")
        total += n
        matmul += n if is_matmul else 0
        routed += n if is_routed else 0
        routed_matmul += n if is_routed and is_matmul else 0
    return _Layer(total, matmul, routed, routed_matmul)


def _count(cfg: ModelConfig) -> Counts:
    d, v = cfg.hidden_size, cfg.vocab_size
    with torch.device("meta"):
        norm = sum(p.numel() for p in family(cfg.model_type).norm(d, cfg.rms_norm_eps).parameters())
    layers = [_layer(cfg, i) for i in range(cfg.num_layers)]
    E, idle = max(cfg.num_experts, 1), cfg.num_experts - cfg.num_experts_per_tok  # experts a token does not run
    total = sum(x.total for x in layers) + v * d * (1 if cfg.tie_word_embeddings else 2) + norm
    active = total - sum(x.routed // E * idle for x in layers)
    matmul = sum(x.matmul - x.routed_matmul // E * idle for x in layers)
    return Counts(total, active, matmul, tuple(x.routed // E for x in layers if x.routed))
