"""Scale-out measurements on this machine: weight-sync time / GB/s across processes, and the demo's step time
with the planes in one process vs as Ray actors.

  python benchmarks/cluster.py sync [--hidden 128 --layers 4] [--repeats 10]
  python benchmarks/cluster.py steps [--steps 40] [--runs 3] [--layout NAME ...]

`sync` starts a local Ray instance, places 1 training actor + 1 engine actor (disaggregated) and times
`RayPlanes.sync` (gather + bucketed gloo broadcast + the engine's checksum check) for the given model shape.
`steps` runs `twinplane train` (the demo config, no evaluation) with each layout (GRPO, and PPO with the critic in
process, on the training rank or on a critic rank of its own) and reports the median step time over the steps after
the first five, and each phase's median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {
    "local": [],
    "ray 1 trainer + 1 engine": ["cluster.backend=ray"],
    "ray colocated, 1 rank": ["cluster.backend=ray", "cluster.colocate=true"],
    "ray colocated, 1 rank, 2 CPUs": ["cluster.backend=ray", "cluster.colocate=true", "cluster.cpus_per_worker=2"],
    "ray 1 + 1, async": ["cluster.backend=ray", "cluster.max_staleness=1"],
    "local, ppo": ["algo.name=ppo"],
    "ray 1 + 1, ppo, critic on the trainer": ["cluster.backend=ray", "algo.name=ppo"],
    # 2 workers, as the others (a local Ray instance has as many CPUs as the machine)
    "ray colocated 1 rank + 1 critic rank, ppo": ["cluster.backend=ray", "cluster.colocate=true", "algo.name=ppo",
                                                  "cluster.critic_devices=1"],
}


def bench_sync(hidden: int, layers: int, repeats: int, bucket_mb: int) -> None:
    import ray

    from twinplane.cluster.ray_planes import RayPlanes
    from twinplane.config import load_config
    from twinplane.data.tasks import ALPHABET
    from twinplane.model import ModelConfig, Transformer
    from twinplane.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(ALPHABET)
    mc = ModelConfig(vocab_size=tok.vocab_size, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=layers,
                     num_heads=max(1, hidden // 64), num_kv_heads=max(1, hidden // 128), head_dim=64 if hidden >= 64
                     else hidden, max_position_embeddings=64, tie_word_embeddings=True,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Transformer(mc)
    cfg = load_config(None, ["cluster.backend=ray", f"cluster.sync_bucket_mb={bucket_mb}"])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    planes = RayPlanes(cfg, mc, tok, {n: p.detach() for n, p in model.named_parameters()}, None, 1, None,
                       log=lambda *_: None)
    try:
        times, gbps = [], []
        for v in range(1, repeats + 2):
            t0 = time.perf_counter()
            report = planes.sync(v)
            wall = time.perf_counter() - t0
            assert not report.mismatched()
            if v > 1:  # the first sync warms up gloo's connections
                times.append(wall)
                gbps.append(report.bytes / wall / 1e9)
        print(json.dumps({"params_M": round(mc.num_params / 1e6, 2), "bytes": report.bytes, "bucket_mb": bucket_mb,
                          "sync_s_median": statistics.median(times), "gb_per_s_median": statistics.median(gbps),
                          "sync_s_all": [round(t, 4) for t in times]}))
    finally:
        planes.close()
        ray.shutdown()


def bench_steps(steps: int, runs: int, only: list[str] | None) -> None:
    base = [f"train.steps={steps}", "eval.before=false", "eval.after=false", "checkpoint.every=0",
            "log.progress=false", "warmstart.steps=100"]
    for name, extra in LAYOUTS.items():
        if only and name not in only:
            continue
        medians, phases = [], {}
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as d:
                cmd = [sys.executable, "-m", "twinplane.cli", "train", "--run-dir", d, *base, *extra]
                subprocess.run(cmd, check=True, capture_output=True)
                rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()][5:]
            medians.append(statistics.median(r["time/step"] for r in rows))
            for k in ("rollout", "train", "weight_sync", "old_logprob", "values", "critic_train"):
                if f"time/{k}" in rows[0]:
                    phases.setdefault(k, []).append(statistics.median(r[f"time/{k}"] for r in rows))
        print(json.dumps({"layout": name, "step_s_median_of_runs": statistics.median(medians),
                          "step_s_runs": [round(m, 4) for m in medians],
                          "phases_s": {k: round(statistics.median(v), 4) for k, v in phases.items()}}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sync")
    s.add_argument("--hidden", type=int, default=128)
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--repeats", type=int, default=10)
    s.add_argument("--bucket-mb", type=int, default=256)
    t = sub.add_parser("steps")
    t.add_argument("--steps", type=int, default=40)
    t.add_argument("--runs", type=int, default=3)
    t.add_argument("--layout", action="append", choices=LAYOUTS, help="only these (repeatable)")
    a = p.parse_args()
    if a.what == "sync":
        bench_sync(a.hidden, a.layers, a.repeats, a.bucket_mb)
    else:
        bench_steps(a.steps, a.runs, a.layout)


if __name__ == "__main__":
    main()
