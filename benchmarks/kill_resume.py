"""Kill a run at random points across its whole life and resume it; every resumed run must end bitwise equal.

    python benchmarks/kill_resume.py [--kills 6] [--seed 0] [--signal TERM|INT|KILL] [--exactly-once] [key=value ...]

Preemption points are drawn from every phase of a small demo-shaped run: model loading, warm-start steps,
validation before RL and mid-run, every RL phase (rollout, reward, train, weight_sync, checkpoint) at every step,
and the final save. Each kill is a real signal to a real `twinplane train` process (TWINPLANE_FAULT), followed by
`--resume auto` until the run finishes; the final weights' sha256 is compared with an uninterrupted run's. SIGKILL
leaves no emergency checkpoint: the run continues from its last periodic one. An asynchronous run
(`cluster.max_staleness=k`) is also checked for exactly-once accounting: the prompts trained on, filtered and still
outstanding in the last checkpoint are each prompt drawn from the data order once, and the prompts trained on are
the uninterrupted run's. `--exactly-once`: only that accounting is required, for runs that are not reproducible
(free-running asynchronous RL on Ray).
"""

from __future__ import annotations

import argparse
import hashlib
import json
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


def accounting(run: Path) -> tuple[bool, list[int]]:
    """(every prompt drawn is trained, filtered or outstanding exactly once; the prompts trained, in order)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [d for r in rows for d in r.get("data/draws", [])]
    filtered = [d for r in rows for d in r.get("data/draws_filtered", [])]
    last = sorted((run / "checkpoints").glob("step_*"))[-1]
    p = json.loads((last / "state.json").read_text())["controller"]["producer"]
    outstanding = [g["draw"] for key in ("in_flight", "finished", "ready") for g in p[key]]
    everything = trained + filtered + outstanding
    return sorted(everything) == list(range(len(everything))), trained


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--signal", default="TERM", choices=["TERM", "INT", "KILL"])
    ap.add_argument("--exactly-once", action="store_true", help="require only exactly-once accounting")
    ap.add_argument("extra", nargs="*")
    ns = ap.parse_args()
    asynchronous = any(e.startswith("cluster.max_staleness=") and not e.endswith("=0") for e in ns.extra)
    points = ["load@0", *(f"warmstart@{i}" for i in range(1, 7)), "eval@0", "eval@3", "eval@6", "final@6",
              *(f"{p}@{s}" for s in range(1, 7) for p in ("rollout", "reward", "train", "weight_sync")
                if not (asynchronous and p == "reward")),  # (asynchronous: rewards are part of the rollout phase)
              *(f"checkpoint@{s}" for s in (2, 4, 6))]
    picks = random.Random(ns.seed).sample(points, ns.kills)
    base = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    code, err = train(base / "uninterrupted", ns.extra, None, ns.signal)
    assert code == 0, err
    want = weights(base / "uninterrupted")
    want_trained = accounting(base / "uninterrupted")[1] if asynchronous else None
    print(f"uninterrupted: exit 0, final weights sha256 {want} ({time.perf_counter() - t0:.0f}s)")
    extra_col = (" exactly once |" if ns.exactly_once else " exactly once, same prompts |") if asynchronous else ""
    print(f"| kill point | signal | exit | traceback | resumes | final weights | equal |{extra_col}\n"
          f"|---|---|---|---|---|---|---|{'---|' if asynchronous else ''}")
    ok = True
    for i, fault in enumerate(picks):
        run = base / f"k{i}"
        code, err = train(run, ns.extra, fault, ns.signal)
        first, tb, resumes = code, "Traceback" in err, 0
        while code in (75, -9):  # preempted (checkpoint written), or killed (continue from the last periodic one)
            code, err2 = train(run, [*ns.extra, "--resume", "auto"], None, ns.signal)
            tb, resumes = tb or "Traceback" in err2, resumes + 1
        got = weights(run) if code == 0 else "-"
        ok &= (got == want or ns.exactly_once) and not tb
        once = ""
        if asynchronous:
            exact, trained = accounting(run) if code == 0 else (False, None)
            exact &= ns.exactly_once or trained == want_trained
            ok &= exact
            once = f" {'yes' if exact else 'NO'} |"
        print(f"| {fault} | SIG{ns.signal} | {first} | {'yes' if tb else 'no'} | {resumes} | {got} | "
              f"{'yes' if got == want else 'NO'} |{once}")
    print(f"all equal: {ok} ({time.perf_counter() - t0:.0f}s in all)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
