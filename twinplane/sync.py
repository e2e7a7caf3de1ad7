"""Weight-sync verification: a position-sensitive checksum of a model's tensors, computed on their device."""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

_MOD = 2**61 - 1  # keep partial sums well inside int64


def tensor_checksum(t: torch.Tensor) -> int:
    """Sum of the raw bit patterns weighted by (index mod 65521 + 1), so swapped or shifted values change it."""
    flat = t.detach().contiguous().view(-1)
    bits = flat.view({2: torch.int16, 4: torch.int32}.get(flat.element_size(), torch.uint8))
    w = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return int((bits.to(torch.int64) * w).sum().item()) % _MOD


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> int:
    """Checksum of (name, tensor) pairs in name order; `dtype` casts first, to compare against a
    copy held in another precision (e.g. a bf16 engine fed from fp32 master weights)."""
    total = 0
    for name, t in sorted(named, key=lambda kv: kv[0]):
        t = t if dtype is None else t.to(dtype)
        total = (total * 1_000_003 + zlib.crc32(name.encode()) + tensor_checksum(t)) % _MOD
    return total
