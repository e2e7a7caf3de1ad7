"""Overlap where agents wait: the demo through a gym-style environment whose step takes 50 ms
(examples/agents/addition_env.py), synchronous against `cluster.max_staleness=2`, side by side in one invocation.

  python benchmarks/agent_overlap.py [--runs 3] [--steps 150] [--out FILE.csv]

One warm start is shared: `twinplane train train.steps=0` once, then every run starts RL from its saved model
(`model.path=... warmstart.steps=0`, the same seed), the variants alternating so that a slow spell of the machine
spreads over both. Per run: the median step time over the steps after the first five, the synchronous runs' share
of the step spent in rollout, and the final held-out accuracy. The summary line per variant is the median over its
runs, with the asynchronous step time as a ratio to the synchronous one.
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

# 4 prompts x 8 episodes a step, so that the engine idles while the environments wait (as a GPU's engine, fast
# beside a 50 ms step, does); one torch thread per Python thread, so that the trainer and the engine, each on a
# core, do not take each other's
ENV = ["agent.entrypoint=examples/agents/addition_env.py:Addition", "rollout.prompts_per_step=4", "threads=1"]
VARIANTS = {"sync (k=0)": ["cluster.max_staleness=0"], "k=2": ["cluster.max_staleness=2"]}


def train(run_dir: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "twinplane.cli", "train", "--run-dir", str(run_dir), "log.progress=false",
           "checkpoint.every=0", *args]
    subprocess.run(cmd, check=True, capture_output=True, cwd=Path(__file__).resolve().parent.parent)


def one_run(model: Path, extra: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        train(Path(d), f"model.path={model}", "warmstart.steps=0", f"train.steps={steps}", *ENV, *extra)
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((Path(d) / "summary.json").read_text())
    later = [r for r in rows if r["step"] >= 6]
    return {"step_s_median": statistics.median(r["time/step"] for r in later),
            "rollout_share": statistics.median(r["time/rollout"] / r["time/step"] for r in later),
            "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in later),
            "start_accuracy": summary.get("warmstart_accuracy"), "final_accuracy": summary.get("final_accuracy"),
            "wall_s": summary["wall_seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--out", type=Path, help="also write every run as CSV rows here")
    a = p.parse_args()
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as d:
        train(Path(d) / "warm", "train.steps=0", "eval.after=false")
        model = Path(d) / "warm" / "final"
        for i in range(a.runs):
            for name, extra in VARIANTS.items():
                r = one_run(model, extra, a.steps)
                results[name].append(r)
                print(f"run {i + 1} {name}: " + ", ".join(f"{k}={v:.4g}" for k, v in r.items()), flush=True)
    base = statistics.median(r["step_s_median"] for r in results["sync (k=0)"])
    for name, runs in results.items():
        step = statistics.median(r["step_s_median"] for r in runs)
        acc = statistics.median(r["final_accuracy"] for r in runs)
        share = statistics.median(r["rollout_share"] for r in runs)
        each = ", ".join(f"{r['final_accuracy']:.1%}" for r in runs)
        print(f"{name}: step {step:.3f} s ({step / base:.2f}x sync), rollout share {share:.0%}, "
              f"final accuracy {acc:.1%} (runs: {each})")
    if a.out:
        new = not a.out.exists()
        with a.out.open("a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["variant", "run", *results["sync (k=0)"][0]])
            for name, runs in results.items():
                for i, r in enumerate(runs):
                    w.writerow([name, i + 1, *(f"{v:.6g}" for v in r.values())])


if __name__ == "__main__":
    main()
