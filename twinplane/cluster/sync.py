"""Weight sync: the bucketed broadcast that moves full weights from training rank 0 to rollout engines over a
torch.distributed group, and the in-process copy; both verified by checksum (`model.checksum`) or bitwise.

Both ends derive the same bucket plan from the same (name, shape) list, so only the flat buffers travel.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from twinplane.model.checksum import combine_checksums, tensor_checksum, weights_checksum
from twinplane.model.lora import has_lora
from twinplane.platform import runtime

Shapes = list[tuple[str, torch.Size]]


def bucket_plan(shapes: Shapes, element_size: int, bucket_bytes: int, apart: frozenset[str] = frozenset()
                ) -> list[Shapes]:
    """Consecutive tensors grouped into buckets of at most `bucket_bytes` (a larger tensor travels alone); the
    tensors named in `apart` (fp32 ones in a sync of another dtype, `precision.fp32_names`) only share buckets with
    each other, so that every bucket is one flat buffer of one dtype."""
    buckets: list[Shapes] = [[]]
    used = 0
    for name, shape in shapes:
        size = shape.numel() * element_size
        if buckets[-1] and (used + size > bucket_bytes or (name in apart) != (buckets[-1][0][0] in apart)):
            buckets.append([])
            used = 0
        buckets[-1].append((name, shape))
        used += size
    return [b for b in buckets if b]


def broadcast_bucket(tensors: list[torch.Tensor] | None, bucket: Shapes, dtype: torch.dtype, device: torch.device,
                     src: int, group) -> list[tuple[str, torch.Tensor]]:
    """One bucket from global rank `src` to every rank of `group`: the sender passes `tensors` (in bucket order,
    already in `dtype`), receivers pass None. Returns the bucket's (name, tensor) views of the flat buffer."""
    import torch.distributed as dist

    if tensors is not None:
        flat = torch.cat([t.reshape(-1) for t in tensors]).to(device)
    else:
        flat = torch.empty(sum(s.numel() for _, s in bucket), dtype=dtype, device=device)
    flat = runtime.collective_tensor(flat, group)
    dist.broadcast(flat, src=src, group=group)
    out, offset = [], 0
    for name, shape in bucket:
        out.append((name, flat[offset:offset + shape.numel()].view(shape)))
        offset += shape.numel()
    return out


@dataclass
class SyncReport:
    """One weight sync: the trainer's checksum of what it sent, each engine's checksum of what it holds after (or,
    in one process, a direct bitwise comparison of the two, `compared`)."""
    version: int
    expected: int
    checksums: dict[str, int]  # engine name -> checksum
    bytes: int  # payload per engine: the model in the engine dtype, or only the LoRA adapters (fp32)
    seconds: float  # the sender's time for gather + transfer
    compared: dict[str, bool] = field(default_factory=dict)  # engine name -> bitwise identical (in-process)

    def mismatched(self) -> list[str]:
        return [name for name, c in self.checksums.items() if c != self.expected] + \
            [name for name, same in self.compared.items() if not same]

    def describe(self, name: str) -> str:
        """Why engine `name` failed (for the error message)."""
        if name in self.checksums:
            return f"checksum {self.checksums[name]} != trainer's {self.expected}"
        return "its weights differ bitwise from the trainer's"


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    size = a.element_size()
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(size, torch.uint8)
    return torch.equal(a.detach().contiguous().view(-1).view(bits), b.detach().contiguous().view(-1).view(bits))


def sync_in_process(engine, trainer, version: int) -> SyncReport:
    """Colocated in one process: the engine copies the trainer's tensors directly.

    With LoRA, an engine that has adapters receives only them (it holds the base already); one without (merged,
    `rollout.lora_merge`) receives every weight with the adapters folded in. A full copy is verified by comparing
    every engine parameter with what was sent, bitwise: exact, and one read of each side instead of two checksums
    (~5x cheaper); an engine whose weights are not modules of this process (vLLM's) reports its own checksum.
    An adapter-only sync is verified by checksums that cover the engine's whole model (the frozen base's part
    computed once on the trainer), so a base damaged in the engine is caught too."""
    adapters = engine.model is not None and has_lora(engine.model)
    merged = not adapters and has_lora(trainer.model)
    t0 = time.perf_counter()
    named = list(trainer.named_weights(engine.dtype, adapters_only=adapters, merged=merged))
    engine.load_weights(named, version=version, strict=not adapters)
    seconds = time.perf_counter() - t0
    payload = sum(t.numel() * t.element_size() for _, t in named)
    if engine.model is None:  # the weights live in another engine (vLLM): its own checksum of what it loaded
        return SyncReport(version, weights_checksum(named), {"engine 0": engine.checksum()}, payload, seconds)
    if adapters:
        per_tensor = {name: tensor_checksum(t) for name, t in named} | trainer.frozen_checksums(engine.dtype)
        return SyncReport(version, combine_checksums(per_tensor), {"engine 0": engine.checksum()}, payload, seconds)
    held = dict(engine.model.named_parameters())
    same = held.keys() == {name for name, _ in named} and all(bitwise_equal(held[n], t) for n, t in named)
    return SyncReport(version, 0, {}, payload, seconds, compared={"engine 0": same})
