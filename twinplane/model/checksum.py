"""A position-sensitive checksum of a model's tensors, computed on their device: how both planes and the weight
sync tell that two copies of the weights are the same."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from functools import lru_cache

import torch

_MOD = 2**61 - 1
_CHUNK = 1 << 20  # elements per chunk: bounds the temporary int64 memory whatever the tensor size


@lru_cache(maxsize=8)
def _position_weights(device: torch.device) -> torch.Tensor:
    return torch.arange(_CHUNK, device=device, dtype=torch.int64) % 65521 + 1


def tensor_checksum(t: torch.Tensor) -> int:
    """Sum of the raw bit patterns weighted by position (index mod 65521 + 1, and chunk number), so changed,
    swapped or shifted values change it. Integer arithmetic: identical on every device."""
    flat = t.detach().contiguous().view(-1)
    bits = flat.view({2: torch.int16, 4: torch.int32}.get(flat.element_size(), torch.uint8))
    w = _position_weights(bits.device)
    acc = torch.zeros((), dtype=torch.int64, device=bits.device)
    for i, start in enumerate(range(0, bits.numel(), _CHUNK)):
        chunk = bits[start:start + _CHUNK].to(torch.int64)
        acc += (chunk * w[:chunk.numel()]).sum() * (i + 1)
    return int(acc.item()) % _MOD  # one host sync per tensor


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> int:
    """Checksum of (name, tensor) pairs in name order; `dtype` casts first, to compare against a
    copy held in another precision (e.g. a bf16 engine fed from fp32 master weights)."""
    return combine_checksums({name: tensor_checksum(t if dtype is None else t.to(dtype)) for name, t in named})


def combine_checksums(per_tensor: dict[str, int]) -> int:
    """The model checksum from per-tensor checksums (so a sender can checksum each bucket as it goes)."""
    total = 0
    for name in sorted(per_tensor):
        total = (total * 1_000_003 + zlib.crc32(name.encode()) + per_tensor[name]) % _MOD
    return total
