"""Which backend or kernel serves each hot path on this machine: compiled decoder layers, log-prob chunks and their
kernels, packed (varlen) training attention, MoE grouped GEMMs, prepacked CPU linears, the rollout engine's paged
attention, Triton kernels and decode graphs.

A fast path that may be missing or wrong on some build or GPU is self-checked against the portable one once per
device and dtype; the answers are cached here and forgotten with `hardware.reset()`.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import warnings
from collections.abc import Callable

import torch

from twinplane.errors import InputError, first_line
from twinplane.platform import hardware

# --- the training plane ----------------------------------------------------------------------------------------------

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


def logprob_kernels(device: torch.device, dtype: torch.dtype, *, check: KernelCheck) -> str:
    """What follows the LM head's GEMM in the training plane's log-probs (twinplane.train.chunked_logprobs):
    "triton" (twinplane.train.logprob_kernels: one kernel each way over the logits in their own dtype) on GPUs
    where Triton imports and `check` (the kernels' self-check) passes for (device, dtype), else "torch" (fp32
    passes; the CPU path: Triton runs there only in its interpreter, for tests)."""
    device = torch.device(device)
    if device.type != "cuda" or dtype == torch.float64 or not hardware.has_module("triton"):
        return "torch"
    return "torch" if triton_kernels_ok(device, dtype, check, "logprob") else "triton"


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
        if hardware.detect().attention.flash_attn_eligible and not shared_prefix:
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


# --- either plane ----------------------------------------------------------------------------------------------------

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


def has_flex_attention() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


# Inductor's GPU flex kernels refuse smaller head dims ("NYI: embedding dimension of the query, key, and value must
# be at least 16", seen with torch 2.11 on an H200); real models have 64-256, tests' tiny ones may have less.
FLEX_MIN_HEAD_DIM = 16


def flex_ok(head_dim: int) -> bool:
    """Whether compiled FlexAttention can serve this head dim (and exists in this torch)."""
    return head_dim >= FLEX_MIN_HEAD_DIM and has_flex_attention()


KernelCheck = Callable[[torch.device, torch.dtype], "str | None"]  # (device, dtype) -> why the kernels disagree
# the Triton self-checks per (kernel set, device, dtype): why one failed (None: it passed)
_TRITON_OK: dict[tuple[str, str, torch.dtype], str | None] = {}


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
            why = first_line(e)
        if why is not None:
            warnings.warn(f"{what} kernels: the Triton kernels failed their self-check on {device} ({why}); the "
                          "torch path runs instead", stacklevel=3)
        _TRITON_OK[key] = why
    return _TRITON_OK[key]


def _self_checked(cache: dict, key, check: Callable[[], bool], failed: str) -> bool:
    """`check()`, run once per `key` and remembered in `cache`: whether a fast path agreed with the portable one.
    One that raises (a missing kernel, a failed compile: many exception types) or disagrees warns once, `failed`
    with `{why}` filled in."""
    if key not in cache:
        try:
            ok, why = check(), "it disagreed with the portable path"
        except Exception as e:
            ok, why = False, first_line(e)
        if not ok:
            warnings.warn(failed.format(why=why), stacklevel=4)
        cache[key] = ok
    return cache[key]


# --- the rollout engine ----------------------------------------------------------------------------------------------

_PACKED_LINEAR: list[bool] = []  # the probe's answer, once per process


def prepacked_linear_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether inference-only linears may run through oneDNN with prepacked weights (twinplane.rollout.prepacked).

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
                            kernels: str = "torch", *, flex_check: FlexCheck, latent: bool = False) -> tuple[str, int]:
    """(backend, block size) for the rollout engine's paged KV cache (twinplane.rollout.paged_attention):
    flash-attn's paged varlen kernel where it is installed and eligible (CUDA sm80+, ROCm MI200/MI300/MI350) and
    the engine runs in 16 bits;
    else, with the Triton kernels (`kernels`, from `rollout_kernels`), their paged decode kernel reading the pool
    in place for the decodes;
    else on GPUs FlexAttention reading the pool in place for the decodes, once `flex_check` (the engine's
    self-check, `flex_decode_agrees`) passed here (`flex_paged_ok`); else the portable gather + SDPA with 16-token
    blocks (small blocks waste less of the pool on partly filled last blocks). TWINPLANE_PAGED_BACKEND=sdpa|flex|
    flash|triton forces one, unchecked (flex on CPU runs torch's eager reference: slow, for debugging; triton on
    CPU needs TRITON_INTERPRET=1). `latent`: a pool of latent attention's compressed KV (twinplane.model.mla: one
    KV head as wide as the latent plus the rope key, beyond the fused kernels' head sizes): the portable path."""
    if latent:
        return "sdpa", 16
    forced = os.environ.get("TWINPLANE_PAGED_BACKEND")
    if forced:
        if forced not in PAGED_BLOCK_SIZES:
            raise ValueError(f"TWINPLANE_PAGED_BACKEND must be one of {', '.join(PAGED_BLOCK_SIZES)}, got {forced!r}")
        return forced, PAGED_BLOCK_SIZES[forced]
    device = torch.device(device)
    if device.type == "cuda" and hardware.detect().attention.flash_attn_eligible and \
            dtype in (torch.bfloat16, torch.float16):
        return "flash", FLASH_PAGE_SIZE  # (flash-attn runs 16-bit only)
    if kernels == "triton":
        return "triton", TRITON_PAGE_SIZE
    if device.type == "cuda" and flex_ok(head_dim) and flex_paged_ok(device, dtype, flex_check):
        return "flex", FLEX_PAGE_SIZE
    return "sdpa", 16


def flex_paged_ok(device: torch.device, dtype: torch.dtype, check: FlexCheck) -> bool:
    """Whether the "flex" paged backend may serve on `device`: once per (device, dtype), `check` runs a tiny paged
    decode through flex and through the portable path (twinplane.rollout.paged_attention.flex_decode_agrees). Flex's
    kernels are generated and compiled for each GPU, and this path is not tested on every one; if the check
    raises or the two disagree, one warning, and the engine uses the portable path."""
    return _self_checked(_FLEX_PAGED, (str(device), dtype), lambda: check(device, dtype, FLEX_PAGE_SIZE),
                         f"paged attention: FlexAttention failed its self-check on {device} ({{why}}); the rollout "
                         "engine uses the portable gather + SDPA path")


KERNELS = ("auto", "triton", "torch")


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
        if not hardware.has_module("triton"):
            raise InputError("rollout.kernels=triton: the triton package is not installed (pip install triton)")
        if device.type != "cuda" and not interpreted:
            raise InputError(f"rollout.kernels=triton: the engine runs on {device}, and Triton kernels need a GPU "
                             "(or TRITON_INTERPRET=1, Triton's slow CPU interpreter)")
        return "triton", "rollout.kernels=triton" + (" (TRITON_INTERPRET=1: interpreted)" if interpreted else "")
    if device.type != "cuda":
        return "torch", f"auto: the engine runs on {device.type}, where the torch path is the fast one"
    if not hardware.has_module("triton"):
        return "torch", "auto: the triton package is not installed"
    why = triton_kernels_ok(device, dtype, check)
    if why is not None:
        return "torch", f"auto: the Triton kernels failed their self-check ({why})"
    return "triton", f"auto: Triton passed its self-check on {hardware.detect().device_name} ({str(dtype)[6:]})"


def decode_graph_backend(device: torch.device, requested: bool = True) -> str:
    """How the rollout engine runs its decode-only steps (`rollout.graphs`): "cuda_graph" on CUDA and ROCm builds
    (HIP graphs behind the same `torch.cuda.CUDAGraph` API) when requested, captured per batch-size bucket and
    replayed; "eager" elsewhere (CPU, other accelerators) or when turned off."""
    if requested and torch.device(device).type == "cuda" and torch.cuda.is_available() \
            and hasattr(torch.cuda, "CUDAGraph"):
        return "cuda_graph"
    return "eager"


def _forget_self_checks() -> None:
    _FLEX_PAGED.clear()
    _TRITON_OK.clear()
    _TORCH_VARLEN.clear()


hardware.on_reset(_forget_self_checks)
