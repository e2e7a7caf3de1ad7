"""`twinplane doctor`: what this machine is and what it can do, on one screen (or as JSON with --json).
`twinplane doctor --template MODEL_DIR`: whether a model's chat template is append-only for agent serving.
`twinplane doctor --model MODEL_DIR [--impl auto|native|hf]`: which implementation the folder gets and why.

Everything hardware-specific comes from `twinplane.platform`; this module only measures and formats.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform as host
import statistics
import sys
import time

import torch

import twinplane
from twinplane.errors import InputError, first_line
from twinplane.model.attention import torch_varlen_agrees
from twinplane.model.memory import Dtypes
from twinplane.platform import backends, hardware, runtime
from twinplane.rollout.kernels import self_check as rollout_kernel_check
from twinplane.rollout.paged_attention import flex_decode_agrees
from twinplane.sandbox import SandboxUnavailable, get_sandbox
from twinplane.serving.template_check import check_template
from twinplane.serving.templates import ChatTemplate
from twinplane.tokenizer import load_tokenizer
from twinplane.tools.plan import CPU
from twinplane.train.chunked_logprobs import kernel_self_check as logprob_kernel_check


def measure_bandwidth(device: torch.device, mbytes: int = 64, runs: int = 5) -> float:
    """Median GB/s of copying an `mbytes` MB tensor (one read + one write per byte)."""
    src = torch.empty(mbytes * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    hardware.synchronize(device)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        dst.copy_(src)
        hardware.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() / max(statistics.median(times), 1e-9) / 1e9


def _collective_version(info: hardware.PlatformInfo) -> str | None:
    if info.device_type != "cuda":
        return None
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def sandbox_report() -> dict:
    """Which sandbox backend can run model-written code here (the python tool, the code reward)."""
    try:
        get_sandbox("bwrap")
        return {"backend": "bwrap", "isolated": True, "detail": "bwrap works (user, pid and network namespaces)"}
    except SandboxUnavailable as e:
        return {"backend": None, "isolated": False, "detail": str(e)}


def training_report(info: hardware.PlatformInfo) -> dict:
    """What the training plane picks here with its "auto" settings (`train.compile`, `train.logprob_chunk_tokens`,
    the log-softmax after the LM head: on a GPU this runs its Triton self-check; packed attention with shared
    prompts at head dim 128: on a GPU this may run torch's varlen_attn self-check)."""
    device = info.device_type
    compute = runtime.train_precision(torch.device(device), torch.float32).compute
    return {"compile": backends.compile_layers(device), "logprob_chunk_tokens": backends.logprob_chunk_tokens(device),
            "logprob_kernels": backends.logprob_kernels(torch.device(device), compute, check=logprob_kernel_check),
            "packed_attention": backends.varlen_backend(torch.device(device), compute, True, 128,
                                                        check=torch_varlen_agrees)}


def checkpoint_report(info: hardware.PlatformInfo) -> dict:
    """A checkpoint's size per parameter with this device's dtypes (trainable weights as stored + AdamW moments)
    and, sharded over one training rank per device here, per rank."""
    dt = Dtypes() if info.device_type == "cuda" else Dtypes.for_device(CPU)
    per_param = (dt.master or dt.param) + dt.moments
    ranks = max(1, info.device_count) if info.device_type == "cuda" else 1
    return {"bytes_per_param": per_param, "ranks": ranks, "gb_per_billion_params_per_rank": per_param / ranks}


def rollout_report(info: hardware.PlatformInfo) -> dict:
    """What the rollout engine would run here, and why: its kernels (`rollout.kernels=auto`; on a GPU this runs
    the Triton self-check), the paged attention backend and block size, and how decode steps run."""
    device = info.device
    dtype = torch.bfloat16 if device.type == "cuda" and info.bf16 else torch.float32
    kernels, kernels_why = backends.rollout_kernels(device, dtype, check=rollout_kernel_check)
    backend, block = backends.paged_attention_backend(device, dtype, 64, kernels, flex_check=flex_decode_agrees)
    forced = os.environ.get("TWINPLANE_PAGED_BACKEND")
    prefill = "; prefill chunks: gather + SDPA"
    why = f"TWINPLANE_PAGED_BACKEND={forced}" if forced else {
        "flash": "flash-attn is installed and eligible here",
        "triton": "the Triton paged decode kernel reads the pool in place" + prefill,
        "flex": "FlexAttention passed its self-check here" + prefill,
        "sdpa": "the portable gather + SDPA" + (": no fused path passed its check" if device.type == "cuda" else
                                               f": the engine runs on {device.type}")}[backend]
    graphs = backends.decode_graph_backend(device)
    graphs_why = ("decode steps captured per batch bucket and replayed (HIP graphs on ROCm)" if graphs != "eager"
                  else f"decode steps run eagerly on {device.type}")
    return {"dtype": str(dtype)[6:], "kernels": kernels, "kernels_why": kernels_why, "paged_attention": backend,
            "kv_block_size": block, "paged_attention_why": why, "graphs": graphs, "graphs_why": graphs_why}


def report() -> dict:
    info = hardware.detect()
    gpu = info.device_type == "cuda"
    if gpu:
        gemm_dtype, gemm = "bfloat16", hardware.measure_gemm_flops(info.device, torch.bfloat16, 8192, 10)
        bandwidth = measure_bandwidth(info.device, 1024, 10)
    else:
        gemm_dtype, gemm = "float32", hardware.measure_gemm_flops("cpu", torch.float32, 1024, 5)
        bandwidth = measure_bandwidth(info.device)
    peak = info.peak_flops
    if not gpu and peak:  # the CPU peak is the best GEMM seen so far, this run's included: MFU never above 100%
        peak = max(peak, hardware.measure_gemm_flops("cpu", torch.float32, 1024, 5, best=True), gemm)
    build = f"rocm {info.hip_version}" if info.hip_version else f"cuda {info.cuda_version}" if info.cuda_version \
        else "cpu"
    a = info.attention
    return {
        "twinplane": twinplane.__version__,
        "python": host.python_version(),
        "os": f"{host.system()} {host.release()} {host.machine()}",
        "torch": info.torch_version,
        "torch_build": build,
        "vendor": info.vendor,
        "device_type": info.device_type,
        "devices": [{"index": i, "name": n, "memory_gb": round(m / 1e9, 1)}
                    for i, (n, m) in enumerate(zip(info.device_names, info.device_memory, strict=True))],
        "compute_capability": ".".join(map(str, info.compute_capability)) if info.compute_capability else None,
        "arch": info.arch,
        "bf16": info.bf16,
        "dist_backend": info.dist_backend,
        "collectives": ("rccl" if info.vendor == "amd" else "nccl") if gpu else "gloo",
        "collectives_version": _collective_version(info),
        "visible_devices_env": list(info.visible_devices_env),
        "ray_noset_env": list(info.ray_noset_env),
        "ray_installed": importlib.util.find_spec("ray") is not None,
        "attention": {"backend": a.backend, "sdpa_kernels": list(a.sdpa_kernels),
                      "flash_attn_installed": a.flash_attn_installed, "flash_attn_eligible": a.flash_attn_eligible,
                      "fa3_installed": a.fa3_installed, "fa3_eligible": a.fa3_eligible},
        "peak_tflops": peak / 1e12 if peak else None,
        "peak_source": info.peak_source if gpu or not peak else "measured:best-of-10-fp32-gemm",
        "gemm_dtype": gemm_dtype,
        "gemm_tflops": gemm / 1e12,
        "gemm_mfu": gemm / peak if peak else None,
        "summary": _plain_words(info, gpu),
        "copy_bandwidth_gb_s": bandwidth,
        "rollout": rollout_report(info),
        "training": training_report(info),
        "checkpoint": checkpoint_report(info),
        "sandbox": sandbox_report(),
    }


def _plain_words(info: hardware.PlatformInfo, gpu: bool) -> str:
    """One sentence a person can act on."""
    if gpu:
        kind = "AMD (ROCm)" if info.vendor == "amd" else "NVIDIA (CUDA)"
        return (f"{info.device_count} {kind} GPU(s), {info.device_name}: training and rollout run there"
                f"{', in bf16' if info.bf16 else ''}")
    cores = torch.get_num_threads()
    return (f"no GPU visible to torch: everything runs on the CPU ({cores} threads, fp32), fine for the demo and "
            "tests, far too slow for real models")


def _flops(tflops: float) -> str:
    return f"{tflops:.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.1f} GFLOP/s"


def format_report(d: dict) -> str:
    def yn(x):
        return "yes" if x else "no"

    a, r, t, c = d["attention"], d["rollout"], d["training"], d["checkpoint"]
    devs = [f"  [{x['index']}] {x['name']}  {x['memory_gb']:.1f} GB" for x in d["devices"]]
    peak = f"{_flops(d['peak_tflops'])} ({d['peak_source']})" if d["peak_tflops"] else "unknown (MFU null)"
    mfu = f"{d['gemm_mfu']:.0%}" if d["gemm_mfu"] is not None else "n/a"
    select, noset = ", ".join(d["visible_devices_env"]), ", ".join(f"{v}=1" for v in d["ray_noset_env"])
    env = (f"{select} select each worker's devices" + (f" ({noset} keeps Ray from overwriting them)" if noset else "")
           if select else "no device-selection variables: no GPU, so workers are not pinned to devices")
    coll = d["collectives"] + (f" {d['collectives_version']}" if d["collectives_version"] else "")
    fa = (f"flash_attn installed={yn(a['flash_attn_installed'])} eligible={yn(a['flash_attn_eligible'])}, "
          f"FA3 installed={yn(a['fa3_installed'])} eligible={yn(a['fa3_eligible'])} (not used)")
    lines = [
        f"in short  {d['summary']}",
        f"twinplane {d['twinplane']}  python {d['python']}  {d['os']}",
        f"torch     {d['torch']} ({d['torch_build']})",
        f"vendor    {d['vendor']}  device type {d['device_type']}  bf16 {yn(d['bf16'])}"
        + (f"  sm {d['compute_capability']}" if d["compute_capability"] else "")
        + (f"  arch {d['arch']}" if d["arch"] else ""),
        "devices",
        *devs,
        f"dist      backend {d['dist_backend']} ({coll})  ray installed {yn(d['ray_installed'])}",
        f"env       {env}",
        f"attention {a['backend']} -> {', '.join(a['sdpa_kernels'])}",
        f"          {fa}",
        f"peak      {peak}",
        f"measured  {d['gemm_dtype']} GEMM {_flops(d['gemm_tflops'])} (MFU {mfu}),"
        f" copy {d['copy_bandwidth_gb_s']:.1f} GB/s",
        f"rollout   {r['dtype']}: kernels {r['kernels']} ({r['kernels_why']})",
        f"          paged attention {r['paged_attention']}, {r['kv_block_size']}-token blocks "
        f"({r['paged_attention_why']})",
        f"          decode {r['graphs']} ({r['graphs_why']})",
        f"training  decoder layers {'compiled' if t['compile'] else 'eager'} (train.compile=auto), log-prob chunks of "
        f"{t['logprob_chunk_tokens']} tokens (train.logprob_chunk_tokens=0) through {t['logprob_kernels']} kernels",
        f"          packed attention {t['packed_attention']} (sequences sharing their prompt)",
        f"checkpoint {c['bytes_per_param']} bytes/param (weights + AdamW moments): "
        f"{c['gb_per_billion_params_per_rank']:.1f} GB per 1B params per rank, sharded over {c['ranks']} training "
        f"rank(s) here (checkpoint.format=sharded writes 1/N from each of N ranks)",
        f"sandbox   {d['sandbox']['backend'] or 'NONE (python tool and code reward need sandbox=unsafe-local)'}: "
        f"{d['sandbox']['detail']}",
    ]
    return "\n".join(lines)


def template_report(model_dir: str, as_json: bool) -> int:
    """`doctor --template DIR`: the append-only check of the folder's chat template, with its tokenizer."""
    template = ChatTemplate.from_model_dir(model_dir)
    try:
        tokenizer = load_tokenizer(model_dir)
    except FileNotFoundError as e:
        raise InputError(first_line(e)) from None
    except Exception as e:  # (tokenizers raises a bare Exception for a damaged tokenizer.json)
        raise InputError(f"{model_dir}: tokenizer.json does not load ({first_line(e)})") from None
    checked = check_template(template, tokenizer)
    print(json.dumps(checked.to_dict(), indent=2) if as_json else checked.format())
    return 0 if checked.ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="twinplane doctor", description="Describe this machine's torch, devices and "
                                 "kernels, and measure its GEMM throughput and memory bandwidth.")
    ap.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    ap.add_argument("--template", metavar="MODEL_DIR", help="instead: check that the folder's chat template is "
                    "append-only over a tool conversation (exit 0), or show where it is not (exit 1)")
    ap.add_argument("--model", metavar="MODEL_DIR", help="instead: which implementation (model.impl) the folder "
                    "gets and why, one fact per line")
    ap.add_argument("--impl", default="auto", choices=("auto", "native", "hf"), help="with --model: as model.impl")
    args = ap.parse_args(argv)
    if args.model is not None:
        from twinplane.model.impl import describe  # (transformers' import: only for this report)

        lines = describe(args.model, args.impl)
        print(json.dumps(lines, indent=2) if args.json else "\n".join(lines))
        return 0
    if args.template is not None:
        return template_report(args.template, args.json)
    d = report()
    print(json.dumps(d, indent=2) if args.json else format_report(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
