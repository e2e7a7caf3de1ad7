"""The probe's report (sections written as they end) and its measuring tools: timing between device syncs, a
CUDA graph's device time per call, host waits by call site, and the profiler's tables."""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
import traceback
from pathlib import Path

import torch

from twinplane.platform import hardware


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
    hardware.synchronize(torch.device(device))


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
    root = Path(__file__).resolve().parents[2]
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


CATEGORIES = (  # kernel name fragments -> category, first match wins
    ("attention", ("flash", "flex", "attention", "attn", "sdpa", "fmha")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul", "_mm_", "splitk", "ampere_", "hopper_")),
    ("norm", ("norm", "rsqrt")),
    ("reduce", ("reduce", "softmax", "logsumexp", "cumsum", "scan", "sort", "topk", "argmax")),
    ("copy", ("copy", "memcpy", "memset", "fill", "index", "gather", "scatter", "cat")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "triton_poi", "pointwise")),
)


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
