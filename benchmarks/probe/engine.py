"""The engine's RL-shaped `generate` calls, its own graphs replayed alone, its host work per step, and HF `generate`
on the same work."""

from __future__ import annotations

import argparse
import copy
import platform as host
import statistics
import tempfile
import time

import torch

from .decode import fill_rows
from .report import sync, sync_sites, timed


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
