"""Asynchronous RL on this machine: the demo on Ray (1 training actor + 1 engine actor, 1 CPU each) at several
staleness bounds, side by side in one invocation.

  python benchmarks/async_rl.py [--runs 3] [--steps 150] [--variant NAME ...] [--out FILE.csv]

Each variant runs `twinplane train` (the demo config, the same seed) `--runs` times, the variants alternating so
that a slow spell of the machine spreads over all of them. Per run: the median step time over the steps after the
first five, the mean, the final held-out accuracy, the mean staleness trained on, and the mean seconds the two
planes overlapped per step. The summary line per variant is the median over its runs, and each variant's step
time as a ratio to the synchronous one.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RAY = ["cluster.backend=ray", "cluster.cpus_per_worker=1"]
VARIANTS = {
    "sync (k=0)": ["cluster.max_staleness=0"],
    "k=1": ["cluster.max_staleness=1"],
    "k=2": ["cluster.max_staleness=2"],
    "k=4": ["cluster.max_staleness=4"],
    "k=2, old log-probs from the engine": ["cluster.max_staleness=2", "algo.recompute_old_logprobs=false"],
}


def one_run(extra: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "twinplane.cli", "train", "--run-dir", d, f"train.steps={steps}",
               "log.progress=false", "checkpoint.every=0", *RAY, *extra]
        subprocess.run(cmd, check=True, capture_output=True)
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((Path(d) / "summary.json").read_text())
    steps_rows = [r for r in rows if r["step"] >= 1]
    later = steps_rows[5:] or steps_rows
    return {"step_s_median": statistics.median(r["time/step"] for r in later),
            "step_s_mean": statistics.mean(r["time/step"] for r in steps_rows),
            "final_accuracy": summary.get("final_accuracy"), "warmstart_accuracy": summary.get("warmstart_accuracy"),
            "wall_s": summary["wall_seconds"],
            "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in steps_rows),
            "overlap_s_mean": statistics.mean(r.get("async/overlap_s", 0.0) for r in steps_rows),
            "rollout_s_median": statistics.median(r.get("async/rollout_busy_s", r.get("time/rollout", 0.0))
                                                  for r in later),
            "train_s_median": statistics.median(r.get("async/train_busy_s", r.get("time/train", 0.0)) for r in later)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--variant", action="append", choices=VARIANTS, help="only these (repeatable)")
    p.add_argument("--out", type=Path, help="also write every run as CSV rows here")
    a = p.parse_args()
    names = a.variant or list(VARIANTS)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(a.runs):
        for name in names:
            r = one_run(VARIANTS[name], a.steps)
            runs[name].append(r)
            print(json.dumps({"variant": name, "run": i, **r}), flush=True)
    if a.out:
        with a.out.open("w", newline="") as f:
            w = csv.DictWriter(f, ["variant", "run", *runs[names[0]][0]])
            w.writeheader()
            for name in names:
                for i, r in enumerate(runs[name]):
                    w.writerow({"variant": name, "run": i, **r})
    base = statistics.median(r["step_s_median"] for r in runs[names[0]])
    for name in names:
        rs = runs[name]
        step = statistics.median(r["step_s_median"] for r in rs)
        print(json.dumps({"variant": name, "runs": len(rs), "step_s": round(step, 4),
                          "vs_first": round(step / base, 3),
                          "final_accuracy": statistics.median(r["final_accuracy"] for r in rs),
                          "final_accuracy_runs": [r["final_accuracy"] for r in rs],
                          "staleness_mean": round(statistics.median(r["staleness_mean"] for r in rs), 3),
                          "overlap_s_mean": round(statistics.median(r["overlap_s_mean"] for r in rs), 4),
                          "rollout_s": round(statistics.median(r["rollout_s_median"] for r in rs), 4),
                          "train_s": round(statistics.median(r["train_s_median"] for r in rs), 4)}), flush=True)


if __name__ == "__main__":
    main()
