"""A run dir belongs to one run: claimed at start, never silently overwritten, damaged checkpoints set aside.

What a run writes into `RUN_DIR` (docs/configuration.md, `train --help`):
  config.yaml      the resolved config (written first: it marks the folder as holding a run)
  metrics.jsonl    one JSON object per step (step 0: validation before RL)
  checkpoints/     step_NNNNNNNN/ full-state checkpoints; .tmp-* while one is written; quarantine/ damaged ones
  final/           the trained policy as a Hugging Face model folder
  summary.json     the result (accuracies, steps, wall time, mean phase times)
  tensorboard/, wandb/   with log.backends=tensorboard / wandb
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from twinplane.errors import InputError

MARKERS = ("config.yaml", "metrics.jsonl", "summary.json", "final", "checkpoints")


class RunFinished(Exception):
    """A resume found the run dir's run finished at the steps asked for: nothing to do (exit code 0)."""


def finished_steps(run_dir: Path) -> int | None:
    """The RL steps of the finished run in `run_dir` (its summary.json, written last), else None."""
    try:
        steps = json.loads((run_dir / "summary.json").read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def holds_run(run_dir: Path) -> list[str]:
    """The run files present in `run_dir` (empty: the folder is free)."""
    return [m for m in MARKERS if (run_dir / m).exists()] if run_dir.is_dir() else []


def check_usable(run_dir: Path) -> None:
    """The run dir is a folder we can create and write (checked before any work, so nothing is lost to it)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(f"--run-dir {run_dir}: exists and is not a folder")
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"--run-dir {run_dir}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"--run-dir {run_dir}: {existing} is not writable")


def _aside_name(path: Path, tag: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out, i = path.with_name(f"{path.name}.{tag}-{stamp}"), 1
    while out.exists():
        i += 1
        out = path.with_name(f"{path.name}.{tag}-{stamp}-{i}")
    return out


def set_aside(run_dir: Path, delete: bool, log=print) -> Path | None:
    """`--overwrite`: move the earlier run to `RUN_DIR.replaced-<time>` (or delete it with `--delete-old`)."""
    if delete:
        shutil.rmtree(run_dir)
        log(f"--overwrite --delete-old: deleted the earlier run in {run_dir}")
        return None
    dest = _aside_name(run_dir, "replaced")
    os.replace(run_dir, dest)
    log(f"--overwrite: moved the earlier run in {run_dir} to {dest}")
    return dest


def respect_umask(folder: Path) -> None:
    """Give every file under `folder` the mode the umask asks for (safetensors writes 0600 whatever the umask),
    so all of a run's files have the same permissions."""
    mask = os.umask(0)
    os.umask(mask)
    for p in [folder, *folder.rglob("*")] if folder.is_dir() else [folder]:
        if p.is_file():
            os.chmod(p, 0o666 & ~mask)


def quarantine(ckpt: Path, reason: str, log=print) -> Path:
    """Move a damaged checkpoint to `checkpoints/quarantine/` (kept for inspection, never resumed or pruned)."""
    folder = ckpt.parent / "quarantine"
    folder.mkdir(exist_ok=True)
    dest = folder / ckpt.name
    if dest.exists():
        dest = _aside_name(dest, "again")
    os.replace(ckpt, dest)
    log(f"checkpoint {ckpt} is {reason}: moved to {dest}")
    return dest
