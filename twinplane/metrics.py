"""Phase timers, the per-step metrics file and the live console line."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from twinplane.platform import peak_memory_bytes, reset_peak_memory, synchronize


class PhaseTimer:
    """`with timer("rollout"): ...` records seconds under `time/rollout` (device work included)."""

    def __init__(self, device: torch.device, on_enter=None):
        self.device, self.on_enter = device, on_enter  # on_enter(phase): a hook (fault injection in tests)
        self.times: dict[str, float] = {}
        self.memory: dict[str, float] = {}  # peak memory per phase (device memory on GPU, process RSS on CPU)

    @contextmanager
    def __call__(self, phase: str):
        if self.on_enter is not None:
            self.on_enter(phase)
        synchronize(self.device)
        reset_peak_memory(self.device)
        t0 = time.perf_counter()
        yield
        synchronize(self.device)
        self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + time.perf_counter() - t0
        if phase != "step":  # the step's peak is the max of its phases
            self.memory[f"mem/peak_gb_{phase}"] = peak_memory_bytes(self.device) / 1e9


class MetricsLog:
    """Appends one JSON object per step to `metrics.jsonl`; NaN/inf are written as null."""

    def __init__(self, path: Path, keep_through_step: int | None = None):
        """A fresh log, or on resume the existing one cut back to the records of steps <= `keep_through_step`
        (a run killed after logging a step but before checkpointing it will log that step again)."""
        self.path = path
        kept = []
        if keep_through_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= keep_through_step:
                        kept.append(line + "\n")
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line cut short by the kill
        path.write_text("".join(kept))
        self.file = path.open("a")

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def progress_line(step: int, total: int, m: dict) -> str:
    phases = " ".join(f"{k[5:]}={v:.2f}s" for k, v in m.items() if k.startswith("time/") and k != "time/step")
    return (f"step {step}/{total}  reward={m['reward/mean']:.3f} acc={m['reward/accuracy']:.3f} "
            f"kl={m.get('actor/kl', 0.0):.4f} gap={m.get('actor/logprob_gap', 0.0):.1e} "
            f"rollout={m['perf/rollout_tokens_per_s']:.0f}tok/s train={m['perf/train_tokens_per_s']:.0f}tok/s  "
            f"step={m['time/step']:.2f}s [{phases}]")
