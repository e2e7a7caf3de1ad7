"""The one place that decides device, dtype, threads, the distributed backend and what the hardware can do.

Everything else receives a `torch.device`/`torch.dtype` (or a `PlatformInfo`) from here; no other module checks
vendor or device names. ROCm builds of torch expose AMD GPUs through the same `torch.cuda` API, so "cuda" below
covers NVIDIA and AMD alike; the vendor is told apart by `torch.version.hip`.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import inspect
import os
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from twinplane.errors import InputError
from twinplane.platform import devices as device_specs

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


def rollout_dtype(model, device: torch.device | str) -> torch.dtype:
    """The rollout engine's dtype for a config's `model` section: `model.rollout_dtype` when set; else bf16 on GPUs
    when the weights are fp32 (decoding is bound by memory traffic, and bf16 halves it; the trainer then recomputes
    the old log-probs itself, since the engine's differ from its own); else the weights' dtype."""
    if model.rollout_dtype:
        return resolve_dtype(model.rollout_dtype)
    dtype = resolve_dtype(model.dtype)
    return torch.bfloat16 if torch.device(device).type == "cuda" and dtype == torch.float32 else dtype


def worker_device(name: str | None, assigned_gpus: list[int] | None = None) -> torch.device:
    """The device of a Ray worker that was given `assigned_gpus` (Ray's ids). Ray normally restricts each actor's
    visible devices (CUDA_VISIBLE_DEVICES; ROCR/HIP_VISIBLE_DEVICES on AMD) to its own, which torch then calls
    cuda:0; with Ray's RAY_EXPERIMENTAL_NOSET_* set for this vendor every device stays visible and the id is the
    index."""
    dev = resolve_device(name)
    if dev.type != "cuda" or not assigned_gpus:
        return dev
    noset = any(os.environ.get(k) == "1" for k in RAY_NOSET_ENV.get(vendor(), ()))
    dev = torch.device("cuda", int(assigned_gpus[0]) if noset else 0)
    torch.cuda.set_device(dev)
    return dev


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


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so phase timers measure work, not launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def device_memory(device: torch.device) -> int:
    """Total memory of `device` in bytes: the GPU's own, or the host's RAM for the CPU (0 when unknown)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    return _host_memory()


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
        compute = torch.bfloat16 if torch.device(device).type == "cuda" and detect().bf16 else param
    else:
        compute = resolve_dtype(compute_dtype)
    return Precision(param, compute)


def autocast(precision: Precision, device: torch.device):
    """The context a training or scoring forward runs in under `precision` (a no-op when not mixed)."""
    if not precision.mixed:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=precision.compute)


COMPILE_MODES = ("auto", "on", "off")


def compile_layers(device: torch.device | str, requested: str = "auto") -> bool:
    """Whether the training plane runs each decoder layer through `torch.compile` (`train.compile`). "auto": on
    GPUs (NVIDIA and AMD), where inductor fuses each RMSNorm, rope, SiLU-gate and residual into a few Triton
    kernels; off on CPU, where inductor's C++ code for these small shapes does not repay its compile time."""
    if requested not in COMPILE_MODES:
        raise InputError(f"train.compile must be one of {', '.join(COMPILE_MODES)}, got {requested!r}")
    if requested != "auto":
        return requested == "on"
    return torch.device(device).type == "cuda"


CPU_LOGPROB_CHUNK_TOKENS = 512
# Each chunk's LM-head GEMM [chunk, d] x [d, vocab] re-reads the whole head weight and launches its own kernels:
# at a few hundred rows it is bound by memory traffic on a GPU (an H100 needs ~300 flops per byte read), so GPUs
# take larger chunks; the transient grows to chunk x vocab x 14 bytes (4.4 GB at a 152k vocab, in preflight's
# memory model).
GPU_LOGPROB_CHUNK_TOKENS = 2048


def logprob_chunk_tokens(device: torch.device | str, requested: int = 0) -> int:
    """Rows per LM-head chunk in log-probs/entropy (`train.logprob_chunk_tokens`; 0 = chosen for the device)."""
    if requested:
        return requested
    return GPU_LOGPROB_CHUNK_TOKENS if torch.device(device).type == "cuda" else CPU_LOGPROB_CHUNK_TOKENS


def varlen_backend(device: torch.device, compute_dtype: torch.dtype, shared_prefix: bool = False,
                   head_dim: int = 64, window: bool = False, check: VarlenCheck | None = None) -> str:
    """Kernel for packed (varlen) rows, `AttentionMetadata.backend`, on GPUs with a 16-bit compute dtype: flash-attn's
    varlen kernel where it is installed and eligible and no sequence continues a shared prefix (its call here cannot
    express one); else torch's own varlen flash attention (`torch_varlen`, which can) where this torch has it (with a
    sliding window when the model has one) and `check` passes on this device (once per device and dtype); else
    FlexAttention (head dims >= FLEX_MIN_HEAD_DIM; also fp32), else the portable SDPA path (CPU: torch 2.13's
    FlexAttention has no CPU backward)."""
    if torch.device(device).type != "cuda":
        return "sdpa"
    if compute_dtype in (torch.bfloat16, torch.float16):
        if detect().attention.flash_attn_eligible and not shared_prefix:
            return "flash_attn"
        if check is not None and head_dim % 8 == 0 and head_dim <= 256 and torch_varlen_ok(device, compute_dtype,
                                                                                             window, check):
            return "torch_varlen"
    return "flex" if flex_ok(head_dim) else "sdpa"


VarlenCheck = Callable[[torch.device, torch.dtype], bool]
_TORCH_VARLEN: dict[tuple[str, torch.dtype], bool] = {}


def torch_varlen_ok(device: torch.device, dtype: torch.dtype, window: bool, check: VarlenCheck) -> bool:
    """Whether torch's `varlen_attn` may serve packed rows on `device` in `dtype`: this torch has it (a sliding
    window needs its `window_size`, torch > 2.10), and `check` (twinplane.model.attention.torch_varlen_agrees: a
    tiny forward and backward against the portable path) passes, once per (device, dtype); a check that raises or
    disagrees warns once (the kernel may be missing from a ROCm build, or differ on some GPU)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    if window and "window_size" not in inspect.signature(varlen_attn).parameters:
        return False
    return _self_checked(_TORCH_VARLEN, (str(torch.device(device)), dtype),
                         lambda: check(torch.device(device), dtype),
                         f"packed attention: torch's varlen_attn failed its self-check on {device} ({{why}}); the "
                         "trainer uses FlexAttention or the portable path")


def _self_checked(cache: dict, key, check: Callable[[], bool], failed: str) -> bool:
    """`check()`, run once per `key` and remembered in `cache`: whether a fast path agreed with the portable one.
    One that raises (a missing kernel, a failed compile: many exception types) or disagrees warns once, `failed`
    with `{why}` filled in."""
    if key not in cache:
        try:
            ok, why = check(), "it disagreed with the portable path"
        except Exception as e:
            ok, why = False, (str(e).strip().splitlines() or [type(e).__name__])[0]
        if not ok:
            warnings.warn(failed.format(why=why), stacklevel=4)
        cache[key] = ok
    return cache[key]


_GROUPED_MM: dict[tuple[str, torch.dtype, bool], bool] = {}


def grouped_mm_ok(device: torch.device, dtype: torch.dtype, expert_shape: tuple[int, ...], grad: bool) -> bool:
    """Whether the MoE experts may use `torch._grouped_mm` (else the per-expert loop) for this device and dtype.

    Support differs by build and hardware (CUDA sm90+, recent ROCm, CPU forward only in torch 2.13, whose CPU
    backward raises), so instead of a vendor table this runs one tiny forward (and backward when `grad`) per
    (device type, dtype) and remembers whether it worked. `expert_shape` (F, D): the kernel needs every row
    stride to be a multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm") or os.environ.get("TWINPLANE_GROUPED_MM", "1") == "0":
        return False
    size = torch.empty((), dtype=dtype).element_size()
    if any(n * size % 16 for n in expert_shape):
        return False
    key = (device.type, dtype, grad)
    if key not in _GROUPED_MM:
        _GROUPED_MM[key] = _probe_grouped_mm(device, dtype, grad)
    return _GROUPED_MM[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype, grad: bool) -> bool:
    # The first probe often runs inside an activation-checkpointed forward: identity hooks keep what it saves out
    # of that region, whose recompute (the answer cached by then) must save exactly what the forward saved.
    try:
        with torch.enable_grad() if grad else torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(
                lambda t: t, lambda t: t):
            x = torch.ones(24, 16, device=device, dtype=dtype, requires_grad=grad)
            w = torch.ones(2, 32, 16, device=device, dtype=dtype, requires_grad=grad)
            y = torch._grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([8, 24], device=device, dtype=torch.int32))
            if grad:
                y.sum().backward()
            return bool(y.shape == (24, 32) and float(y[0, 0]) == 16.0)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


_PACKED_LINEAR: list[bool] = []  # the probe's answer, once per process


def packed_linear_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether inference-only linears may run through oneDNN with pre-packed weights (twinplane.rollout.packed).

    CPU fp32 only: there oneDNN's blocked-weight GEMM is 1.3-1.9x MKL's `F.linear` at decode batch sizes (8-100
    rows) and 1.1x at 1,500 rows on a 2-vCPU AMD EPYC (Zen 4), and its rows do not depend on how many rows
    share the call (MKL's do below ~16 rows). GPUs have cuBLAS/hipBLASLt behind `F.linear`. A tiny probe
    checks that this torch build has the ops; TWINPLANE_PACKED_LINEAR=0 turns it off."""
    if torch.device(device).type != "cpu" or dtype != torch.float32 or \
            os.environ.get("TWINPLANE_PACKED_LINEAR", "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    if not _PACKED_LINEAR:
        try:
            w = torch.ones(8, 4, dtype=dtype)
            y = torch.ops.mkldnn._linear_pointwise(torch.ones(3, 4, dtype=dtype),
                                                   torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
            _PACKED_LINEAR.append(bool(y.shape == (3, 8) and float(y[0, 0]) == 4.0))
        except (AttributeError, RuntimeError, NotImplementedError, TypeError):
            _PACKED_LINEAR.append(False)
    return _PACKED_LINEAR[0]


# --- hardware description ----------------------------------------------------------------------------------------

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


_INFO: PlatformInfo | None = None


def detect() -> PlatformInfo:
    """Describe this machine. Cached: the first call costs a short CPU GEMM on CPU hosts; `reset()` forgets it."""
    global _INFO
    if _INFO is None:
        _INFO = _detect()
    return _INFO


def reset() -> None:
    """Forget the cached `detect()` result and self-checks (tests that simulate other hardware)."""
    global _INFO
    _INFO = None
    _FLEX_PAGED.clear()
    _TRITON_OK.clear()
    _TORCH_VARLEN.clear()


def _other_accelerator() -> str | None:
    """Name of a non-CUDA accelerator backend that torch reports available (xpu, mps, ...), else None."""
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _attention(vendor: str, cc: tuple[int, int] | None, arch: str | None) -> AttentionInfo:
    fa2, fa3 = _has_module("flash_attn"), _has_module("flash_attn_interface")
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
        spec = device_specs.lookup(names[0])
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


def visible_devices_env(devices: list[int], info: PlatformInfo | None = None) -> dict[str, str]:
    """Env to set for a worker process that should see `devices` (indices as this process numbers them).

    On AMD only HIP_VISIBLE_DEVICES is set: it indexes the devices left by an inherited ROCR_VISIBLE_DEVICES, so
    setting both to the same list would filter twice. The Ray NOSET variables are included so that Ray keeps them."""
    info = info or detect()
    if not info.visible_devices_env:
        return {}
    env = {info.visible_devices_env[0]: ",".join(str(int(d)) for d in devices)}
    env.update({k: "1" for k in info.ray_noset_env})
    return env


def measure_gemm_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024,
                       runs: int = 3, best: bool = False) -> float:
    """Median (or with `best`, the fastest) FLOP/s of `runs` n x n matmuls (after one warm-up) on `device`."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
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


# --- rollout engine: paged attention backend, KV budget, graphs ----------------------------------------------------

CPU_KV_CACHE_BYTES = 1 << 30  # the automatic KV budget on CPU hosts: 1 GiB (capped by what a generate call needs)
FLASH_PAGE_SIZE = 256  # flash-attn's paged KV needs page_block_size % 256 == 0
# FlexAttention's BlockMask over the pool has the pool's block as its KV block, and torch 2.13's Triton flex
# kernels need that to be a multiple of their KV tile (BLOCK_N): 64 in flex_decoding, up to 128 in the main kernel
# (by GPU, dtype and head dim), which raises otherwise. 128 fits both.
FLEX_PAGE_SIZE = 128
# The Triton decode kernel looks up each token's block, so any block size serves; small blocks waste less of the
# pool on partly filled last blocks and copy less when a prompt's samples fork.
TRITON_PAGE_SIZE = 16
PAGED_BLOCK_SIZES = {"sdpa": 16, "flex": FLEX_PAGE_SIZE, "flash": FLASH_PAGE_SIZE, "triton": TRITON_PAGE_SIZE}
_FLEX_PAGED: dict[tuple[str, torch.dtype], bool] = {}  # the flex self-check's answer per (device, dtype)
FlexCheck = Callable[[torch.device, torch.dtype, int], bool]  # (device, dtype, block size) -> flex agrees


def paged_attention_backend(device: torch.device, dtype: torch.dtype = torch.float32, head_dim: int = 64,
                            kernels: str = "torch", *, flex_check: FlexCheck) -> tuple[str, int]:
    """(backend, block size) for the rollout engine's paged KV cache (twinplane.rollout.paged_attention):
    flash-attn's paged varlen kernel where it is installed and eligible (CUDA sm80+, ROCm MI200/MI300/MI350) and
    the engine runs in 16 bits;
    else, with the Triton kernels (`kernels`, from `rollout_kernels`), their paged decode kernel reading the pool
    in place for the decodes;
    else on GPUs FlexAttention reading the pool in place for the decodes, once `flex_check` (the engine's
    self-check, `flex_decode_agrees`) passed here (`flex_paged_ok`); else the portable gather + SDPA with 16-token
    blocks (small blocks waste less of the pool on partly filled last blocks). TWINPLANE_PAGED_BACKEND=sdpa|flex|
    flash|triton forces one, unchecked (flex on CPU runs torch's eager reference: slow, for debugging; triton on
    CPU needs TRITON_INTERPRET=1)."""
    forced = os.environ.get("TWINPLANE_PAGED_BACKEND")
    if forced:
        if forced not in PAGED_BLOCK_SIZES:
            raise ValueError(f"TWINPLANE_PAGED_BACKEND must be one of {', '.join(PAGED_BLOCK_SIZES)}, got {forced!r}")
        return forced, PAGED_BLOCK_SIZES[forced]
    device = torch.device(device)
    if device.type == "cuda" and detect().attention.flash_attn_eligible and dtype in (torch.bfloat16, torch.float16):
        return "flash", FLASH_PAGE_SIZE  # (flash-attn runs 16-bit only)
    if kernels == "triton":
        return "triton", TRITON_PAGE_SIZE
    if device.type == "cuda" and flex_ok(head_dim) and flex_paged_ok(device, dtype, flex_check):
        return "flex", FLEX_PAGE_SIZE
    return "sdpa", 16


KERNELS = ("auto", "triton", "torch")
# the Triton self-checks per (kernel set, device, dtype): why one failed (None: it passed)
_TRITON_OK: dict[tuple[str, str, torch.dtype], str | None] = {}


KernelCheck = Callable[[torch.device, torch.dtype], "str | None"]  # (device, dtype) -> why the kernels disagree


def rollout_kernels(device: torch.device, dtype: torch.dtype = torch.float32, requested: str = "auto", *,
                    check: KernelCheck) -> tuple[str, str]:
    """(kernels, why) of the rollout engine's decode path, `rollout.kernels` (twinplane.rollout.kernels): "auto"
    takes the Triton kernels on GPUs (NVIDIA and AMD alike: Triton ships in torch's CUDA and ROCm wheels) where
    Triton imports and `check` (the kernels' self-check, `twinplane.rollout.kernels.self_check`) passes once per
    (device, dtype) (`triton_kernels_ok`), and torch everywhere else:
    the CPU path is the model's own code. "triton" takes them unchecked; it needs a GPU, or TRITON_INTERPRET=1 on
    CPU (Triton's interpreter: exact but slow, for tests); an InputError names what is missing."""
    if requested not in KERNELS:
        raise InputError(f"rollout.kernels must be one of {', '.join(KERNELS)}, got {requested!r}")
    device = torch.device(device)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if requested == "torch":
        return "torch", "rollout.kernels=torch"
    if requested == "triton":
        if not _has_module("triton"):
            raise InputError("rollout.kernels=triton: the triton package is not installed (pip install triton)")
        if device.type != "cuda" and not interpreted:
            raise InputError(f"rollout.kernels=triton: the engine runs on {device}, and Triton kernels need a GPU "
                             "(or TRITON_INTERPRET=1, Triton's slow CPU interpreter)")
        return "triton", "rollout.kernels=triton" + (" (TRITON_INTERPRET=1: interpreted)" if interpreted else "")
    if device.type != "cuda":
        return "torch", f"auto: the engine runs on {device.type}, where the torch path is the fast one"
    if not _has_module("triton"):
        return "torch", "auto: the triton package is not installed"
    why = triton_kernels_ok(device, dtype, check)
    if why is not None:
        return "torch", f"auto: the Triton kernels failed their self-check ({why})"
    return "triton", f"auto: Triton passed its self-check on {detect().device_name} ({str(dtype)[6:]})"


def triton_kernels_ok(device: torch.device, dtype: torch.dtype, check: KernelCheck,
                      what: str = "rollout") -> str | None:
    """None when the Triton kernels `what` ("rollout": the engine's; "logprob": the training plane's log-softmax)
    agree with their torch references on `device` in `dtype` (`check`, once per pair), else why not (with one
    warning: the torch path runs instead)."""
    key = (what, str(device), dtype)
    if key not in _TRITON_OK:
        try:
            why = check(device, dtype)
        except Exception as e:  # a failed compile raises many types (triton's, RuntimeError, ...)
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if why is not None:
            warnings.warn(f"{what} kernels: the Triton kernels failed their self-check on {device} ({why}); the "
                          "torch path runs instead", stacklevel=3)
        _TRITON_OK[key] = why
    return _TRITON_OK[key]


def logprob_kernels(device: torch.device, dtype: torch.dtype, *, check: KernelCheck) -> str:
    """What follows the LM head's GEMM in the training plane's log-probs (twinplane.train.chunked_logprobs):
    "triton" (twinplane.train.logprob_kernels: one kernel each way over the logits in their own dtype) on GPUs
    where Triton imports and `check` (the kernels' self-check) passes for (device, dtype), else "torch" (fp32
    passes; the CPU path: Triton runs there only in its interpreter, for tests)."""
    device = torch.device(device)
    if device.type != "cuda" or dtype == torch.float64 or not _has_module("triton"):
        return "torch"
    return "torch" if triton_kernels_ok(device, dtype, check, "logprob") else "triton"


def has_flex_attention() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


# Inductor's GPU flex kernels refuse smaller head dims ("NYI: embedding dimension of the query, key, and value must
# be at least 16", seen with torch 2.11 on an H200); real models have 64-256, tests' tiny ones may have less.
FLEX_MIN_HEAD_DIM = 16


def flex_ok(head_dim: int) -> bool:
    """Whether compiled FlexAttention can serve this head dim (and exists in this torch)."""
    return head_dim >= FLEX_MIN_HEAD_DIM and has_flex_attention()


def flex_paged_ok(device: torch.device, dtype: torch.dtype, check: FlexCheck) -> bool:
    """Whether the "flex" paged backend may serve on `device`: once per (device, dtype), `check` runs a tiny paged
    decode through flex and through the portable path (twinplane.rollout.paged_attention.flex_decode_agrees). Flex's
    kernels are generated and compiled for each GPU, and this path is not tested on every one; if the check
    raises or the two disagree, one warning, and the engine uses the portable path."""
    return _self_checked(_FLEX_PAGED, (str(device), dtype), lambda: check(device, dtype, FLEX_PAGE_SIZE),
                         f"paged attention: FlexAttention failed its self-check on {device} ({{why}}); the rollout "
                         "engine uses the portable gather + SDPA path")


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


def decode_graph_backend(device: torch.device, requested: bool = True) -> str:
    """How the rollout engine runs its decode-only steps (`rollout.graphs`): "cuda_graph" on CUDA and ROCm builds
    (HIP graphs behind the same `torch.cuda.CUDAGraph` API) when requested, captured per batch-size bucket and
    replayed; "eager" elsewhere (CPU, other accelerators) or when turned off."""
    if requested and torch.device(device).type == "cuda" and torch.cuda.is_available() \
            and hasattr(torch.cuda, "CUDAGraph"):
        return "cuda_graph"
    return "eager"
