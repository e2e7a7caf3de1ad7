"""The per-step metrics file and the live console line."""

from __future__ import annotations

import json
import math
from pathlib import Path


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


WIDTH = 100  # the progress line fits a 100-column terminal


def progress_line(step: int, total: int, m: dict) -> str:
    """One RL step in at most 100 columns; fields that are off (no KL term, no tools) are left out."""
    parts = [f"step {step}/{total}", f"reward {m['reward/mean']:.3f}", f"acc {m['reward/accuracy']:.3f}"]
    if m.get("actor/kl"):
        parts.append(f"kl {m['actor/kl']:.4f}")
    if m.get("rollout/tool_calls_mean"):
        parts.append(f"tools {m['rollout/tool_calls_mean']:.2f}")
    if m.get("reward/errors"):
        parts.append(f"reward errors {m['reward/errors']:.0f}")
    parts.append(f"len {m['rollout/response_length_mean']:.1f}")
    parts.append(f"{m['perf/rollout_tokens_per_s']:.0f}/{m['perf/train_tokens_per_s']:.0f} tok/s")
    parts.append(f"{m['time/step']:.2f}s/step")
    return "  ".join(parts)[:WIDTH]


class LiveLine:
    """Progress that a person can follow: on a terminal one line rewritten in place (other messages print above
    it); without one (a log file, CI), a line every `every` steps and at the last. `enabled=False`: silent."""

    def __init__(self, console, enabled: bool = True, every: int = 10):
        self.console, self.enabled, self.every = console, enabled, every
        self.terminal = console.is_terminal
        self.active = False

    def update(self, i: int, total: int, text: str) -> None:
        if not self.enabled:
            return
        if self.terminal:
            self.console.file.write("\r\x1b[2K" + text[:WIDTH])
            self.console.file.flush()
            self.active = True
        elif i % self.every == 0 or i == total:
            self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def print(self, text: str) -> None:
        self.done()
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def done(self) -> None:
        if self.active:
            self.console.file.write("\n")
            self.console.file.flush()
            self.active = False


def summary_table(summary: dict, run_dir: Path):
    """The final summary as a small table (summary.json keeps every field)."""
    from rich.table import Table

    t = Table(title=f"twinplane: run finished ({run_dir})", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    for key, label in (("warmstart_accuracy", "accuracy before RL"), ("final_accuracy", "accuracy after RL")):
        if summary.get(key) is not None:
            t.add_row(label, f"{summary[key]:.1%}")
    t.add_row("held-out prompts", str(summary.get("heldout_size")))
    t.add_row("RL steps", str(summary.get("steps")))
    t.add_row("wall time", f"{summary.get('wall_seconds', 0.0):.1f} s")
    phases = summary.get("phase_seconds_mean") or {}
    if phases.get("step"):
        t.add_row("mean step", f"{phases['step']:.3f} s")
    t.add_row("files", "summary.json, metrics.jsonl, final/, checkpoints/")
    return t
