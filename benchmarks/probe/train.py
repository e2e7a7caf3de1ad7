"""The training plane: a training step's speed, MFU, profile and host, the largest micro-batch that fits, and one
layer's packed attention per varlen backend."""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import time

import torch

from twinplane.errors import first_line
from twinplane.platform import backends, hardware

from .report import host_table, kernel_table, op_table, sync, sync_sites, timed
from .shapes import SHAPES, rl_lengths


def train_section(a, device, compiled: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from twinplane.config import AlgoSection, TrainSection
    from twinplane.model import ModelConfig, Transformer
    from twinplane.model.attention import torch_varlen_agrees
    from twinplane.train import Trainer

    torch.manual_seed(0)
    cfg = ModelConfig(**SHAPES[a.train_shape])
    with torch.device(device):
        model = Transformer(cfg)  # fp32 master weights; bf16 compute on GPUs (runtime.train_precision)
    # (train.compile, as a run sets it: "auto" would compile on a GPU in both sections)
    train = TrainSection(micro_batch_size=a.train_rows, max_tokens_per_micro_batch=a.train_tokens, lr=1e-6,
                         compile="on" if compiled else "off")
    trainer = Trainer(model, train, AlgoSection(), 1.0, 100)
    batch, tokens, flops = rl_batch(a, cfg)
    _, first, first_counts = first_step(trainer, batch, device)
    trainer.train_step(batch)
    allocator, counts, cpu = alloc_counts(device), dynamo_counts(), cpu_snapshot()
    steps = timed(lambda: trainer.train_step(batch), device, a.train_steps, warmup=0)
    cpu = cpu_use(cpu, sum(steps))  # (host-bound steps: ~1 CPU second per second; contention: the machine busy)
    allocator = {k: v - allocator[k] for k, v in alloc_counts(device).items()}  # over the timed steps
    counts = dynamo_counts(since=counts)
    step = statistics.median(steps)
    out = {"shape": a.train_shape, "params_M": round(cfg.num_params / 1e6, 1), "compiled": compiled,
           "attention": backends.varlen_backend(device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                                                True, cfg.head_dim, check=torch_varlen_agrees),
           "rows": len(batch), "tokens": tokens, "response_tokens": batch.num_response_tokens,
           "max_tokens_per_micro_batch": a.train_tokens,
           "first_step_s": round(first, 2), "step_s": steps, "step_s_median": step, "tokens_per_s": tokens / step,
           "tflops": flops / step / 1e12, "mfu": hardware.mfu(flops / step),
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


def first_step(trainer, batch, device) -> tuple[dict, float, dict]:
    """The first training step (compiles, allocator, cuBLAS), peak memory counted from its start: its metrics, its
    seconds, and what torch.compile did in it (compiled, and found in the caches)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    metrics = trainer.train_step(batch)
    sync(device)
    return metrics, time.perf_counter() - t, dynamo_counts()


def rl_batch(a, cfg):
    """The probe's training batch (a.train_rows RL-like rows, random tokens of `cfg`'s vocabulary), its tokens and its
    FLOPs (the LM head counted for the response tokens, where the trainer forms logits)."""
    from twinplane.model.flops import train_flops
    from twinplane.train import Batch

    ps, rs = rl_lengths(a.train_rows, (a.train_prompt // 2, a.train_prompt), a.train_response, 4 * a.train_response)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(cfg.vocab_size, (p,), generator=g).tolist() for p in ps]
    responses = [torch.randint(cfg.vocab_size, (r,), generator=g).tolist() for r in rs]
    batch = Batch.collate(prompts, responses, 0, [[-1.0] * r for r in rs])
    batch.advantages = torch.randn(len(ps), 1, generator=g) * batch.response_mask
    return batch, sum(ps) + sum(rs), sum(train_flops(cfg, p + r, p + r, r) for p, r in zip(ps, rs, strict=True))


def dynamo_counts(since: dict | None = None) -> dict:
    """torch.compile's counters (Dynamo frames and graphs, Inductor's and AOTAutograd's cache hits and misses,
    recompiles), flattened: "group/name" -> count; so far, or those that grew since an earlier `since`, by how much."""
    from torch._dynamo.utils import counters

    now = {f"{group}/{name}": n for group, names in counters.items() if group != "aten_mm_info"  # (per GEMM shape)
           for name, n in names.items() if isinstance(n, int)}
    since = since or {}
    return {k: v - since.get(k, 0) for k, v in now.items() if v != since.get(k, 0)}


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
            trainer.chunk_tokens = backends.logprob_chunk_tokens(device) if chunked else tokens
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
    timed_backends = ["sdpa"] + (["flex", "torch_varlen"] if gpu else [])
    if gpu and hardware.detect().attention.flash_attn_eligible:
        timed_backends.append("flash_attn")
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
               "chosen": backends.varlen_backend(device, dtype, pre is not None, D, check=torch_varlen_agrees)}
        fwd_flops = 4 * H * D * pairs
        for b in timed_backends:
            if b == "flash_attn" and pre is not None:
                continue
            try:
                meta = AttentionMetadata.packed(lens, device, prefix=pre, backend=b)
                fwd, both = attention_times(VARLEN_BACKENDS[b], (q, k, v), meta, grad, device, a.reps)
                row[b] = {"forward_ms": 1e3 * fwd, "forward_backward_ms": 1e3 * both,
                          "forward_tflops": fwd_flops / fwd / 1e12,
                          "forward_backward_tflops": 3.5 * fwd_flops / both / 1e12}
            except Exception as e:  # (a backend this device or torch lacks: recorded, the next one runs)
                row[b] = {"error": first_line(e)}
        out["layouts"][name] = row
    return out


def attention_times(attend, qkv, meta, grad, device, reps: int) -> tuple[float, float]:
    """Median seconds of `attend` forward alone and forward + backward (gradients of q, k, v)."""
    with torch.no_grad():
        fwd = statistics.median(timed(lambda: attend(*qkv, meta), device, reps))
    both = statistics.median(timed(lambda: torch.autograd.grad(attend(*qkv, meta), qkv, grad), device, reps))
    return fwd, both
