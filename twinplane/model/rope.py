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
ROPE_TYPES = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings"),
              "longrope": ("original_max_position_embeddings",)}
# yarn's optional numbers (absent or null: transformers' defaults)
YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def finite(value) -> bool:
    """A finite number, as config.json may hold it (a bool is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_scaling(scaling: dict | None, rotary_dim: int | None = None) -> None:
    """Raise ValueError, naming the type or number at fault, unless `scaling` is one this module computes (for
    `rotary_dim` rotated dims per head)."""
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    for key in ROPE_TYPES[rope_type]:
        if not (finite(scaling.get(key)) and scaling[key] > 0):
            raise ValueError(f"{rope_type} rope scaling needs {key} as a finite number > 0, got {scaling.get(key)!r}")
    if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
    if rope_type == "yarn":
        for key in YARN_OPTIONAL:
            if scaling.get(key) is not None and not finite(scaling[key]):
                raise ValueError(f"yarn rope scaling needs {key} as a finite number or null, got {scaling[key]!r}")
        if not isinstance(scaling.get("truncate", True), bool):
            raise ValueError(f"yarn rope scaling needs truncate as true or false, got {scaling['truncate']!r}")
    if rope_type == "longrope":
        check_longrope(scaling, rotary_dim)


def check_longrope(scaling: dict, rotary_dim: int | None) -> None:
    """longrope's per-frequency factors: two lists of rotary_dim/2 finite numbers > 0; factor and attention_factor
    optional (absent or null: derived as transformers derives them)."""
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if not (isinstance(values, list) and values and all(finite(v) and v > 0 for v in values)):
            raise ValueError(f"longrope rope scaling needs {key} as a list of finite numbers > 0, got {values!r}")
        if rotary_dim is not None and len(values) != rotary_dim // 2:
            raise ValueError(f"longrope rope scaling needs {key} with rotary_dim/2 = {rotary_dim // 2} numbers, "
                             f"got {len(values)}")
    for key in ("factor", "attention_factor"):
        if scaling.get(key) is not None and not (finite(scaling[key]) and scaling[key] > 0):
            raise ValueError(f"longrope rope scaling needs {key} as a finite number > 0 or null, got {scaling[key]!r}")


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
        scaling.pop("partial_rotary_factor", None)  # (not a scaling: read_partial_rotary)
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    elif scaling["rope_type"] in ("yarn", "longrope"):  # as transformers: a top-level value wins, else length
        if hf.get("original_max_position_embeddings") is not None:
            scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    return theta, scaling


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `scale` times the pretrained one (1 when not extended)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by (transformers' `attention_scaling`): 1 except for yarn, where it is
    `attention_factor` or, unset, YaRN's temperature (DeepSeek's configs: the ratio of the mscale and
    mscale_all_dim temperatures)."""
    s = cfg.rope_scaling or {}
    if s.get("rope_type") == "longrope":
        return longrope_attention_factor(cfg)
    if s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(s["factor"], mscale) / yarn_mscale(s["factor"], mscale_all_dim))
    return yarn_mscale(s["factor"])


def yarn_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """YaRN (Peng et al. 2023): frequencies below the correction range interpolated (divided by `factor`), above
    it kept, a linear ramp between; as transformers' `_compute_yarn_parameters`, op for op."""
    s, d, base = cfg.rope_scaling, cfg.rotary_dim, cfg.rope_theta
    factor, old_ctx = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return (d * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2, device="cpu").float() / d)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def read_partial_rotary(hf: dict, default: float = 1.0) -> float:
    """`partial_rotary_factor` as transformers reads it: from `rope_parameters` (5.x), else the top level (4.x),
    else the family's `default`."""
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    value = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    return default if value is None else value


def longrope_attention_factor(cfg: ModelConfig) -> float:
    """longrope's scale on cos and sin: `attention_factor`, else sqrt(1 + ln(factor) / ln(original length)) for a
    context extended by `factor` (unset: max_position_embeddings / original), 1 when not extended."""
    s = cfg.rope_scaling
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    old_ctx = s["original_max_position_embeddings"]
    factor = s.get("factor") or cfg.max_position_embeddings / old_ctx
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))


def longrope_inv_freq(cfg: ModelConfig, long: bool) -> torch.Tensor:
    """longrope's frequencies: plain rope's over the rotated dims, each divided by its `long_factor` (`long`) or
    `short_factor` entry. Which set a forward uses: `longrope_pick`."""
    d, s = cfg.rotary_dim, cfg.rope_scaling
    ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
    shape = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d
    return 1.0 / (ext * cfg.rope_theta ** shape)


def rope_limits(scaling: dict | None, max_position_embeddings: int) -> tuple[int | None, int | None]:
    """(longrope's pretraining length, dynamic NTK's length) of a `read_rope` scaling, None where it is of another
    type (`ModelConfig.longrope_limit`, `ModelConfig.dynamic_rope_limit`)."""
    kind = (scaling or {}).get("rope_type")
    return (scaling["original_max_position_embeddings"] if kind == "longrope" else None,
            max_position_embeddings if kind == "dynamic" else None)


def longrope_pick(positions: torch.Tensor, short: torch.Tensor, long: torch.Tensor, old_ctx: int,
                  per_token: torch.Tensor | None = None) -> torch.Tensor:
    """The frequencies each token rotates by: with `per_token` [B, T] (True: long), the caller's choice per token
    ([B, T, rotary_dim/2]); without, transformers' choice for a forward call: the long set when its highest
    position + 1 exceeds the pretraining length (a device-side select: no host sync)."""
    if per_token is not None:
        return torch.where(per_token[..., None], long, short)
    return torch.where(positions.max() + 1 > old_ctx, long, short)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [rotary_dim/2] (fp32), with `linear`, `llama3` or `yarn` scaling applied (longrope:
    its short set, see `longrope_inv_freq`; dynamic NTK: plain rope's, what it is within its limit,
    `ModelConfig.dynamic_rope_limit`)."""
    d = cfg.rotary_dim
    if (cfg.rope_scaling or {}).get("rope_type") == "yarn":
        return yarn_inv_freq(cfg).float()
    if (cfg.rope_scaling or {}).get("rope_type") == "longrope":
        return longrope_inv_freq(cfg, long=False)
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
