"""Kill a run at random points across its whole life and resume it; every resumed run must end bitwise equal.

    python benchmarks/kill_resume.py [--kills 6] [--seed 0] [--signal TERM|INT] [key=value ...]

Preemption points are drawn from every phase of a small demo-shaped run: model loading, warm-start steps,
validation before RL and mid-run, every RL phase (rollout, reward, train, weight_sync, checkpoint) at every step,
and the final save. Each kill is a real signal to a real `twinplane train` process (TWINPLANE_FAULT), followed by
`--resume auto` until the run finishes; the final weights' sha256 is compared with an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARGS = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "warmstart.steps=6",
        "train.steps=6", "rollout.prompts_per_step=4", "rollout.n=4", "task.heldout_size=12", "log.progress=false",
        "checkpoint.every=2", "eval.every=3", "algo.kl_coef=0.05"]


def train(run: Path, extra: list[str], fault: str | None, sig: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWINPLANE_FAULT")}
    if fault:
        env |= {"TWINPLANE_FAULT": fault, "TWINPLANE_FAULT_SIGNAL": sig}
    out = subprocess.run([sys.executable, "-m", "twinplane.cli", "train", "--run-dir", str(run), *ARGS, *extra],
                         env=env, capture_output=True, text=True)
    return out.returncode, out.stderr


def weights(run: Path) -> str:
    return hashlib.sha256((run / "final" / "model.safetensors").read_bytes()).hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--signal", default="TERM", choices=["TERM", "INT"])
    ap.add_argument("extra", nargs="*")
    ns = ap.parse_args()
    points = ["load@0", *(f"warmstart@{i}" for i in range(1, 7)), "eval@0", "eval@3", "eval@6", "final@6",
              *(f"{p}@{s}" for s in range(1, 7) for p in ("rollout", "reward", "train", "weight_sync")),
              *(f"checkpoint@{s}" for s in (2, 4, 6))]
    picks = random.Random(ns.seed).sample(points, ns.kills)
    base = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    code, err = train(base / "uninterrupted", ns.extra, None, ns.signal)
    assert code == 0, err
    want = weights(base / "uninterrupted")
    print(f"uninterrupted: exit 0, final weights sha256 {want} ({time.perf_counter() - t0:.0f}s)")
    print("| kill point | signal | exit | traceback | resumes | final weights | equal |\n|---|---|---|---|---|---|---|")
    ok = True
    for i, fault in enumerate(picks):
        run = base / f"k{i}"
        code, err = train(run, ns.extra, fault, ns.signal)
        first, tb, resumes = code, "Traceback" in err, 0
        while code == 75:
            code, err2 = train(run, [*ns.extra, "--resume", "auto"], None, ns.signal)
            tb, resumes = tb or "Traceback" in err2, resumes + 1
        got = weights(run) if code == 0 else "-"
        ok &= got == want and not tb
        print(f"| {fault} | SIG{ns.signal} | {first} | {'yes' if tb else 'no'} | {resumes} | {got} | "
              f"{'yes' if got == want else 'NO'} |")
    print(f"all equal: {ok} ({time.perf_counter() - t0:.0f}s in all)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
