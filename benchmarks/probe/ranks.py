"""The training plane on several GPUs: the probe's training step under FSDP2, one process per GPU, against one GPU."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .report import timed
from .shapes import SHAPES
from .train import dynamo_counts, first_step, rl_batch

KEYS = ("train_shape", "train_rows", "train_prompt", "train_response", "train_tokens", "train_steps")


def train_ranks_section(a, device) -> dict:
    """The training section's step (same model, batch and settings; `train.compile` left to the platform, as a run
    leaves it) on 1 rank and on 2, each rank one process on its own GPU (NCCL; gloo ranks on CPU with --smoke),
    training its rows of the same global batch (`split_for_rank`) under FSDP2 as a run's training plane does: step
    time, tokens/s, MFU per device, peak memory, the scaling (2-rank tokens/s over twice the 1-rank rate), and how
    far the first step's metrics (grad norm, entropy, ...) on 2 ranks are from those on 1 (relative; rounding only
    in fp32). Skipped with fewer than 2 GPUs."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and gpus < 2:
        return {"skipped": f"{gpus} GPU(s): needs 2"}
    opts = {k: getattr(a, k) for k in KEYS} | {"gpu": device.type == "cuda", "inductor_cache": a.inductor_cache}
    runs = {n: spawn_ranks(n, opts, min(a.until, time.perf_counter() + a.child_limit)) for n in (1, 2)}
    one, two = runs[1], runs[2]
    out = {"gpus": gpus, "runs": {str(n): r for n, r in runs.items()},
           "scaling": two["tokens_per_s"] / (2 * one["tokens_per_s"])}
    rel = {k: abs(two["first_metrics"][k] - v) / max(abs(v), abs(two["first_metrics"][k]), 1e-12)
           for k, v in one["first_metrics"].items() if k in two["first_metrics"] and k != "actor/lr"}
    return out | {"first_step_rel_diff": rel}


def spawn_ranks(n: int, opts: dict, until: float) -> dict:
    """`_rank` on ranks 0..n-1 (spawned processes), killed at `until` (perf_counter seconds); rank 0's result."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="probe-ranks-") as tmp:
        ctx = mp.start_processes(_rank, args=(n, opts, tmp), nprocs=n, join=False, start_method="spawn")
        while not ctx.join(timeout=1.0):  # (raises with the failing rank's traceback)
            if time.perf_counter() > until:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{n} ranks cut at the time limit")
        return json.loads((Path(tmp) / "rank0.json").read_text())


def _rank(rank: int, n: int, opts: dict, tmp: str) -> None:
    if opts["inductor_cache"]:  # (the compiled sections' cache: read when Inductor first needs it)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = opts["inductor_cache"]
    import argparse

    import torch.distributed as dist

    from twinplane.config import AlgoSection, TrainSection
    from twinplane.model import ModelConfig, Transformer
    from twinplane.platform import hardware, runtime
    from twinplane.train import Trainer
    from twinplane.train.fsdp import shard_over, split_for_rank

    a = argparse.Namespace(**opts)
    device = torch.device("cuda", rank) if a.gpu else torch.device("cpu")
    if a.gpu:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    group = None
    if n > 1:
        dist.init_process_group(runtime.dist_backend(device), init_method=f"file://{tmp}/rendezvous", rank=rank,
                                world_size=n)
        group = dist.group.WORLD
    torch.manual_seed(0)
    cfg = ModelConfig(**SHAPES[a.train_shape])
    with torch.device(device):
        model = shard_over(Transformer(cfg), group)  # (one rank: the plain model, as a one-rank run keeps it)
    train = TrainSection(micro_batch_size=a.train_rows, max_tokens_per_micro_batch=a.train_tokens, lr=1e-6)
    trainer = Trainer(model, train, AlgoSection(), 1.0, 100, group)
    batch, tokens, flops = rl_batch(a, cfg)
    batch.old_is_current = True  # on-policy: ratio 1, a real gradient whose norm the two layouts can compare
    mine = split_for_rank(batch, rank, n) if n > 1 else batch
    first_metrics, first, counts = first_step(trainer, mine, device)
    trainer.train_step(mine)
    before = dynamo_counts()
    steps = timed(lambda: trainer.train_step(mine), device, a.train_steps, warmup=0)
    later = dynamo_counts(since=before)  # (recompiles)
    step = statistics.median(steps)
    res = {"ranks": n, "rows_per_rank": len(mine), "tokens": tokens, "compiled": model.compile_layers,
           "first_step_s": round(first, 2), "compile_counters_first_step": counts,
           "compile_counters_timed_steps": later, "step_s": steps,
           "step_s_median": step, "tokens_per_s": tokens / step, "tflops_per_device": flops / step / n / 1e12,
           "mfu": hardware.mfu(flops / step / n), "first_metrics": first_metrics,
           "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if a.gpu else None}
    if rank == 0:
        (Path(tmp) / "rank0.json").write_text(json.dumps(res))
    if group is not None:
        dist.destroy_process_group()
