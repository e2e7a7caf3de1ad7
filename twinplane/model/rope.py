"""Rotary position embeddings: the scaling types a config may ask for, their checks, and the inverse frequencies.

A config names its scaling in `rope_scaling` (transformers 4.x) or `rope_parameters` (5.x) as `rope_type`; a type
that is not in `ROPE_TYPES` is refused by name, never run as plain rope.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from twinplane.model.config import ModelConfig

# rope scaling types and the numbers each needs (all finite and > 0; llama3 also needs high_freq_factor > low)
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def finite(value) -> bool:
    """A finite number, as config.json may hold it (a bool is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_scaling(scaling: dict | None) -> None:
    """Raise ValueError, naming the type or number at fault, unless `scaling` is one this module computes."""
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    for key in ROPE_TYPES[rope_type]:
        if not (finite(scaling.get(key)) and scaling[key] > 0):
            raise ValueError(f"{rope_type} rope scaling needs {key} as a finite number > 0, got {scaling.get(key)!r}")
    if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")


def read_rope(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling or None for plain rope) from either config form: 5.x keeps theta and scaling together in
    `rope_parameters`; 4.x splits them into `rope_theta` and `rope_scaling` (whose type key may be `type`)."""
    if not isinstance(hf.get("rope_scaling") or {}, dict) or not isinstance(hf.get("rope_parameters") or {}, dict):
        raise ValueError("rope_scaling / rope_parameters must be an object")
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = rope or dict(hf.get("rope_scaling") or {})
    if scaling:
        scaling["rope_type"] = scaling.pop("type", None) or scaling.get("rope_type", "default")
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return theta, scaling


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (fp32), with `linear` or `llama3` scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d))
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / s["factor"]
    elif kind == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()
