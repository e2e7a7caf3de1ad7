"""The machine: versions, what the platform chose, copy bandwidth and one tiny kernel's cost."""

from __future__ import annotations

import contextlib
import platform as host

import torch

from twinplane.platform import backends, hardware, runtime

from .shapes import SHAPES


def env(device: torch.device, dtype: torch.dtype) -> dict:
    info = hardware.detect()
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
           "python": host.python_version(), "device": info.device_name, "device_count": info.device_count,
           "compute_capability": info.compute_capability, "arch": info.arch, "peak_flops": info.peak_flops,
           "peak_source": info.peak_source, "dist_backend": info.dist_backend}
    with contextlib.suppress(ImportError):
        import triton

        out["triton"] = triton.__version__
    with contextlib.suppress(ImportError):
        import transformers

        out["transformers"] = transformers.__version__
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out |= {"sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1),
                "cudnn": torch.backends.cudnn.version()}
    from twinplane.rollout.kernels import self_check
    from twinplane.rollout.paged_attention import flex_decode_agrees

    kernels, why = backends.rollout_kernels(device, dtype, check=self_check)
    backend, block = backends.paged_attention_backend(device, dtype, SHAPES["qwen2.5-0.5b"]["head_dim"], kernels,
                                                      flex_check=flex_decode_agrees)
    from twinplane.train.chunked_logprobs import kernel_self_check

    prec = runtime.train_precision(device, torch.float32)
    return out | {"rollout_kernels": kernels, "rollout_kernels_why": why, "paged_attention_backend": backend,
                  "kv_block_size": block,
                  "decode_graph_backend": backends.decode_graph_backend(device),
                  "train_precision": {"param": str(prec.param), "compute": str(prec.compute)},
                  "train_compile_auto": backends.compile_layers(device),
                  "logprob_kernels": backends.logprob_kernels(device, prec.compute, check=kernel_self_check),
                  "attention": {k: str(v) for k, v in vars(info.attention).items()}}


def copy_section(device: torch.device) -> dict:
    from engine_vs_hf import copy_bandwidth, kernel_cost

    out = {"copy_bandwidth_bytes_per_s": copy_bandwidth(device)}
    if device.type == "cuda":
        out["tiny_kernel"] = kernel_cost(device)
    return out
