"""One prepared probe of the rollout engine and the training plane on a GPU (or, with --smoke, a tiny CPU run).

    python benchmarks/gpu_probe.py OUT_DIR                  # on a GPU: ~8 minutes, stops new sections at --deadline
    python benchmarks/gpu_probe.py OUT_DIR --smoke          # tiny shapes on CPU (the test suite runs this)

Each section is written to OUT_DIR/probe.json as soon as it ends (and its lines to OUT_DIR/probe.log), so a run cut
off by a time limit still reports what it measured; a section that raises records its error and the next one runs.
Sections, in order: what the goals are judged by first (the engine's calls and a full-batch decode step against the
memory roofline, the compiled training step's MFU), then what explains them, and last HF `generate`, whose rate on
this work is known already (a section starts only while the time it needs is left before --deadline):

- env: torch / Triton / CUDA or HIP versions, the device, and what `twinplane.platform` chose (rollout kernels,
  paged attention backend and block size, decode graph mode, training precision, compile, log-prob kernels,
  distributed backend).
- copy: device-to-device copy bandwidth (bytes read + written per second) and one tiny kernel's cost, launched
  eagerly and replayed from a graph: the floor under a step of a thousand small kernels.
- engine: one RL-shaped `generate` (64 prompts x 8 samples, 256-token prompts, up to 1,024 new tokens, 1/256 of
  the vocabulary as stop ids): tokens/s, graph captures, Dynamo frames compiled during the call, and where the
  step time went; later calls of the same shape (the engine's graphs kept), alternately running ahead (the
  default) and reading every step back before launching the next (`run_ahead` off), each with its steps against
  the roofline and the host's time blocked on the device; the engine's own graphs of 256+ rows replayed back to
  back over filled rows (its pool and table width, without its host loop); where a smaller call's host waits for
  the device (call sites, from CUDA's sync debug mode).
- decode: one static decode step (the engine's `DecodeGraphs`: forward, its sampler, row update) per batch size at a
  fixed context, Qwen2.5-0.5B shape in bf16: capture seconds, replay ms, and the memory roofline (every weight and
  every context token's k/v read once, at the measured copy bandwidth); kernels per step from the profiler.
- train_compiled: `Trainer.train_step` on a Qwen2.5-1.5B shape (random weights, fp32 master, bf16 compute) over
  packed micro-batches of an RL-like length mix, decoder layers compiled (`train.compile=on`), in a child process
  cut after --child-limit seconds, with a fresh Inductor cache: tokens/s, MFU against the device's dense bf16
  peak, peak memory, the caching allocator's device allocations, the profiler's per-category time, device-busy
  time and top operators, where a step's host waits for the device, and the CPU over the timed steps (this
  process's CPU seconds per second, the machine's busy fraction, child processes alive: compile workers
  competing with a host-bound launch loop would show); train_compiled_warm: the same in a new
  process that finds the cache filled (a restarted run); train_compiled_warm_no_aot_cache: that with
  AOTAutograd's cache off; train_compiled_warm_no_graph_cache: with Inductor's graph cache off too (graphs compiled
  anew, their Triton binaries found in the cache); train_compiled_triton_launcher and
  train_compiled_warm_triton_launcher: the cold and the warm run with Triton's kernel launcher instead of Inductor's
  static one.
- host: the engine's host work per decode step (reading back, stop checks, scheduling, staging) at batches 64, 256
  and 512 on this machine's CPU (`benchmarks/engine_host.py`), against which running ahead must hide it.
- profile: the profiler's top kernels and per-category device time of one decode step at batch 128, and the
  operators (with their input shapes) that launched them.
- kernels: each Triton kernel against its torch reference at the decode shapes (batches 8, 128 and 512 at the
  decode context; the sampler over the vocabulary): device microseconds per call from a CUDA graph of 20 calls,
  the paged decode's KV read rate and its time per split count and per tile (tokens per tile x warps), the
  sampler's per load width x warps, and one layer's paged attention (pool write included) per backend.
- train_fit: the largest packed micro-batch one step fits, with chunked log-probs and with the whole logits.
- train: the compiled training section's step eager (`train.compile=off`).
- attention: one layer's packed attention at the training shape, forward and forward + backward, per varlen
  backend (portable SDPA, FlexAttention, torch's varlen_attn, flash-attn where installed), over a micro-batch of
  RL-like rows with and without shared prompts: ms and TFLOP/s, and the backend the platform picks.
- sampling: the engine's sampler alone (policy log-probs, inverse-CDF choice, chosen log-prob, one readback) on
  [B, V] logits.
- decode_sdpa, decode_torch, decode_triton: the decode section at every other batch size with the portable paged
  attention and torch kernels, with torch kernels and the platform's attention (flex on GPUs without flash-attn),
  and with the Triton kernels (`rollout.kernels=triton`, twinplane.rollout.kernels) and their paged attention.
- engine_hf: Hugging Face `generate` on the engine section's work and weights, and the engine's rate over it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import math
import os
import platform as host
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # + the checkout

import torch  # noqa: E402

from twinplane.platform import platform  # noqa: E402

# Qwen2.5-0.5B and -1.5B's published shapes; "tiny" for --smoke
SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                         num_heads=14, num_kv_heads=2, head_dim=64, qkv_bias=True, rope_theta=1e6,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, qkv_bias=True, rope_theta=1e6,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "tiny": dict(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, tie_word_embeddings=True,
                 max_position_embeddings=2048),
}
CATEGORIES = (  # kernel name fragments -> category, first match wins
    ("attention", ("flash", "flex", "attention", "attn", "sdpa", "fmha")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul", "_mm_", "splitk", "ampere_", "hopper_")),
    ("norm", ("norm", "rsqrt")),
    ("reduce", ("reduce", "softmax", "logsumexp", "cumsum", "scan", "sort", "topk", "argmax")),
    ("copy", ("copy", "memcpy", "memset", "fill", "index", "gather", "scatter", "cat")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "triton_poi", "pointwise")),
)


class Probe:
    """The report: sections appended to a JSON file and a log as they finish."""

    def __init__(self, out: Path, deadline: float):
        self.out, self.deadline, self.t0 = out, deadline, time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        self.result: dict = {}
        self.log = open(out / "probe.log", "a", buffering=1)

    def say(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.log.write(line + "\n")

    def left(self) -> float:
        return self.deadline - (time.perf_counter() - self.t0)

    def section(self, name: str, fn, *args, need: float = 0.0) -> dict | None:
        """Run `fn(*args) -> dict` as section `name` unless fewer than `need` seconds are left."""
        if self.left() < need:
            self.say(f"{name}: skipped ({self.left():.0f} s left, needs ~{need:.0f})")
            self.result[name] = {"skipped": f"{self.left():.0f} s left of the deadline"}
            self.flush()
            return None
        t = time.perf_counter()
        self.say(f"{name}: start")
        try:
            res = fn(*args)
        except Exception as e:  # a failed section is a result too; the next one runs
            res = {"error": f"{type(e).__name__}: {e}".strip()[:2000], "traceback": traceback.format_exc()[-4000:]}
            self.say(f"{name}: FAILED {res['error'][:300]}")
        res["section_seconds"] = round(time.perf_counter() - t, 2)
        self.result[name] = res
        self.say(f"{name}: {json.dumps(_short(res))[:1500]}")
        self.flush()
        return res

    def partial(self, name: str, res: dict) -> None:
        """What a long section has so far, on record in case it is cut (the section's end replaces it)."""
        self.result[name] = res | {"partial": True}
        self.flush()

    def flush(self) -> None:
        tmp = self.out / "probe.json.tmp"
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.out / "probe.json")


def _short(res: dict) -> dict:
    return {k: v for k, v in res.items() if k not in ("traceback", "table")}


def sync(device) -> None:
    platform.synchronize(torch.device(device))


def timed(fn, device, reps: int, warmup: int = 2) -> list[float]:
    """Seconds per call of `fn`, each call between device syncs."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return out


def sync_sites(fn, device, top: int = 20) -> dict | None:
    """Where `fn` makes the host wait for the device, by torch.cuda's sync debug mode (every synchronizing call, an
    `.item()`, a blocking copy, an explicit sync, warns): call site -> count, the site being the innermost frame
    outside torch and the standard library (a path under the checkout). A host wait while the device has work
    queued leaves it idle until the host's next launches. None off CUDA (no such mode there)."""
    if device.type != "cuda":
        return None
    import collections
    import sysconfig
    import warnings

    skip = (str(Path(torch.__file__).parent), sysconfig.get_paths()["stdlib"])
    root = Path(__file__).resolve().parents[1]
    sites: collections.Counter = collections.Counter()

    def seen(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(skip)]
        f = frames[-1] if frames else None
        where = Path(f.filename) if f else Path(filename)
        with contextlib.suppress(ValueError):
            where = where.relative_to(root)
        sites[f"{where}:{f.lineno if f else lineno} {f.name if f else ''}".strip()] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return {"total": sum(sites.values()), "sites": dict(sites.most_common(top))}


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other")


def kernel_table(prof, gpu: bool, top: int = 20) -> dict:
    """Kernels (device events on GPUs, ops on CPU) of a profile: count, top by time, totals per category; on GPUs
    also how long the device was busy (the union of its kernels' spans) within the span from the first kernel's
    start to the last one's end, and how long the host stood blocked on a full launch queue."""
    events = [e for e in prof.events() if (e.device_type.name == "CUDA") == gpu]
    extra = {}
    if gpu:
        # the profiler also draws annotated ranges (a compiled graph's call) and CUPTI's "Command Buffer Full" (the
        # host blocked on launching) on the device's timeline: neither is device work
        full = [e for e in events if e.name == "Command Buffer Full"]
        events = [e for e in events if not e.is_user_annotation and e.name != "Command Buffer Full"]
        spans = sorted((e.time_range.start, e.time_range.end) for e in events)
        busy, reach = 0.0, -math.inf
        for start, end in spans:  # union of the spans
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        extra = {"busy_us": round(busy, 1), "span_us": round(spans[-1][1] - spans[0][0], 1) if spans else 0.0,
                 "launch_queue_full_us": round(sum(e.time_range.elapsed_us() for e in full), 1)}
        times = [(e.name, e.time_range.elapsed_us()) for e in events]  # (device_time_total is 0 in some torches)
    else:
        times = [(e.name, e.self_cpu_time_total) for e in events if not e.cpu_children]
    by_name: dict[str, list[float]] = {}
    for name, us in times:
        by_name.setdefault(name, []).append(us)
    cats: dict[str, float] = {}
    for name, us in times:
        cats[category(name)] = cats.get(category(name), 0.0) + us
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"kernels": len(times), "total_us": round(sum(us for _, us in times), 1),
            "by_category_us": {k: round(v, 1) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:240], "calls": len(v), "total_us": round(sum(v), 1)} for n, v in ranked]} | extra


# host-side ranges of a training step, by name or (ending in "*") the start of one: Dynamo's guard checks,
# AOTAutograd's forward and backward wrappers, Inductor's graph calls (which launch the kernels), the optimizer
HOST_RANGES = ("TorchDynamo Cache Lookup", "CompiledFunction", "CompiledFunctionBackward", "## Call CompiledFxGraph*",
               "Optimizer.step*")


def host_table(prof) -> dict:
    """Host time (inclusive, microseconds) and calls per range of HOST_RANGES: where the host's time in a step
    goes, to set against the device's busy time."""
    out = {name.rstrip("*"): {"calls": 0, "cpu_us": 0.0} for name in HOST_RANGES}
    for e in prof.events():
        if e.device_type.name != "CPU":
            continue
        name = next((n.rstrip("*") for n in HOST_RANGES
                     if e.name == n or (n.endswith("*") and e.name.startswith(n[:-1]))), None)
        if name:
            out[name]["calls"] += 1
            out[name]["cpu_us"] += e.cpu_time_total
    return {k: v | {"cpu_us": round(v["cpu_us"], 1)} for k, v in out.items()}


def op_table(prof, gpu: bool, top: int = 15) -> list[dict]:
    """The operators that launched the most device time (CPU: took the most time themselves), by input shapes
    (a profile recorded with `record_shapes`): which call a kernel of `kernel_table` comes from. A compiled
    region's kernels count under its graph's call."""
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    ranked = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -getattr(e, key))[:top]
    return [{"op": e.key, "shapes": str(e.input_shapes)[:300], "calls": e.count, "total_us": round(getattr(e, key), 1)}
            for e in ranked]


# --- sections ----------------------------------------------------------------------------------------------------
def env(device: torch.device, dtype: torch.dtype) -> dict:
    info = platform.detect()
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

    kernels, why = platform.rollout_kernels(device, dtype, check=self_check)
    backend, block = platform.paged_attention_backend(device, dtype, SHAPES["qwen2.5-0.5b"]["head_dim"], kernels,
                                                      flex_check=flex_decode_agrees)
    from twinplane.train.chunked_logprobs import kernel_self_check

    prec = platform.train_precision(device, torch.float32)
    return out | {"rollout_kernels": kernels, "rollout_kernels_why": why, "paged_attention_backend": backend,
                  "kv_block_size": block,
                  "decode_graph_backend": platform.decode_graph_backend(device),
                  "train_precision": {"param": str(prec.param), "compute": str(prec.compute)},
                  "train_compile_auto": platform.compile_layers(device),
                  "logprob_kernels": platform.logprob_kernels(device, prec.compute, check=kernel_self_check),
                  "attention": {k: str(v) for k, v in vars(info.attention).items()}}


def copy_section(device: torch.device) -> dict:
    from engine_vs_hf import copy_bandwidth, kernel_cost

    out = {"copy_bandwidth_bytes_per_s": copy_bandwidth(device)}
    if device.type == "cuda":
        out["tiny_kernel"] = kernel_cost(device)
    return out


def decode_setup(a, device, dtype, kernels: str = "auto"):
    """The Qwen2.5-0.5B-shaped model (random bf16 weights) in an engine with `kernels`, and a static decode over a
    KV pool that holds `max(batches)` sequences of `a.context` tokens."""
    from twinplane.model import ModelConfig, Transformer
    from twinplane.rollout import RolloutEngine
    from twinplane.rollout.graphs import DecodeGraphs
    from twinplane.rollout.kv_cache import KVCache

    torch.manual_seed(0)
    cfg = ModelConfig(**SHAPES[a.decode_shape])
    with torch.device(device):
        model = Transformer(cfg).to(dtype)
    engine = RolloutEngine(model, eos_token_id=None, max_num_seqs=max(a.batches), graph_max_batch=max(a.batches),
                           kernels=kernels)
    bs = engine.block_size
    per_seq = -(-a.context // bs)
    kv = KVCache(cfg, max(a.batches) * per_seq + 1, bs, dtype, device)
    mode = "cuda_graph" if engine.graph_backend == "cuda_graph" else "static"
    dg = DecodeGraphs(engine.model, kv, mode, engine.backend, per_seq, max(a.batches), max(a.batches), engine.head,
                      fused=engine.kernels == "triton")  # (the sampler the engine's graphs run)
    return engine, dg


def fill_rows(dg, n: int, context: int, vocab: int) -> None:
    """Staged rows of `n` sequences decoding their token at position context - 1, each over blocks of its own: each
    step starts from them again (the state reset), samples with the uniform 0.5, and advances the rows."""
    from twinplane.rollout.graphs import LIVE, RESET, RETABLE, SRC, STATE, UNIFORM

    per_seq, p = dg.max_blocks, context - 1
    g = torch.Generator().manual_seed(n)
    rows = torch.zeros(n, STATE + 4 + per_seq, dtype=torch.long)
    rows[:, RESET] = rows[:, LIVE] = rows[:, RETABLE] = 1
    rows[:, UNIFORM] = torch.tensor([0.5], dtype=torch.float64).view(torch.long).item()
    rows[:, SRC] = torch.arange(n)
    rows[:, STATE:STATE + 4] = torch.tensor([0, p, 0, context])  # (token below; the slot: from the table)
    rows[:, STATE] = torch.randint(vocab, (n,), generator=g)
    rows[:, STATE + 4:] = torch.arange(n * per_seq).view(n, per_seq)
    dg.staged[:n].copy_(rows)


def engine_graph_steps(a, engine, roof, device, bw: float, smallest: int = 256) -> dict:
    """The engine's own decode steps (its captured graphs of `smallest`+ rows; on CPU its largest static step) replayed
    back to back, without its host loop, over rows filled as the decode section fills them (context `a.context`, blocks
    of their own): ms per step against the roofline. Beside the decode section's steps (a pool and tables sized for
    that context) this tells whether the engine's graphs (its pool, its wider tables) are slower on the device, and
    beside the engine's calls, what its loop adds. The roofline is `roof`'s (the engine's calls'). The next step
    stages every row afresh."""
    dg = engine.decoder
    if dg is None:
        return {}
    keys = sorted(k for k in dg.graphs if k[0] >= min(smallest, dg.buckets[-1])) if dg.mode == "cuda_graph" \
        else [(dg.buckets[-1], dg._sampler[2])]
    context = min(a.context, dg.max_blocks * dg.block_size)  # (tables narrower than the decode section's context)
    out = {"context": context, "max_blocks": dg.max_blocks, "pool_blocks": dg.kv.num_blocks, "buckets": {}}
    for size, key in keys:
        if size * dg.max_blocks > dg.pad_block:  # (each row its own blocks; the reserved one is never handed out)
            out["buckets"][str(size)] = {"error": "the pool holds fewer blocks than the filled rows need"}
            continue
        fill_rows(dg, size, context, engine.model.config.vocab_size)
        run = dg.graphs[size, key][0].replay if dg.mode == "cuda_graph" else (lambda s=size, k=key: dg.run(s, k))
        ms = [1e3 * t for t in timed(run, device, a.reps)]
        ideal = 1e3 * (roof.weight_bytes + size * context * roof.kv_bytes_per_token) / bw
        out["buckets"][str(size)] = {"replay_ms_median": statistics.median(ms), "roofline_ms": ideal,
                                     "x_roofline": statistics.median(ms) / ideal}
    dg._rows = {}  # (the device rows are the filled ones now)
    return out


def decode_section(a, device, dtype, bw: float, kernels: str = "auto") -> dict:
    from torch.profiler import ProfilerActivity, profile

    from twinplane.rollout.graphs import sampling_key
    from twinplane.rollout.sampling import SamplingParams

    engine, dg = decode_setup(a, device, dtype, kernels)
    cfg, gpu = engine.model.config, device.type == "cuda"
    key = sampling_key(SamplingParams(temperature=1.0), frozenset())
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())  # tied: the head once
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    out = {"shape": a.decode_shape, "context": a.context, "kernels": engine.kernels, "backend": engine.backend,
           "mode": dg.mode, "step": "forward + sampler + row update",
           "block_size": dg.block_size, "weight_bytes": weight_bytes, "batches": {}}
    for n in a.batches:
        size = dg.bucket(n)
        t = time.perf_counter()
        if dg.mode == "cuda_graph" and (size, key) not in dg.graphs and not dg._capture(size, key):
            out["batches"][n] = {"error": "capture failed"}
            continue
        capture = time.perf_counter() - t
        fill_rows(dg, size, a.context, cfg.vocab_size)
        run = dg.graphs[size, key][0].replay if dg.mode == "cuda_graph" else (lambda s=size: dg.run(s, key))
        ms = [1e3 * s for s in timed(run, device, a.reps)]
        roof = 1e3 * (weight_bytes + size * a.context * kv_per_token) / bw
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with profile(activities=acts) as prof:  # eager: one launch per kernel, so this counts them
            dg.run(size, key)
            sync(device)
        kernels = kernel_table(prof, gpu, top=0)["kernels"]
        out["batches"][n] = {"bucket": size, "capture_s": round(capture, 3), "replay_ms_median": statistics.median(ms),
                             "replay_ms_min": min(ms), "roofline_ms": roof,
                             "x_roofline": statistics.median(ms) / roof, "kernels_per_step": kernels}
    return out


def decode_other_backend(a, device, dtype, bw: float, backend: str | None, kernels: str) -> dict:
    """The decode section at a few batch sizes with `kernels` and the paged attention backend forced to `backend`
    (None: the platform's choice)."""
    old = os.environ.get("TWINPLANE_PAGED_BACKEND")
    if backend is not None:
        os.environ["TWINPLANE_PAGED_BACKEND"] = backend
    try:
        return decode_section(argparse.Namespace(**(vars(a) | {"batches": a.batches[1::2]})), device, dtype, bw,
                              kernels)
    finally:
        if old is None:
            os.environ.pop("TWINPLANE_PAGED_BACKEND", None)
        else:
            os.environ["TWINPLANE_PAGED_BACKEND"] = old


def profile_section(a, device, dtype) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from twinplane.rollout.graphs import sampling_key
    from twinplane.rollout.sampling import SamplingParams

    engine, dg = decode_setup(a, device, dtype)
    gpu, n = device.type == "cuda", dg.bucket(min(128, max(a.batches)))
    fill_rows(dg, n, a.context, engine.model.config.vocab_size)
    key = sampling_key(SamplingParams(temperature=1.0), frozenset())
    for _ in range(2):
        dg.run(n, key)
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=acts, record_shapes=True) as prof:
        for _ in range(3):
            dg.run(n, key)
        sync(device)
    res = kernel_table(prof, gpu) | {"ops": op_table(prof, gpu)}
    res["steps"], res["batch"] = 3, n
    return res


def sampling_section(a, device, dtype) -> dict:
    from twinplane.rollout.sampling import SamplingParams, policy_logprobs, sample

    vocab, out = SHAPES[a.decode_shape]["vocab_size"], {}
    sp = SamplingParams(temperature=1.0, max_new_tokens=8)
    for n in (b for b in a.batches if b >= 8):
        logits = torch.randn(n, vocab, device=device).to(dtype)
        u = torch.rand(n)

        def step(logits=logits, u=u):
            lp = policy_logprobs(logits, sp.temperature)
            tok = sample(lp, sp, u.to(device), None, None)
            chosen = lp.gather(-1, tok[:, None]).squeeze(-1)
            return tok.tolist(), chosen.tolist()

        out[n] = {"ms_median": 1e3 * statistics.median(timed(step, device, a.reps))}
    return out


def device_us(fn, device, calls: int, reps: int) -> float:
    """Median microseconds per call of `fn`: on GPUs `calls` calls captured in one CUDA graph and replayed (device
    time, launch costs out, as in the engine's captured decode); elsewhere eager calls."""
    fn()
    sync(device)
    if device.type != "cuda":
        return 1e6 * statistics.median(timed(fn, device, reps, warmup=0))
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    us = 1e6 * statistics.median(timed(graph.replay, device, reps)) / calls
    del graph
    return us


def kernels_section(a, device, dtype) -> dict:
    """Each Triton kernel against its torch reference at the decode shapes, per batch size."""
    out = {"shape": a.decode_shape, "context": a.context, "dtype": str(dtype), "block_size": platform.TRITON_PAGE_SIZE,
           "batches": {}}
    for B in a.kernel_batches:
        out["batches"][B] = kernel_batch(a, device, dtype, B)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def kernel_batch(a, device, dtype, B: int) -> dict:
    from twinplane.model import AttentionMetadata
    from twinplane.rollout.kernels.activation import silu_mul, silu_mul_torch
    from twinplane.rollout.kernels.norm import rms_norm, rms_norm_torch
    from twinplane.rollout.kernels.paged_decode import num_splits, paged_decode, paged_decode_torch
    from twinplane.rollout.kernels.rope import rope_write, rope_write_torch
    from twinplane.rollout.kernels.sampler import sample_tokens, sample_tokens_torch
    from twinplane.rollout.paged_attention import PagedKV, paged_attention

    shape, bs, ctx = SHAPES[a.decode_shape], platform.TRITON_PAGE_SIZE, a.context
    H, H_kv, D, hidden, inter = (shape[k] for k in ("num_heads", "num_kv_heads", "head_dim", "hidden_size",
                                                     "intermediate_size"))
    calls, reps = (20, a.reps) if device.type == "cuda" else (1, 1)
    g = torch.Generator().manual_seed(B)

    def rand(*size):
        return torch.randn(*size, generator=g).to(device, dtype)

    def us(fn) -> float:
        return device_us(fn, device, calls, reps)

    def sweep(launch, settings) -> dict:
        """Microseconds per launch setting (size, warps) as "size x warps", or why the launch failed (a tile
        too large for this device's shared memory)."""
        out = {}
        for n, w in settings:
            try:
                out[f"{n}x{w}"] = us(lambda n=n, w=w: launch(n, w))
            except Exception as e:
                out[f"{n}x{w}"] = f"{type(e).__name__}: {e}"[:300]
        return out

    def pair(tri, ref) -> dict:
        t, r = us(tri), us(ref)
        return {"triton_us": t, "torch_us": r, "speedup": r / t}

    def pool(bs: int):  # a KV pool of `bs`-token blocks, each sequence's blocks shuffled; its last-token slots
        per_seq = -(-ctx // bs)
        k, v = rand(B * per_seq + 1, bs, H_kv, D), rand(B * per_seq + 1, bs, H_kv, D)
        tables = torch.randperm(B * per_seq, generator=g).view(B, per_seq).to(device, torch.int32)
        return k, v, tables, (tables[:, -1].long() * bs + (ctx - 1) % bs).contiguous()

    k_pool, v_pool, tables, slots = pool(bs)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    q, x, r, w, gate, up = rand(B, H, D), rand(B, hidden), rand(B, hidden), rand(hidden), rand(B, inter), rand(B, inter)
    qn, kn, vn, cos, sin = rand(B, H, D), rand(B, H_kv, D), rand(B, H_kv, D), rand(B, D), rand(B, D)
    res = {"paged_decode": pair(lambda: paged_decode(q, k_pool, v_pool, tables, lens, None, ctx),
                                lambda: paged_decode_torch(q, k_pool, v_pool, tables, lens))}
    res["paged_decode"] |= {"splits": num_splits(B, H_kv, ctx, device), "kv_bytes_per_s":
                            2 * B * ctx * H_kv * D * dtype.itemsize / (1e-6 * res["paged_decode"]["triton_us"])}
    res["paged_decode_by_splits_us"] = {s: us(lambda s=s: paged_decode(q, k_pool, v_pool, tables, lens, splits=s))
                                        for s in a.split_sweep}
    # stage 1's launch (tokens per tile, warps) at the split count the engine picks: "block_n x warps" -> us
    res["paged_decode_by_tile_us"] = sweep(lambda n, w: paged_decode(q, k_pool, v_pool, tables, lens, None, ctx,
                                                                     block_n=n, num_warps=w), a.tile_sweep)
    res["add_rms_norm"] = pair(lambda: rms_norm(x, w, 1e-6, r), lambda: rms_norm_torch(x, w, 1e-6, r))
    res["silu_mul"] = pair(lambda: silu_mul(gate, up), lambda: silu_mul_torch(gate, up))
    res["rope_write"] = pair(lambda: rope_write(qn, kn, vn, cos, sin, k_pool, v_pool, slots),
                             lambda: rope_write_torch(qn, kn, vn, cos, sin, k_pool, v_pool, slots))
    logits, u = rand(B, shape["vocab_size"]), torch.rand(B, generator=g).to(device)
    res["sampler"] = pair(lambda: sample_tokens(logits, 1.0, u), lambda: sample_tokens_torch(logits, 1.0, u))
    res["sampler_by_launch_us"] = sweep(lambda n, w: sample_tokens(logits, 1.0, u, block=n, num_warps=w),
                                        a.sampler_sweep)
    # one layer's paged attention as the static decode runs it (its pool write included), per backend
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, kn, vn))
    res["attention_layer_us"] = {}
    for backend in ("triton", "flex", "sdpa"):
        kb, vb, tb, sb = pool(platform.PAGED_BLOCK_SIZES[backend])  # (flex reads 128-token blocks)
        paged = PagedKV(kb[None], vb[None], sb, tb, lens, torch.arange(B + 1, device=device, dtype=torch.int32),
                        [1] * B, B, tb.shape[1] * kb.shape[1], static=True)
        meta = AttentionMetadata(torch.zeros(1, B, dtype=torch.long, device=device), backend=backend, paged=paged)
        try:
            res["attention_layer_us"][backend] = us(lambda meta=meta: paged_attention(q4, k4, v4, meta, 0))
        except Exception as e:  # flex may not compile here: the others still report
            res["attention_layer_us"][backend] = f"{type(e).__name__}: {e}"[:300]
    return res


def engine_workload(a, device, dtype) -> argparse.Namespace:
    """The engine sections' work: `engine_vs_hf`'s GPU preset (its prompts and random weights follow from it)."""
    from engine_vs_hf import FIELDS, PRESETS

    args = argparse.Namespace(**dict(zip(FIELDS, PRESETS["qwen2.5-0.5b" if device.type == "cuda" else "cpu"],
                                         strict=True)))
    if a.smoke:
        args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab = 2, 64, 128, 4, 2, 512
        args.prompts, args.samples, args.new_tokens, args.stops, args.prompt_len = 4, 2, 16, 8, 8
    args.dtype = str(dtype).removeprefix("torch.")
    return args


def engine_section(a, device, dtype, bw: float) -> dict:
    from engine_vs_hf import Roofline, build, run_twinplane
    from torch._dynamo.utils import counters

    import twinplane
    from twinplane.rollout import RolloutEngine
    from twinplane.rollout.graphs import DecodeGraphs

    args = engine_workload(a, device, dtype)
    captures = {"n": 0, "seconds": 0.0}
    capture = DecodeGraphs._capture

    def counted(self, *args):
        sync(device)
        t = time.perf_counter()
        ok = capture(self, *args)
        sync(device)
        captures["n"] += 1
        captures["seconds"] += time.perf_counter() - t
        return ok

    def frames_since(frames: dict) -> dict:  # Dynamo frames compiled since `frames` was taken
        return {k: v - frames.get(k, 0) for k, v in counters["frames"].items()}

    with tempfile.TemporaryDirectory() as tmp:
        prompts = build(args, tmp)
        model = twinplane.load_model(tmp, device=device, dtype=dtype)
    engine = RolloutEngine(copy.deepcopy(model), eos_token_id=None, max_num_seqs=512,
                           max_num_batched_tokens=args.max_num_batched_tokens, graph_max_batch=512)
    if device.type == "cpu":  # (--smoke: the graph path's steps, buffers and run-ahead, without capture)
        engine.graph_backend = "static"
    roof = Roofline(engine)
    Roofline.active = [roof]
    DecodeGraphs._capture = counted
    try:
        run_twinplane(engine, prompts[:8], args, seed=0, new_tokens=32)  # warm-up: compiles, cuBLAS, allocator
        warm_captures, warm_seconds, frames = captures["n"], captures["seconds"], dict(counters["frames"])
        roof.reset()
        n, s, samples, m = run_twinplane(engine, prompts, args, seed=1)
        out = {"kernels": engine.kernels, "backend": engine.backend, "tokens": n, "seconds": s,
               "tokens_per_s": n / s, "captures_warmup": warm_captures,
               "captures_timed_call": captures["n"] - warm_captures,
               "capture_seconds_timed_call": captures["seconds"] - warm_seconds,
               "dynamo_frames_timed_call": frames_since(frames),
               "metrics": m, "roofline": roof.summary(bw)}
        # later calls of the same shape: the engine's pool and graphs serve them (no capture expected), their
        # steps against the roofline are the steady state's; in pairs of the same seed, each step launched before
        # the one before it is read back (run_ahead, the default) and each read back first, in ABBA order
        before, frames, default = captures["n"], dict(counters["frames"]), engine.run_ahead
        rates: dict[bool, list[float]] = {True: [], False: []}
        for i in range(a.engine_pairs):
            for ahead in (True, False) if i % 2 == 0 else (False, True):
                engine.run_ahead = ahead
                roof.reset()
                n2, s2, _, m2 = run_twinplane(engine, prompts, args, seed=2 + i)
                rates[ahead].append(n2 / s2)
                call = {"tokens": n2, "seconds": s2, "tokens_per_s": n2 / s2, "roofline": roof.summary(bw),
                        "run_ahead": ahead, "metrics": m2}
                if "second_call" not in out:
                    out["second_call"] = call | {"captures": captures["n"] - before,
                                                 "dynamo_frames": frames_since(frames)}
                elif "step_by_step_call" not in out and not ahead:
                    out["step_by_step_call"] = call
        out["later_calls"] = {"tokens_per_s": {"run_ahead": rates[True], "step_by_step": rates[False]},
                              "captures": captures["n"] - before, "dynamo_frames": frames_since(frames),
                              "run_ahead_speedup": statistics.median(rates[True]) / statistics.median(rates[False])}
        out["graph_steps"] = engine_graph_steps(a, engine, roof, device, bw)
        # where a smaller call's host waits for the device (run ahead, a decode step should wait once, for the
        # step before it; sites in engine_vs_hf.py are the benchmark's own timing: the call, the scheduler's phase)
        engine.run_ahead = default
        roof.reset()
        syncs = sync_sites(lambda: run_twinplane(engine, prompts[:16], args, seed=3, new_tokens=64), device)
        out |= {"host_syncs_small_call": syncs and syncs | {"engine_steps": len(roof.steps)}}
    finally:
        DecodeGraphs._capture = capture
        Roofline.active = []
    # (for engine_hf's ratios: the first call, and the median of the later ones as a run has them)
    a.engine_rates = {"first_call": n / s, "second_call": statistics.median(rates[default])}
    return out


def host_section(a) -> dict:
    """The engine's host work per decode step on this machine's CPU (`benchmarks/engine_host.py`: a one-layer model's
    graph-path steps run without capture, the step's compute taken out), which a device step must outlast for
    running ahead to hide it: median ms per batch size over 3 calls."""
    from engine_host import host_ms

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as the engine's host loop runs: one Python thread)
    try:
        out = {}
        for b in a.host_batches:
            runs = [host_ms(b, a.host_tokens)[0] for _ in range(3)]
            out[str(b)] = {"host_ms": statistics.median(runs), "runs": runs}
        return {"batches": out, "cpu": host.processor() or host.machine()}
    finally:
        torch.set_num_threads(threads)


def engine_hf_section(a, device, dtype) -> dict:
    """Hugging Face `generate` on the engine section's work and weights: tokens/s, and the engine's calls' over it."""
    import transformers
    from engine_vs_hf import build, run_hf

    args = engine_workload(a, device, dtype)
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        prompts = build(args, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
    run_hf(hf, prompts[:8], args, seed=0, new_tokens=32)  # warm-up
    n, s, _ = run_hf(hf, prompts, args, seed=1)
    rates = getattr(a, "engine_rates", {})
    return {"hf_tokens": n, "hf_seconds": s, "hf_tokens_per_s": n / s} | {
        f"ratio_vs_hf_{call}": rate / (n / s) for call, rate in rates.items()}


def rl_lengths(n: int, prompt: tuple[int, int], mean: int, cap: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Prompt lengths uniform in `prompt`, response lengths geometric with `mean`, capped at `cap` (an RL batch)."""
    g = torch.Generator().manual_seed(seed)
    ps = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=g).tolist()
    u = torch.rand(n, generator=g).clamp_min(1e-9)
    rs = [min(cap, max(1, int(-mean * math.log(x)))) for x in u.tolist()]
    return ps, rs


def attention_section(a, device) -> dict:
    """One layer's packed attention at the training shape in bf16, forward and forward + backward, per varlen
    backend, over one micro-batch of RL-like rows (a.train_tokens): groups of 8 responses sharing their prompt
    (the trainer's shared-prompt layout) and the same rows each with its own prompt copy; TFLOP/s over the attended
    (query, key) pairs (backward counted as 2.5 forwards); which backend the platform picks for each layout."""
    from twinplane.model import AttentionMetadata
    from twinplane.model.attention import VARLEN_BACKENDS, torch_varlen_agrees

    cfg, gpu, dtype = SHAPES[a.train_shape], device.type == "cuda", torch.bfloat16
    H, H_kv, D = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    ps, rs = rl_lengths(a.train_rows, (a.train_prompt // 2, a.train_prompt), a.train_response, 4 * a.train_response)
    shared, prefix, plain = [], [], []
    for g in range(0, len(rs), 8):
        if sum(shared) + ps[g] + sum(rs[g:g + 8]) > a.train_tokens and shared:
            break
        parent = len(shared)
        shared += [ps[g], *rs[g:g + 8]]
        prefix += [-1] + [parent] * len(rs[g:g + 8])
        plain += [ps[g] + r for r in rs[g:g + 8]]
    layouts = {"shared": (shared, prefix), "unshared": (plain, None)}
    backends = ["sdpa"] + (["flex", "torch_varlen"] if gpu else [])
    if gpu and platform.detect().attention.flash_attn_eligible:
        backends.append("flash_attn")
    out = {"shape": a.train_shape, "heads": [H, H_kv, D], "layouts": {}}
    for name, (lens, pre) in layouts.items():
        T = sum(lens)
        pairs = sum(q * (q + 1) // 2 + q * (lens[p] if p >= 0 else 0)
                    for q, p in zip(lens, pre or [-1] * len(lens), strict=True))
        g = torch.Generator(device).manual_seed(0)
        q, k, v = (torch.randn(1, h, T, D, generator=g, device=device, dtype=dtype).requires_grad_()
                   for h in (H, H_kv, H_kv))
        grad = torch.randn(1, H, T, D, generator=g, device=device, dtype=dtype)
        row = {"tokens": T, "sequences": len(lens), "pairs": pairs,
               "chosen": platform.varlen_backend(device, dtype, pre is not None, D, check=torch_varlen_agrees)}
        fwd_flops = 4 * H * D * pairs
        for b in backends:
            if b == "flash_attn" and pre is not None:
                continue
            try:
                meta = AttentionMetadata.packed(lens, device, prefix=pre, backend=b)
                fwd, both = attention_times(VARLEN_BACKENDS[b], (q, k, v), meta, grad, device, a.reps)
                row[b] = {"forward_ms": 1e3 * fwd, "forward_backward_ms": 1e3 * both,
                          "forward_tflops": fwd_flops / fwd / 1e12,
                          "forward_backward_tflops": 3.5 * fwd_flops / both / 1e12}
            except Exception as e:  # (a backend this device or torch lacks: recorded, the next one runs)
                row[b] = {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:300]}
        out["layouts"][name] = row
    return out


def attention_times(attend, qkv, meta, grad, device, reps: int) -> tuple[float, float]:
    """Median seconds of `attend` forward alone and forward + backward (gradients of q, k, v)."""
    with torch.no_grad():
        fwd = statistics.median(timed(lambda: attend(*qkv, meta), device, reps))
    both = statistics.median(timed(lambda: torch.autograd.grad(attend(*qkv, meta), qkv, grad), device, reps))
    return fwd, both


def train_section(a, device, compiled: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from twinplane.config import AlgoSection, TrainSection
    from twinplane.model import ModelConfig, Transformer
    from twinplane.model.attention import torch_varlen_agrees
    from twinplane.model.flops import train_flops
    from twinplane.train import Batch, Trainer

    torch.manual_seed(0)
    cfg = ModelConfig(**SHAPES[a.train_shape])
    with torch.device(device):
        model = Transformer(cfg)  # fp32 master weights; bf16 compute on GPUs (platform.train_precision)
    # (train.compile, as a run sets it: "auto" would compile on a GPU in both sections)
    train = TrainSection(micro_batch_size=a.train_rows, max_tokens_per_micro_batch=a.train_tokens, lr=1e-6,
                         compile="on" if compiled else "off")
    trainer = Trainer(model, train, AlgoSection(), 1.0, 100)
    ps, rs = rl_lengths(a.train_rows, (a.train_prompt // 2, a.train_prompt), a.train_response, 4 * a.train_response)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(cfg.vocab_size, (p,), generator=g).tolist() for p in ps]
    responses = [torch.randint(cfg.vocab_size, (r,), generator=g).tolist() for r in rs]
    batch = Batch.collate(prompts, responses, 0, [[-1.0] * r for r in rs])
    batch.advantages = torch.randn(len(ps), 1, generator=g) * batch.response_mask
    tokens = sum(ps) + sum(rs)
    flops = sum(train_flops(cfg, p + r, p + r, r) for p, r in zip(ps, rs, strict=True))  # (logits: responses)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    trainer.train_step(batch)  # first step: compiles, allocator, cuBLAS
    sync(device)
    first = time.perf_counter() - t
    first_counts = dynamo_counts()  # (what the first step compiled, and found in the caches)
    trainer.train_step(batch)
    allocator, counts, cpu = alloc_counts(device), dynamo_counts(), cpu_snapshot()
    steps = timed(lambda: trainer.train_step(batch), device, a.train_steps, warmup=0)
    cpu = cpu_use(cpu, sum(steps))  # (host-bound steps: ~1 CPU second per second; contention: the machine busy)
    allocator = {k: v - allocator[k] for k, v in alloc_counts(device).items()}  # over the timed steps
    counts = {k: v - counts.get(k, 0) for k, v in dynamo_counts().items() if v != counts.get(k, 0)}
    step = statistics.median(steps)
    peak = platform.detect().peak_flops
    out = {"shape": a.train_shape, "params_M": round(cfg.num_params / 1e6, 1), "compiled": compiled,
           "attention": platform.varlen_backend(device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                                                True, cfg.head_dim, check=torch_varlen_agrees),
           "rows": len(ps), "tokens": tokens, "response_tokens": sum(rs), "max_tokens_per_micro_batch": a.train_tokens,
           "first_step_s": round(first, 2), "step_s": steps, "step_s_median": step, "tokens_per_s": tokens / step,
           "tflops": flops / step / 1e12, "mfu": None if not peak else flops / step / peak,
           "allocator_timed_steps": allocator, "compile_counters_first_step": first_counts,
           "compile_counters_timed_steps": counts, "cpu_timed_steps": cpu}
    gpu = device.type == "cuda"
    if gpu:
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else []),
                 record_shapes=True) as prof:
        t = time.perf_counter()
        trainer.train_step(batch)
        sync(device)
        profiled = time.perf_counter() - t
    out["profile"] = kernel_table(prof, gpu, top=12) | {"ops": op_table(prof, gpu), "step_s": profiled,
                                                        "host": host_table(prof)}
    out["host_syncs"] = sync_sites(lambda: trainer.train_step(batch), device)
    return out


def dynamo_counts() -> dict:
    """torch.compile's counters so far (Dynamo frames and graphs, Inductor's and AOTAutograd's cache hits and misses,
    recompiles), flattened: "group/name" -> count."""
    from torch._dynamo.utils import counters

    return {f"{group}/{name}": n for group, names in counters.items() if group != "aten_mm_info"  # (per GEMM shape)
            for name, n in names.items() if isinstance(n, int)}


def alloc_counts(device) -> dict:
    """The caching allocator's counters that mean the device waited: retries (a cache flush after a failed
    allocation) and the device allocations and frees themselves (cudaFree synchronizes)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}


def cpu_snapshot() -> tuple[float, list[int] | None]:
    """(this process's CPU seconds, all threads; the machine's CPU jiffies from /proc/stat: [busy, total], None
    where there is no /proc)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        jiffies = [sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0), sum(ticks)]  # (idle, iowait out)
    except (OSError, ValueError):
        jiffies = None
    return time.process_time(), jiffies


def cpu_use(before: tuple[float, list[int] | None], wall: float) -> dict:
    """Over `wall` seconds since `before` (`cpu_snapshot`): this process's CPU seconds per second (about 1 while its
    host thread launches without pause; more with busy helper threads), the machine's busy fraction (other work,
    e.g. compile workers, competing for its cores), and the processes this one started that are still alive."""
    cpu, jiffies = cpu_snapshot()
    out = {"process_cpu_per_s": (cpu - before[0]) / wall, "threads": len(os.listdir("/proc/self/task"))
           if os.path.isdir("/proc/self/task") else None}
    if jiffies and before[1] and jiffies[1] > before[1][1]:
        out["machine_busy"] = (jiffies[0] - before[1][0]) / (jiffies[1] - before[1][1])
    children = 0
    with contextlib.suppress(OSError):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/stat") as f:
                    children += int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    out["child_processes"] = children
    return out


def train_fit_section(a, device) -> dict:
    """The largest packed micro-batch (tokens, doubling from a quarter of the probe's) one eager training step
    fits, with the log-probs chunked (`train.logprob_chunk_tokens=0`: the platform's size) and without (one chunk:
    the micro-batch's [tokens, V] logits at once); the peak memory of each size that fit."""
    import dataclasses
    import gc

    from twinplane.config import AlgoSection, TrainSection
    from twinplane.model import ModelConfig, Transformer
    from twinplane.train import Batch, Trainer

    torch.manual_seed(0)
    cfg = ModelConfig(**SHAPES[a.train_shape])
    with torch.device(device):
        model = Transformer(cfg)
    train = TrainSection(micro_batch_size=10**6, lr=1e-6, compile="off")
    trainer = Trainer(model, train, AlgoSection(), 1.0, 100)
    g = torch.Generator().manual_seed(1)
    out = {"shape": a.train_shape}
    for chunked in (True, False):
        fits, sizes = 0, {}
        tokens = a.train_tokens // 4
        while tokens <= a.fit_cap:
            ps, rs = rl_lengths(4 * tokens // a.train_response, (a.train_prompt // 2, a.train_prompt),
                                a.train_response, 4 * a.train_response)
            ends = list(itertools.accumulate(p + r for p, r in zip(ps, rs, strict=True)))
            keep = range(max(1, sum(n <= tokens for n in ends)))  # the rows that fill one micro-batch of `tokens`
            batch = Batch.collate([torch.randint(cfg.vocab_size, (ps[i],), generator=g).tolist() for i in keep],
                                  [torch.randint(cfg.vocab_size, (rs[i],), generator=g).tolist() for i in keep], 0,
                                  [[-1.0] * rs[i] for i in keep])
            batch.advantages = torch.randn(len(keep), 1, generator=g) * batch.response_mask
            trainer.cfg = dataclasses.replace(train, max_tokens_per_micro_batch=tokens)
            trainer.chunk_tokens = platform.logprob_chunk_tokens(device) if chunked else tokens
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                trainer.train_step(batch)
                sync(device)
            except torch.OutOfMemoryError:
                sizes[tokens] = "out of memory"
                break
            finally:
                trainer.opt.zero_grad(set_to_none=True)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            fits = tokens
            sizes[tokens] = (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)
            tokens *= 2
        out["chunked" if chunked else "one_chunk"] = {"largest_tokens": fits, "peak_gib_by_tokens": sizes}
    return out


# The compiled training step, each in a child process with Inductor's caches in --inductor-cache: the first run
# (a fresh folder: everything compiled), then runs that find what it left (as a restarted run does), with
# Inductor's defaults, with AOTAutograd's cache off (graphs from Inductor's cache, AOTAutograd's wrappers built
# anew), and with both graph caches off (graphs compiled anew, their Triton binaries found in Triton's cache); then
# the same pair, compiled and found, with Triton's own kernel launcher instead of Inductor's static one (a setting
# in the cache key: the first of them compiles).
COMPILED = {"train_compiled": {}, "train_compiled_warm": {},
            "train_compiled_warm_no_aot_cache": {"TORCHINDUCTOR_AUTOGRAD_CACHE": "0"},
            "train_compiled_warm_no_graph_cache": {"TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
                                                   "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"},
            "train_compiled_triton_launcher": {"TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER": "0"},
            "train_compiled_warm_triton_launcher": {"TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER": "0"}}


def isolated(a, name: str) -> dict:
    """Section `name` (one of COMPILED) in a child process that is killed after `--child-limit` seconds, or
    `--grace` seconds past the deadline if that comes first (a compile can run for minutes in native code, where
    nothing in this process could interrupt it; the sections after it still get their time)."""
    out = a.out / name
    cmd = [sys.executable, __file__, str(out), "--sections", name, "--deadline", "1e9", "--in-child",
           *(["--smoke"] if a.smoke else [])]
    state = {"env": COMPILED[name]}
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(a.inductor_cache)} | COMPILED[name]
    cut = False
    try:
        subprocess.run(cmd, timeout=max(min(a.until - time.perf_counter(), a.child_limit), 1.0), check=False,
                       env=env)
    except subprocess.TimeoutExpired:  # (the section may have ended, the child still exiting: compile workers)
        cut = True
    done = json.loads((out / "probe.json").read_text()) if (out / "probe.json").exists() else {}
    if name in done:
        return state | cache_state(done[name])
    log = (out / "probe.log").read_text()[-2000:] if (out / "probe.log").exists() else ""
    return state | {"error": "cut at its time limit" if cut else "ended without a result", "log_tail": log}


def cache_state(res: dict) -> dict:
    """`res` with "inductor_cache": what its first step found in Inductor's graph cache, by the counters: "warm"
    (hits only), "cold" (misses only), "mixed", or "unused" (neither: the cache was off)."""
    counts = res.get("compile_counters_first_step", {})
    hits, misses = counts.get("inductor/fxgraph_cache_hit", 0), counts.get("inductor/fxgraph_cache_miss", 0)
    found = "mixed" if hits and misses else "warm" if hits else "cold" if misses else "unused"
    return {"inductor_cache": found} | res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="folder for probe.json and probe.log")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU test)")
    p.add_argument("--deadline", type=float, default=400.0, help="seconds after which no new section starts")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds past the deadline before the compiled training section is cut")
    p.add_argument("--child-limit", type=float, default=240.0,
                   help="seconds the compiled training section (a child process) may take at most")
    p.add_argument("--inductor-cache", default="",
                   help="Inductor's cache folder for the compiled training sections (default: a fresh one, removed "
                   "at the end; name one to keep it for a later call's warm sections)")
    p.add_argument("--sections", default=",".join(("env,copy,engine,decode", *COMPILED, "host,profile,kernels,"
                                                   "train_fit,train,attention,sampling,decode_sdpa,decode_torch,"
                                                   "decode_triton,engine_hf")))
    p.add_argument("--commit", default="", help="the commit measured (recorded in env)")
    p.add_argument("--in-child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    gpu = torch.cuda.is_available() and not a.smoke
    if not gpu:  # the Triton sections on CPU: Triton's interpreter (set before any kernel is defined)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device, dtype = torch.device("cuda" if gpu else "cpu"), torch.bfloat16 if gpu else torch.float32
    a.decode_shape, a.train_shape = ("qwen2.5-0.5b", "qwen2.5-1.5b") if gpu else ("tiny", "tiny")
    a.batches = [1, 8, 32, 128, 256, 512] if gpu else [1, 3, 8]
    a.context, a.reps, a.engine_pairs = (640, 20, 2) if gpu else (40, 2, 1)
    a.host_batches, a.host_tokens = ([64, 256, 512], 128) if gpu else ([8], 8)
    a.kernel_batches, a.split_sweep = ([8, 128, 512], [1, 2, 4, 8, 16]) if gpu else ([3], [1, 2])
    a.tile_sweep = list(itertools.product((16, 32, 64, 128), (2, 4, 8))) if gpu else [(16, 4), (32, 4)]
    a.sampler_sweep = list(itertools.product((1024, 2048, 4096), (4, 8, 16))) if gpu else [(256, 4)]
    a.fit_cap = 262144 if gpu else 64  # the largest micro-batch train_fit tries
    a.train_rows, a.train_prompt, a.train_response, a.train_tokens, a.train_steps = \
        (64, 512, 400, 16384, 3) if gpu else (4, 16, 8, 64, 1)
    probe = Probe(a.out, a.deadline)
    a.partial = probe.partial
    a.until = probe.t0 + a.deadline + a.grace
    probe.say(f"gpu_probe: device {device}, dtype {dtype}, deadline {a.deadline:.0f} s, sections {a.sections}")
    want = a.sections.split(",")
    bw = 1e12
    if "env" in want:
        probe.section("env", env, device, dtype)
        probe.result["env"]["commit"] = a.commit
    if "copy" in want or gpu:  # (0.1 s; the rooflines need the measured bandwidth)
        res = probe.section("copy", copy_section, device)
        bw = (res or {}).get("copy_bandwidth_bytes_per_s", bw)
    # the goals' measurements first (the engine's calls and a full-batch step against the roofline, the compiled
    # training step's MFU), then what explains them; HF generate, whose rate is known, last
    fresh = None if a.inductor_cache or a.in_child else tempfile.TemporaryDirectory(prefix="probe-inductor-",
                                                                                    ignore_cleanup_errors=True)
    a.inductor_cache = a.inductor_cache or (fresh.name if fresh else "")
    compiled = [(name, *((train_section, (a, device, True)) if a.in_child else (isolated, (a, name))),
                 45 if "warm" in name else 90) for name in COMPILED]
    for name, fn, args, need in (("engine", engine_section, (a, device, dtype, bw), 40),
                                 ("decode", decode_section, (a, device, dtype, bw), 30),
                                 *compiled,
                                 ("host", host_section, (a,), 20),
                                 ("profile", profile_section, (a, device, dtype), 20),
                                 ("kernels", kernels_section, (a, device, dtype), 30),
                                 ("train_fit", train_fit_section, (a, device), 60),
                                 ("train", train_section, (a, device, False), 40),
                                 ("attention", attention_section, (a, device), 30),
                                 ("sampling", sampling_section, (a, device, dtype), 10),
                                 ("decode_sdpa", decode_other_backend, (a, device, dtype, bw, "sdpa", "torch"), 20),
                                 ("decode_torch", decode_other_backend, (a, device, dtype, bw, None, "torch"), 40),
                                 ("decode_triton", decode_other_backend, (a, device, dtype, bw, "triton", "triton"),
                                  20),
                                 ("engine_hf", engine_hf_section, (a, device, dtype), 90)):
        if name in want:
            probe.section(name, fn, *args, need=0 if a.smoke else need)
            if gpu:  # what the section held goes back before the next one
                torch.cuda.empty_cache()
    if fresh:
        fresh.cleanup()
    probe.say(f"gpu_probe: done in {time.perf_counter() - probe.t0:.0f} s")


if __name__ == "__main__":
    main()
