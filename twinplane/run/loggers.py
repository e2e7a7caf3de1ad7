"""Metric sinks behind one call: `log(step, metrics)`. Same names everywhere, grouped by prefix
(`time/`, `perf/`, `mem/`, `reward/`, `actor/`, `rollout/`, `val/`), which TensorBoard and W&B show as sections.

Backends (`log.backends`): console (the live line, printed by the run loop), jsonl (`metrics.jsonl`, always on:
resume and `twinplane report` read it), tensorboard (event files in RUN_DIR/tensorboard through the tensorboard
package's writer), wandb (offline by default: `wandb sync` later; set log.wandb_mode=online to stream).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

BACKENDS = ("console", "jsonl", "tensorboard", "wandb")


class TensorBoardLogger:
    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError("log.backends has tensorboard but the tensorboard package is not installed "
                             "(pip install tensorboard)") from None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, run_dir: Path, config: dict, project: str, mode: str):
        try:
            import wandb
        except ImportError:
            raise ValueError("log.backends has wandb but the wandb package is not installed (pip install wandb)") \
                from None
        self.run = wandb.init(project=project, dir=str(run_dir), config=config, mode=mode, name=run_dir.name,
                              resume="allow", id=run_dir.name)

    def log(self, step: int, metrics: dict) -> None:
        self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def close(self) -> None:
        self.run.finish()


def check_backends(backends: list[str]) -> None:
    """Fail before any work when a requested backend's package is missing."""
    for name in ("tensorboard", "wandb"):
        if name in backends and importlib.util.find_spec(name) is None:
            raise ValueError(f"log.backends has {name} but the {name} package is not installed (pip install {name})")


def build_loggers(backends: list[str], run_dir: Path, config: dict, wandb_project: str, wandb_mode: str) -> list:
    """The extra sinks (console and jsonl are handled by the run loop)."""
    out = []
    if "tensorboard" in backends:
        out.append(TensorBoardLogger(run_dir))
    if "wandb" in backends:
        out.append(WandbLogger(run_dir, config, wandb_project, wandb_mode))
    return out
