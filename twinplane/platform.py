"""The one place that decides device, dtype, threads and the distributed backend.

Everything else receives a `torch.device`/`torch.dtype` from here. ROCm builds of torch expose AMD GPUs
through the same `torch.cuda` API, so "cuda" below covers NVIDIA and AMD alike.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def vendor() -> str:
    if torch.cuda.is_available():
        return "amd" if torch.version.hip else "nvidia"
    return "cpu"


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


def dist_backend(device: torch.device) -> str:
    # torch's ROCm build implements RCCL under the "nccl" name.
    return "nccl" if device.type == "cuda" else "gloo"


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


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so phase timers measure work, not launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
