"""The rollout engine's host time per decode step: what a GPU would wait for between two steps unless the engine
runs ahead (`rollout.run_ahead`). The graph path's decode steps (static buffers, run without capture on CPU) of a
one-layer model so small that the step's own compute is a fraction of a millisecond; per step, the host time is the
`engine_step` call's time minus that of the step's compute (`DecodeGraphs.run`): reading tokens back, appending
them and checking stops, scheduling, staging the next rows.

  python benchmarks/engine_host.py [--batches 64 256 512] [--runs 3] [--tokens 128]

Per batch size: the median over the steps of a `generate` call (after one warm-up call), median of `--runs` calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from twinplane.model import ModelConfig, Transformer
from twinplane.rollout import RolloutEngine, SamplingParams
from twinplane.rollout.graphs import DecodeGraphs


def host_ms(batch: int, tokens: int) -> tuple[float, float]:
    """(host ms, compute ms) per decode step, medians over one call's steps."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    engine = RolloutEngine(Transformer(cfg).eval(), eos_token_id=None, max_num_seqs=batch, graph_max_batch=batch,
                           kv_cache_bytes=256 << 20)
    engine.graph_backend = "static"  # the graph path's host work, without CUDA
    prompts = [[1, 2, 3, 4 + i % 50] for i in range(batch)]
    sp = SamplingParams(n=1, max_new_tokens=tokens, temperature=1.0, seed=1)
    runs, steps, step, run = [], [], engine.engine_step, DecodeGraphs.run

    def timed_run(self, *a):
        t0 = time.perf_counter()
        out = run(self, *a)
        runs.append(time.perf_counter() - t0)
        return out

    def timed_step(*a, **k):
        t0, before = time.perf_counter(), len(runs)
        out = step(*a, **k)
        if len(runs) == before + 1:  # a graph-path decode step ran in this call
            steps.append((time.perf_counter() - t0, runs[-1]))
        return out

    engine.engine_step = timed_step
    DecodeGraphs.run = timed_run
    try:
        engine.generate(prompts, sp)  # warm-up
        steps.clear()
        engine.generate(prompts, sp)
    finally:
        DecodeGraphs.run = run
    return 1e3 * statistics.median(s - r for s, r in steps), 1e3 * statistics.median(r for _, r in steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args()
    torch.set_num_threads(1)
    for b in a.batches:
        res = [host_ms(b, a.tokens) for _ in range(a.runs)]
        print(json.dumps({"batch": b, "host_ms": round(statistics.median(h for h, _ in res), 3),
                          "host_ms_runs": [round(h, 3) for h, _ in res],
                          "compute_ms": round(statistics.median(c for _, c in res), 3)}), flush=True)


if __name__ == "__main__":
    main()
