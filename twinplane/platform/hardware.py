"""What this machine is and how fast it runs: the vendor, devices, memory and attention kernels (`detect`, cached),
the device-selection variables of each vendor, and the measurements that phase timers, memory reports and MFU use.

ROCm builds of torch expose AMD GPUs through the same `torch.cuda` API, so "cuda" below covers NVIDIA and AMD alike;
the vendor is told apart by `torch.version.hip`. Peak FLOP/s of known GPUs come from the datasheets in `devices`.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from twinplane.platform import devices

VISIBLE_DEVICES_ENV = {"nvidia": ("CUDA_VISIBLE_DEVICES",), "amd": ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")}
# Ray rewrites the variables above for each actor unless told not to.
RAY_NOSET_ENV = {"nvidia": ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",),
                 "amd": ("RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES")}
FA2_AMD_ARCHS = ("gfx90a", "gfx94", "gfx95")  # MI200, MI300, MI350 series: the archs the CK build of flash_attn targets


@dataclass(frozen=True)
class AttentionInfo:
    """Which attention kernel runs, and what a later fast path could use. The model only calls
    `torch.nn.functional.scaled_dot_product_attention`, so `backend` is always "sdpa"; `sdpa_kernels` are the
    kernels SDPA may dispatch to here; the flash_attn fields are information, not a claim that it is used."""

    backend: str  # "sdpa"
    sdpa_kernels: tuple[str, ...]  # e.g. ("flash", "mem_efficient", "math", "cudnn")
    flash_attn_installed: bool  # FA2 package `flash_attn`
    flash_attn_eligible: bool  # installed and supported on this device (CUDA sm80+, or ROCm MI200/MI300/MI350)
    fa3_installed: bool  # Hopper-only `flash_attn_interface`
    fa3_eligible: bool  # NVIDIA sm90 only; never on ROCm


@dataclass(frozen=True)
class PlatformInfo:
    """This machine, as `detect()` found it."""

    vendor: str  # nvidia | amd | cpu | unknown (an accelerator torch can see but twinplane does not drive: runs on CPU)
    torch_version: str
    cuda_version: str | None
    hip_version: str | None
    device_type: str  # "cuda" (NVIDIA and AMD) or "cpu"
    device_names: tuple[str, ...]  # one per visible device; ("cpu",) on CPU
    device_memory: tuple[int, ...]  # bytes per device; host RAM on CPU when known, else 0
    device_count: int
    compute_capability: tuple[int, int] | None  # NVIDIA (major, minor); None elsewhere
    arch: str | None  # AMD gcnArchName, e.g. "gfx942:sramecc+:xnack-"
    bf16: bool
    dist_backend: str  # "nccl" on CUDA and ROCm (RCCL answers to the "nccl" name), "gloo" on CPU
    visible_devices_env: tuple[str, ...]  # env vars that select devices for a process
    ray_noset_env: tuple[str, ...]  # env vars that stop Ray from overwriting those
    attention: AttentionInfo
    peak_flops: float | None  # per device: dense bf16 from the spec table on GPU, measured fp32 GEMM on CPU
    peak_source: str  # "spec:<key>", "measured:fp32-gemm" or "unknown"

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    @property
    def device_name(self) -> str:
        return self.device_names[0]


def vendor() -> str:
    if torch.cuda.is_available():
        return "amd" if torch.version.hip else "nvidia"
    return "cpu"


_INFO: PlatformInfo | None = None
_ON_RESET: list[Callable[[], None]] = []  # what else `reset()` forgets: answers that hold for this machine only


def detect() -> PlatformInfo:
    """Describe this machine. Cached: the first call costs a short CPU GEMM on CPU hosts; `reset()` forgets it."""
    global _INFO
    if _INFO is None:
        _INFO = _detect()
    return _INFO


def on_reset(forget: Callable[[], None]) -> None:
    """Have `reset()` also call `forget` (the self-check caches of `backends`, whose answers hold for this machine)."""
    _ON_RESET.append(forget)


def reset() -> None:
    """Forget the cached `detect()` result and the self-checks (tests that simulate other hardware)."""
    global _INFO
    _INFO = None
    for forget in _ON_RESET:
        forget()


def _detect() -> PlatformInfo:
    cuda_ver, hip_ver = torch.version.cuda, getattr(torch.version, "hip", None)
    if torch.cuda.is_available():
        vend = "amd" if hip_ver else "nvidia"
        count = torch.cuda.device_count()
        names = tuple(torch.cuda.get_device_name(i) for i in range(count))
        props = [torch.cuda.get_device_properties(i) for i in range(count)]
        memory = tuple(int(p.total_memory) for p in props)
        cc = (int(props[0].major), int(props[0].minor)) if vend == "nvidia" else None
        arch = getattr(props[0], "gcnArchName", None) if vend == "amd" else None
        spec = devices.lookup(names[0])
        if spec is None:
            warnings.warn(f"unknown {vend} device {names[0]!r}: no peak FLOP/s in twinplane.platform.devices, MFU will "
                          "be null", stacklevel=2)
        peak = spec.bf16_tflops * 1e12 if spec else None
        source = f"spec:{spec.key}" if spec else "unknown"
        return PlatformInfo(vend, torch.__version__, cuda_ver, hip_ver, "cuda", names, memory, count, cc, arch,
                            bool(torch.cuda.is_bf16_supported()), "nccl", VISIBLE_DEVICES_ENV[vend],
                            RAY_NOSET_ENV[vend], _attention(vend, cc, arch), peak, source)
    other = _other_accelerator()
    if other:
        warnings.warn(f"torch reports a {other!r} accelerator, which twinplane does not drive: running on CPU",
                      stacklevel=2)
    vend = "unknown" if other else "cpu"
    return PlatformInfo(vend, torch.__version__, cuda_ver, hip_ver, "cpu", ("cpu",), (_host_memory(),), 1, None,
                        None, True, "gloo", (), (), _attention(vend, None, None), measure_cpu_flops(),
                        "measured:fp32-gemm")


def _attention(vendor: str, cc: tuple[int, int] | None, arch: str | None) -> AttentionInfo:
    fa2, fa3 = has_module("flash_attn"), has_module("flash_attn_interface")
    if vendor in ("nvidia", "amd"):
        cuda = torch.backends.cuda
        flags = {"flash": cuda.flash_sdp_enabled(), "mem_efficient": cuda.mem_efficient_sdp_enabled(),
                 "math": cuda.math_sdp_enabled(),
                 "cudnn": vendor == "nvidia" and getattr(cuda, "cudnn_sdp_enabled", lambda: False)()}
        if not getattr(cuda, "is_flash_attention_available", lambda: True)():
            flags["flash"] = False
        kernels = tuple(k for k, on in flags.items() if on)
    else:
        cpu_flash = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
        kernels = ("flash_cpu", "math") if cpu_flash else ("math",)
    if vendor == "nvidia":
        fa2_ok = fa2 and cc is not None and cc >= (8, 0)
    elif vendor == "amd":
        fa2_ok = fa2 and (arch is None or arch.startswith(FA2_AMD_ARCHS))
    else:
        fa2_ok = False
    fa3_ok = fa3 and vendor == "nvidia" and cc == (9, 0)  # Hopper-only; never on ROCm
    return AttentionInfo("sdpa", kernels, fa2, fa2_ok, fa3, fa3_ok)


def _other_accelerator() -> str | None:
    """Name of a non-CUDA accelerator backend that torch reports available (xpu, mps, ...), else None."""
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return None


def has_module(name: str) -> bool:
    """Whether `name` is installed here (flash_attn, triton, ...), without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def device_memory(device: torch.device) -> int:
    """Total memory of `device` in bytes: the GPU's own, or the host's RAM for the CPU (0 when unknown)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    return _host_memory()


# --- measurement -----------------------------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so phase timers measure work, not launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory since the last reset; on CPU the process's peak resident set (it cannot be
    reset, so per-phase CPU figures are the running maximum)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure_gemm_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024,
                       runs: int = 3, best: bool = False) -> float:
    """Median (or with `best`, the fastest) FLOP/s of `runs` n x n matmuls (after one warm-up) on `device`."""
    device = torch.device(device)
    g = torch.Generator(device).manual_seed(0)  # (not the global stream: a run seeded before this is measured, once
    a = torch.randn(n, n, generator=g, device=device, dtype=dtype)  # per process, must draw as one after it)
    b = torch.randn(n, n, generator=g, device=device, dtype=dtype)
    a @ b
    synchronize(device)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / max(min(times) if best else statistics.median(times), 1e-9)


def measure_cpu_flops() -> float:
    """The CPU MFU denominator: the best of 5 fp32 GEMMs (1024^3, about 0.2-0.3 s). The best, not the median:
    a peak must not sink when a busy machine slows one run, or utilisation would read above 100%."""
    return measure_gemm_flops("cpu", torch.float32, 1024, 5, best=True)


def mfu(flops_per_second: float, info: PlatformInfo | None = None) -> float | None:
    """Model FLOPs utilisation of one device; None (never 0) when its peak is unknown."""
    peak = (info or detect()).peak_flops
    return flops_per_second / peak if peak else None
