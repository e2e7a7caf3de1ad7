"""`twinplane report RUN_DIR`: PNG charts and a one-page `report.md` from a run's `metrics.jsonl` (+ `summary.json`).

Works on a finished run and on a running one: unparsable lines (a last line still being written) are skipped, and
without `summary.json` the summary is computed from the metrics so far. A chart whose metrics are all absent is
skipped. Needs matplotlib (`pip install twinplane[report]`); it is imported only when a report is made.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PHASES = ("rollout", "reward", "ref_logprob", "old_logprob", "train", "weight_sync")


class ReportError(ValueError):
    """Bad input (no metrics file, no parsable rows): reported as a one-line error."""


def load_metrics(path: Path) -> list[dict]:
    """Rows of `metrics.jsonl` merged by step (later lines win: a resumed run may log a step twice), sorted by
    step. Lines that are not a JSON object with an int `step` are skipped."""
    if not path.is_file():
        raise ReportError(f"{path}: no such file (is this a twinplane run dir?)")
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            by_step.setdefault(row["step"], {}).update(row)
    if not by_step:
        raise ReportError(f"{path}: no metrics rows yet")
    return [by_step[s] for s in sorted(by_step)]


class Series:
    """One metric over steps: `x` the steps where it was logged, `y` its values (null -> nan)."""

    def __init__(self, rows: list[dict], key: str):
        pairs = [(r["step"], r[key]) for r in rows if key in r]
        self.x = [p[0] for p in pairs]
        self.y = [float(v) if isinstance(v, (int, float)) else math.nan for _, v in pairs]

    def scaled(self, factor: float) -> Series:
        out = Series([], "")
        out.x, out.y = self.x, [factor * v for v in self.y]
        return out

    def __bool__(self) -> bool:  # present with at least one finite value
        return any(math.isfinite(v) for v in self.y)

    def last(self) -> float | None:
        finite = [v for v in self.y if math.isfinite(v)]
        return finite[-1] if finite else None


def smooth(y: list[float], window: int) -> list[float]:
    """Centred moving average over the finite values in each window (nan where a window has none); centred so the
    smoothed line does not lag the raw one."""
    out, half = [], window // 2
    for i in range(len(y)):
        w = [v for v in y[max(0, i - half):i - half + window] if math.isfinite(v)]
        out.append(sum(w) / len(w) if w else math.nan)
    return out


def _window(n: int) -> int:
    return max(1, min(25, n // 10))


def _line(ax, s: Series, label: str, color: str, smoothed: bool = True) -> None:
    """A noisy series: the raw values faint, a moving average on top."""
    if smoothed and len(s.x) >= 10:
        ax.plot(s.x, s.y, color=color, alpha=0.25, linewidth=1)
        ax.plot(s.x, smooth(s.y, _window(len(s.x))), color=color, linewidth=2, label=f"{label} (smoothed)")
    else:
        ax.plot(s.x, s.y, color=color, linewidth=1.5, label=label)


def _legend(*axes) -> None:
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    if handles:  # on the last (top-most) axes, so a twin axis's lines don't draw over it
        axes[-1].legend(handles, labels, loc="best", fontsize=8, framealpha=0.9)


def _right_axis(ax, lines: list[tuple], ylabel: str, top: float | None = None):
    """A dashed second y axis (from 0, to `top` when the quantity has a ceiling) sharing the step axis: `lines`
    are (series, label, color)."""
    ax2 = ax.twinx()
    for s, label, color in lines:
        _line(ax2, s, label, color)
        ax2.lines[-1].set_linestyle("--")
    ax2.set_ylabel(ylabel)
    ax2.set_ylim(bottom=0, top=top)
    return ax2


def _train_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["step"] > 0]


def plot_reward(rows: list[dict], fig) -> bool:
    rows = _train_rows(rows)
    mean, std, acc = Series(rows, "reward/mean"), Series(rows, "reward/std"), Series(rows, "reward/accuracy")
    if not (mean or acc):
        return False
    ax = fig.add_subplot()
    if mean:
        _line(ax, mean, "reward mean", "C0")
        if std and std.x == mean.x:
            w = _window(len(mean.x))
            m, sd = smooth(mean.y, w), smooth(std.y, w)
            # the band stays inside the rewards' range: a 0/1 reward's mean ± std must not draw above 1 or below 0
            floor, ceil = min(0.0, min(mean.y)), max(1.0, max(mean.y))
            lo = [max(a - b, floor) for a, b in zip(m, sd, strict=True)]
            hi = [min(a + b, ceil) for a, b in zip(m, sd, strict=True)]
            ax.fill_between(mean.x, lo, hi, color="C0", alpha=0.15, label="reward ± std")
    if acc:
        _line(ax, acc, "accuracy", "C1")
    ax.set(title="Reward and accuracy (training rollouts)", xlabel="step", ylabel="reward / accuracy")
    _legend(ax)
    return True


def plot_validation(rows: list[dict], fig) -> bool:
    keys = sorted({k for r in rows for k in r if k.startswith("val/") and isinstance(r[k], (int, float))},
                  key=lambda k: (k != "val/accuracy", k))
    series = [(k, Series(rows, k)) for k in keys]
    series = [(k, s) for k, s in series if s]
    if not series:
        return False
    ax = fig.add_subplot()
    # fractions (accuracy, pass@k, mean@k, truncation) on their own 0-1 axis; lengths (tokens) on a second one
    fractions = [(k, s) for k, s in series if "length" not in k and "errors" not in k]
    lengths = [(k, s) for k, s in series if "length" in k]
    for i, (k, s) in enumerate(fractions):
        ax.plot(s.x, s.y, marker="o", color=f"C{i}", label=k[4:])
    ax.set(title="Validation (held-out prompts; step 0 = before RL)", xlabel="step", ylabel="fraction")
    ax.set_ylim(-0.02, 1.02)
    axes = [ax]
    if lengths:
        ax2 = ax.twinx()
        for i, (k, s) in enumerate(lengths, start=len(fractions)):
            ax2.plot(s.x, s.y, marker="s", linestyle="--", color=f"C{i}", label=k[4:])
        ax2.set_ylabel("tokens")
        ax2.set_ylim(bottom=0)
        axes.append(ax2)
    _legend(*axes)
    return True


def plot_step_time(rows: list[dict], fig) -> bool:
    rows = [r for r in _train_rows(rows) if any(k.startswith("time/") for k in r)]
    phases = [p for p in PHASES if Series(rows, f"time/{p}")]
    total = Series(rows, "time/step")
    if not (phases or total):
        return False
    steps = [r["step"] for r in rows]

    def val(r: dict, k: str) -> float:
        v = r.get(k)
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else 0.0

    stacks = {p: [val(r, f"time/{p}") for r in rows] for p in phases}
    if total:
        stacks["other"] = [max(0.0, val(r, "time/step") - sum(val(r, f"time/{p}") for p in phases)) for r in rows]
    ax = fig.add_subplot()
    ax.stackplot(steps, *stacks.values(), labels=list(stacks), alpha=0.85)
    ax.set(title="Step time by phase (stacked)", xlabel="step", ylabel="seconds")
    ax.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return True


def plot_throughput(rows: list[dict], fig) -> bool:
    rows = _train_rows(rows)
    roll, train = Series(rows, "perf/rollout_tokens_per_s"), Series(rows, "perf/train_tokens_per_s")
    mfu = [(k, Series(rows, f"perf/mfu_{k}")) for k in ("rollout", "train")]
    mfu = [(k, s) for k, s in mfu if s]
    if not (roll or train or mfu):
        return False
    ax = fig.add_subplot()
    if roll:
        _line(ax, roll, "rollout tokens/s", "C0")
    if train:
        _line(ax, train, "train tokens/s", "C1")
    for key, label, color in (("prefill", "engine prefill tokens/s", "C4"), ("decode", "engine decode tokens/s", "C5")):
        s = Series(rows, f"perf/{key}_tokens_per_s")
        if s:
            _line(ax, s, label, color)
    ax.set(title="Throughput", xlabel="step", ylabel="tokens / s")
    ax.set_ylim(bottom=0)
    if mfu:
        _legend(ax, _right_axis(ax, [(s.scaled(100), f"MFU {k}", f"C{i + 2}") for i, (k, s) in enumerate(mfu)],
                                "MFU (%)"))
    else:
        ax.text(0.99, 0.02, "MFU unknown for this device", transform=ax.transAxes, ha="right", va="bottom",
                fontsize=8, color="gray")
        _legend(ax)
    return True


def plot_response_length(rows: list[dict], fig) -> bool:
    rows = _train_rows(rows)
    mean, mx = Series(rows, "rollout/response_length_mean"), Series(rows, "rollout/response_length_max")
    trunc = Series(rows, "rollout/truncated")
    if not (mean or mx or trunc):
        return False
    ax = fig.add_subplot()
    if mean:
        _line(ax, mean, "mean length", "C0")
    if mx:
        _line(ax, mx, "max length", "C1")
    ax.set(title="Response length", xlabel="step", ylabel="tokens")
    ax.set_ylim(bottom=0)
    axes = [ax]
    if trunc:
        axes.append(_right_axis(ax, [(trunc.scaled(100), "truncated", "C3")], "truncated (% of responses)"))
    _legend(*axes)
    return True


def plot_kl_entropy(rows: list[dict], fig) -> bool:
    rows = _train_rows(rows)
    panels = [(k, lab, Series(rows, k)) for k, lab in (("actor/kl", "KL to reference"), ("actor/entropy", "entropy"),
                                                         ("actor/clip_frac", "clip fraction"),
                                                         ("actor/logprob_gap", "log-prob gap (rollout vs train)"))]
    panels = [p for p in panels if p[2]]
    if not panels:
        return False
    cols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / cols)
    fig.set_size_inches(9, 3.2 * nrows + 0.6)
    for i, (k, lab, s) in enumerate(panels):
        ax = fig.add_subplot(nrows, cols, i + 1)
        _line(ax, s, lab, f"C{i}")
        off = k == "actor/kl" and all(v == 0 for v in s.y)  # no KL term: say so rather than draw a flat line
        ax.set(title=lab + (" — off (algo.kl_coef=0)" if off else ""), xlabel="step", ylabel=k.split("/")[1])
        _legend(ax)
    fig.suptitle("Policy: KL, entropy, clipping")
    return True


def plot_weight_sync(rows: list[dict], fig) -> bool:
    rows = _train_rows(rows)
    gbps, secs = Series(rows, "sync/gb_per_s"), Series(rows, "time/weight_sync")
    if not gbps:
        return False
    ax = fig.add_subplot()
    _line(ax, gbps, "GB/s", "C0")
    ax.set(title="Weight sync trainer → engines", xlabel="step", ylabel="GB/s (engine-dtype weights)")
    ax.set_ylim(bottom=0)
    axes = [ax]
    if secs:
        axes.append(_right_axis(ax, [(secs, "seconds", "C1")], "seconds per sync"))
    _legend(*axes)
    return True


def plot_engine(rows: list[dict], fig) -> bool:
    """The rollout engine: occupancy and preemptions (left), KV-pool peak usage (right, %)."""
    rows = _train_rows(rows)
    running, pre = Series(rows, "rollout/running_seqs_mean"), Series(rows, "rollout/preemptions")
    usage = Series(rows, "rollout/kv_cache_usage_peak")
    if not (running or usage):
        return False
    ax = fig.add_subplot()
    if running:
        _line(ax, running, "running sequences (mean)", "C0")
    if pre:
        _line(ax, pre, "preemptions", "C3", smoothed=False)
    ax.set(title="Rollout engine", xlabel="step", ylabel="sequences / preemptions per step")
    ax.set_ylim(bottom=0)
    axes = [ax]
    if usage:
        axes.append(_right_axis(ax, [(usage.scaled(100), "KV cache peak usage", "C1")], "KV pool used (%)", 105))
    _legend(*axes)
    return True


@dataclass
class Chart:
    name: str
    plot: Callable[[list[dict], object], bool]
    what: str


CHARTS = [
    Chart("reward.png", plot_reward, "training reward mean (± std band) and accuracy per step"),
    Chart("validation.png", plot_validation, "held-out accuracy (and pass@k / mean@k) at each validation"),
    Chart("step_time.png", plot_step_time, "seconds per step stacked by phase; 'other' = step time not in a phase"),
    Chart("throughput.png", plot_throughput, "rollout and train tokens/s (and the engine's prefill/decode tokens/s), "
          "with MFU when the device's peak is known"),
    Chart("response_length.png", plot_response_length, "mean and max response length, and the truncation rate"),
    Chart("kl_entropy.png", plot_kl_entropy, "KL to the reference, policy entropy, clip fraction, log-prob gap"),
    Chart("weight_sync.png", plot_weight_sync, "weight-sync bandwidth (GB/s) and seconds per sync"),
    Chart("engine.png", plot_engine, "rollout engine: mean running sequences, preemptions, KV pool peak usage"),
]


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def summary_rows(rows: list[dict], summary: dict | None) -> list[tuple[str, str]]:
    """(label, value) pairs for the table: from `summary.json` when the run finished, else from the metrics."""
    train = _train_rows(rows)
    if summary is not None:
        out = [("status", "finished"), ("steps", _fmt(summary.get("steps"))),
               ("warm-start accuracy (step 0)", _fmt(summary.get("warmstart_accuracy"))),
               ("final accuracy", _fmt(summary.get("final_accuracy"))),
               ("held-out prompts", _fmt(summary.get("heldout_size"))),
               ("wall time (s)", _fmt(summary.get("wall_seconds")))]
        phases = summary.get("phase_seconds_mean") or {}
    else:
        val = Series(rows, "val/accuracy")
        out = [("status", f"running: {len(train)} steps so far"),
               ("last step", _fmt(rows[-1]["step"])),
               ("latest reward mean", _fmt(Series(train, "reward/mean").last())),
               ("latest accuracy (training)", _fmt(Series(train, "reward/accuracy").last())),
               ("warm-start accuracy (step 0)", _fmt(rows[0].get("val/accuracy") if rows[0]["step"] == 0 else None)),
               ("latest validation accuracy", _fmt(val.last()) + (f" (step {val.x[-1]})" if val else ""))]
        phases = {}
        for k in [*PHASES, "step"]:
            v = [y for y in Series(train, f"time/{k}").y if math.isfinite(y)]
            if v:
                phases[k] = sum(v) / len(v)
    out += [(f"mean time/{k} (s)", _fmt(v)) for k, v in phases.items()]
    return out


def write_markdown(run_dir: Path, out_dir: Path, table: list[tuple[str, str]], written: list[Chart]) -> Path:
    lines = [f"# twinplane report: `{run_dir}`", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in table]
    lines += ["", "## Charts", ""]
    lines += [f"- `{c.name}`: {c.what}" for c in written]
    for c in written:
        lines += ["", f"![{c.what}]({c.name})"]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def make_report(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write one PNG per chart with data and `report.md` into `out_dir` (default `run_dir/report/`); returns
    the paths written. Raises ReportError when there is no metrics file or no parsable row in it."""
    run_dir = Path(run_dir)
    rows = load_metrics(run_dir / "metrics.jsonl")
    try:
        import matplotlib
    except ImportError as e:
        raise ReportError("the report needs matplotlib: pip install 'twinplane[report]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file there, a read-only run dir, a place no folder can be made
        raise ReportError(f"{out_dir}: cannot make the report folder ({e.strerror})") from None
    summary_path = run_dir / "summary.json"
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    except json.JSONDecodeError:
        summary = None  # being written right now: report it as running
    paths, written = [], []
    for chart in CHARTS:
        fig = plt.figure(figsize=(9, 4.5))
        try:
            if chart.plot(rows, fig):
                fig.tight_layout()
                fig.savefig(out_dir / chart.name, dpi=110)
                paths.append(out_dir / chart.name)
                written.append(chart)
        finally:
            plt.close(fig)
    paths.append(write_markdown(run_dir, out_dir, summary_rows(rows, summary), written))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twinplane report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run dir with metrics.jsonl (finished or still running)")
    parser.add_argument("--out", help="output folder (default RUN_DIR/report)")
    ns = parser.parse_args(argv)
    try:
        paths = make_report(Path(ns.run_dir), Path(ns.out) if ns.out else None)
    except ReportError as e:
        print(f"twinplane: error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
