"""How twinplane runs on this machine: the device and dtype of each plane and the training precision, each
worker's devices and the collectives' backend, host-to-device copies and the KV pool's memory, seeding and the host
allocator. The rest of twinplane receives its `torch.device`, `torch.dtype` and `Precision` from here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch

from twinplane.platform import hardware

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(name: str | None) -> torch.device:
    """'auto' (or None) picks the accelerator when there is one."""
    if name in (None, "auto"):
        return default_device()
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but torch sees no GPU (torch {torch.__version__})")
    return dev


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[dtype]


def rollout_dtype(model, device: torch.device | str) -> torch.dtype:
    """The rollout engine's dtype for a config's `model` section: `model.rollout_dtype` when set; else bf16 on GPUs
    when the weights are fp32 (decoding is bound by memory traffic, and bf16 halves it; the trainer then recomputes
    the old log-probs itself, since the engine's differ from its own); else the weights' dtype."""
    if model.rollout_dtype:
        return resolve_dtype(model.rollout_dtype)
    dtype = resolve_dtype(model.dtype)
    return torch.bfloat16 if torch.device(device).type == "cuda" and dtype == torch.float32 else dtype


@dataclass(frozen=True)
class Precision:
    """The training plane's dtypes: master weights and optimizer in `param` (model.dtype), matmuls and attention
    in `compute`, gradient reductions, log-softmax and loss sums in `reduce` (fp32)."""

    param: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        """Compute runs in a lower precision than the weights (autocast / FSDP's param cast)."""
        return self.compute != self.param and self.compute != torch.float32


def train_precision(device: torch.device, param_dtype: torch.dtype | str, compute_dtype: str = "auto") -> Precision:
    """The one precision policy, whatever the rank count (`train.compute_dtype`): "auto" computes in bf16 on
    GPUs that support it (NVIDIA and AMD) and in the weights' dtype elsewhere (CPU: fp32 stays fp32)."""
    param = resolve_dtype(param_dtype)
    if compute_dtype == "auto":
        compute = torch.bfloat16 if torch.device(device).type == "cuda" and hardware.detect().bf16 else param
    else:
        compute = resolve_dtype(compute_dtype)
    return Precision(param, compute)


def autocast(precision: Precision, device: torch.device):
    """The context a training or scoring forward runs in under `precision` (a no-op when not mixed)."""
    if not precision.mixed:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=precision.compute)


# --- workers and collectives -----------------------------------------------------------------------------------------

def worker_device(name: str | None, assigned_gpus: list[int] | None = None) -> torch.device:
    """The device of a Ray worker that was given `assigned_gpus` (Ray's ids). Ray normally restricts each actor's
    visible devices (CUDA_VISIBLE_DEVICES; ROCR/HIP_VISIBLE_DEVICES on AMD) to its own, which torch then calls
    cuda:0; with Ray's RAY_EXPERIMENTAL_NOSET_* set for this vendor every device stays visible and the id is the
    index."""
    dev = resolve_device(name)
    if dev.type != "cuda" or not assigned_gpus:
        return dev
    noset = any(os.environ.get(k) == "1" for k in hardware.RAY_NOSET_ENV.get(hardware.vendor(), ()))
    dev = torch.device("cuda", int(assigned_gpus[0]) if noset else 0)
    torch.cuda.set_device(dev)
    return dev


def visible_devices_env(devices: list[int], info: hardware.PlatformInfo | None = None) -> dict[str, str]:
    """Env to set for a worker process that should see `devices` (indices as this process numbers them).

    On AMD only HIP_VISIBLE_DEVICES is set: it indexes the devices left by an inherited ROCR_VISIBLE_DEVICES, so
    setting both to the same list would filter twice. The Ray NOSET variables are included so that Ray keeps them."""
    info = info or hardware.detect()
    if not info.visible_devices_env:
        return {}
    env = {info.visible_devices_env[0]: ",".join(str(int(d)) for d in devices)}
    env.update({k: "1" for k in info.ray_noset_env})
    return env


def dist_backend(device: torch.device) -> str:
    # torch's ROCm build implements RCCL under the "nccl" name.
    return "nccl" if device.type == "cuda" else "gloo"


def collective_device(group=None) -> torch.device:
    """The device whose tensors the collectives of `group` (None: the default group) take: NCCL (and RCCL, under
    the same name) takes device tensors only, on the current device (the worker's, `worker_device`); gloo, host
    tensors."""
    import torch.distributed as dist

    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_tensor(t: torch.Tensor, group=None) -> torch.Tensor:
    """`t` on `collective_device(group)` (`t` itself when already there): every tensor that twinplane hands to a
    collective goes through here, and the caller uses what it returns."""
    return t.to(collective_device(group))


# --- memory ----------------------------------------------------------------------------------------------------------

def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, without waiting for the work queued there: on GPUs through pinned memory and an
    asynchronous copy (a copy from pageable memory waits for the stream to drain, and the device then idles until
    the host's next launch; the pinned buffer is kept until the copy is done by torch's host allocator); `.to`
    elsewhere. The pinned buffer is always a copy of `t` (`pin_memory` returns a pinned tensor itself), so the
    caller may change `t` at once."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return (t.clone() if t.is_pinned() else t).pin_memory().to(device, non_blocking=True)


def empty_cache(device: torch.device) -> None:
    """Return cached allocator blocks to the device (a colocated engine's KV cache, before training runs)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


CPU_KV_CACHE_BYTES = 1 << 30  # the automatic KV budget on CPU hosts: 1 GiB (capped by what a generate call needs)


def kv_cache_budget(device: torch.device, kv_cache_bytes: int, gpu_memory_utilization: float, held: int = 0) -> int:
    """Bytes the rollout engine may give its KV pool: `kv_cache_bytes` when set, else on GPUs a fraction of the
    memory free now (after the weights), else CPU_KV_CACHE_BYTES. Free on a GPU counts what torch's caching
    allocator holds unused, as well as what the driver has, and `held`, the engine's own pool kept from its last
    call: a released pool goes back to that cache, not to the driver, and a kept one is the engine's to reuse;
    leaving either out would shrink every later pool to a fraction of the first."""
    if kv_cache_bytes > 0:
        return int(kv_cache_bytes)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int((free + cached + held) * gpu_memory_utilization)
    return CPU_KV_CACHE_BYTES


def keep_kv_pool(device: torch.device) -> bool:
    """Whether a rollout engine that shares `device` with a trainer keeps its KV pool (and the decode graphs over
    it) between `generate` calls. On CPU hosts, yes: a fresh pool of fresh pages costs a page fault per 4 KiB on
    first touch (~10 ms per call at the demo's size, about as long as two decode steps), and the pool is at most
    CPU_KV_CACHE_BYTES of host memory. On GPUs, no: the trainer needs the memory between rollouts, and a new pool
    costs a recapture of the graphs (twinplane.rollout.graphs). An engine with a device of its own keeps both."""
    return torch.device(device).type == "cpu"


# --- process setup ---------------------------------------------------------------------------------------------------

def setup(seed: int, threads: int | None = None, deterministic: bool = True) -> None:
    """Seed every RNG and pin the thread count. CPU runs are bitwise reproducible with this;
    on GPU some kernels (e.g. atomics in backward scatter-adds) stay non-deterministic."""
    if threads:
        torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic and torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    tune_host_allocator()


def tune_host_allocator() -> bool:
    """Let glibc's malloc keep freed memory for reuse instead of handing it back to the OS after each tensor.

    On CPU every activation is a host allocation; by default glibc serves the large ones with fresh mmaps, or trims
    the heap as soon as they are freed, so the next step's tensors page-fault on first touch (every 4 KiB). Here
    that made elementwise kernels run at a few GB/s: the reference phase of the GRPO benchmark was 20% slower
    (100-108 ms vs 82-87 ms, three runs each). This raises the mmap threshold to glibc's maximum (32 MiB) and the
    trim threshold to 1 GiB, what the jemalloc/tcmalloc advice for PyTorch on CPU achieves without a preload: the
    process keeps its peak heap, as GPU caching allocators do. Process-wide, so everything in the process gains;
    skipped where the user set MALLOC_* variables, TWINPLANE_HOST_ALLOCATOR=0, or the C library is not glibc."""
    if sys.platform != "linux" or os.environ.get("TWINPLANE_HOST_ALLOCATOR", "1") == "0" or \
            any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h> parameter numbers
        return libc.mallopt(m_mmap_threshold, 32 << 20) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    except (OSError, AttributeError):
        return False
