"""Scoring speed: the 164 canonical HumanEval programs through the `code` reward (bwrap sandbox, one sandbox call
per program) against the same programs run as bare `python -I` subprocesses, with the same parallelism,
side by side in one invocation (alternating, so machine load hits both alike). Prints each run and the medians.

    python benchmarks/sandbox_speed.py [--data PATH/HumanEval.jsonl.gz] [--runs 3]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from twinplane.rewards.code import CodeScorer

DEFAULT = Path(os.environ.get("TWINPLANE_DATA", "data")) / "humaneval/HumanEval.jsonl.gz"  # (or --data)


def bare(programs: list[str], workers: int, flags: tuple[str, ...] = ("-I",)) -> float:
    """Each program (prompt + solution + test + check) as `python -I file.py` in a temp dir, no sandbox."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, p in enumerate(programs):
            paths.append(Path(tmp, f"p{i}.py"))
            paths[-1].write_text(p)

        def run(path: Path) -> int:
            return subprocess.run([sys.executable, *flags, str(path)], cwd=tmp, capture_output=True,
                                  timeout=60).returncode

        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            codes = list(pool.map(run, paths))
        wall = time.perf_counter() - t0
    assert codes == [0] * len(programs), "a canonical solution failed when run bare"
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DEFAULT))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--sandbox", default="bwrap")
    args = ap.parse_args()
    rows = [json.loads(line) for line in gzip.open(args.data, "rt")]
    completions = [r["prompt"] + r["canonical_solution"] for r in rows]
    answers = [{"prompt": r["prompt"], "test": r["test"], "entry_point": r["entry_point"]} for r in rows]
    programs = [f"{c}\n{r['test']}\ncheck({r['entry_point']})\n" for c, r in zip(completions, rows, strict=True)]
    scorer = CodeScorer(args.sandbox, workers=args.workers)
    # `python -I` imports site-packages (and runs their .pth files); the sandbox's driver hides them and runs
    # `python -I -S`, so bare `-I -S` is also timed: the pure cost of the namespaces, mounts and driver.
    bare_s, bare_nosite_s, box_s = [], [], []
    for i in range(args.runs):
        bare_s.append(bare(programs, args.workers))
        bare_nosite_s.append(bare(programs, args.workers, ("-I", "-S")))
        t0 = time.perf_counter()
        results = scorer(completions, answers)
        box_s.append(time.perf_counter() - t0)
        assert all(r.reward == 1.0 for r in results), "a canonical solution failed in the sandbox"
        print(f"run {i}: bare python -I {bare_s[-1]:.2f} s, bare python -I -S {bare_nosite_s[-1]:.2f} s, "
              f"sandbox ({args.sandbox}) {box_s[-1]:.2f} s")
    mb, mn, ms = (statistics.median(x) for x in (bare_s, bare_nosite_s, box_s))
    print(json.dumps({"programs": len(rows), "workers": args.workers, "runs": args.runs,
                      "bare_I_median_s": round(mb, 3),
                      "bare_I_S_median_s": round(mn, 3), "sandbox_median_s": round(ms, 3),
                      "sandbox_vs_bare_I": round(ms / mb, 3), "sandbox_vs_bare_I_S": round(ms / mn, 3)}))


if __name__ == "__main__":
    main()
