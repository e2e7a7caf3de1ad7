"""The demo (`twinplane train`, default config) for several seeds, one after another: held-out greedy accuracy after
the warm start and after RL, the gain, the warm start's steps (more than `warmstart.steps` when its decay waited for
the model to learn) and each run's wall clock (the whole `twinplane train` process).

  python benchmarks/demo_seeds.py [--seeds 0-9] [--out benchmarks/results/demo_seeds.csv] [-- key=value ...]

Appends one row per seed to the CSV (with the date, commit, CPU model and torch version) and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

FIELDS = ["date", "commit", "cpu", "torch", "kernels", "seed", "warmstart_accuracy", "final_accuracy", "gain_points",
          "warmstart_steps", "wall_s", "load_1min", "args"]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        name = platform.processor() or "unknown"
    return f"{name}, {torch.get_num_threads()} threads"


def commit() -> str:
    repo = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def seeds(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def run_seed(seed: int, extra: list[str], root: Path) -> dict:
    run_dir = root / f"seed{seed}"
    cmd = [sys.executable, "-m", "twinplane.cli", "train", f"seed={seed}", "log.progress=false", *extra,
           "--run-dir", str(run_dir)]
    load = os.getloadavg()[0]  # other work on the machine stretches the wall time, not the accuracies
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    summary = json.loads((run_dir / "summary.json").read_text())
    ws, final = summary["warmstart_accuracy"], summary["final_accuracy"]
    return {"seed": seed, "warmstart_accuracy": f"{ws:.3f}", "final_accuracy": f"{final:.3f}",
            "gain_points": f"{100 * (final - ws):.1f}", "warmstart_steps": summary["warmstart_steps"],
            "wall_s": f"{wall:.0f}", "load_1min": f"{load:.1f}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0-9", help="e.g. 0-9 or 0,3,5")
    p.add_argument("--out", default="benchmarks/results/demo_seeds.csv")
    p.add_argument("extra", nargs="*", help="config overrides for every run (key=value)")
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fixed = {"date": datetime.date.today().isoformat(), "commit": commit(), "cpu": cpu_model(),
             "torch": torch.__version__, "kernels": torch.backends.cpu.get_cpu_capability(),
             "args": " ".join(args.extra)}
    new = not out.exists()
    with tempfile.TemporaryDirectory() as tmp, out.open("a", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        if new:
            w.writeheader()
        print(f"{'seed':>4}  {'warm start':>10}  {'final':>6}  {'gain':>6}  {'steps':>5}  {'wall':>6}", flush=True)
        for seed in seeds(args.seeds):
            row = fixed | run_seed(seed, args.extra, Path(tmp))
            w.writerow(row)
            f.flush()
            print(f"{seed:>4}  {float(row['warmstart_accuracy']):>10.1%}  {float(row['final_accuracy']):>6.1%}  "
                  f"{row['gain_points']:>6}  {row['warmstart_steps']:>5}  {row['wall_s']:>5}s  "
                  f"(load {row['load_1min']})", flush=True)


if __name__ == "__main__":
    main()
