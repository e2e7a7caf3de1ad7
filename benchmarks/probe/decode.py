"""The engine's static decode step per batch size against the memory roofline, its profile, and the sampler alone."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from .report import kernel_table, op_table, sync, timed
from .shapes import SHAPES


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
