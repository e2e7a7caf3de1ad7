"""`twinplane report RUN_DIR`: PNG charts and a one-page `report.md` from a run's `metrics.jsonl` (+ `summary.json`).

Works on a finished run and on a running one: unparsable lines (a last line still being written) are skipped, and
without `summary.json` the summary is computed from the metrics so far. A chart whose metrics are all absent is
skipped. Needs matplotlib (`pip install twinplane[report]`); it is imported only when a report is made.

Rules every chart follows, so that what it shows is what the run did:
- one unit per panel and no twin axes (a second unit gets a panel below, sharing the step axis), and one unit per
  quantity on every chart (`unit`: every rate, e.g. accuracy, truncation, MFU, KV pool usage, is in percent);
- a series equal to one already drawn in its panel is drawn once (reward mean = accuracy for a 0/1 reward), and a
  series that is the same at every step is a note, not a line lying on an axis ("preemptions: 0 at every step"),
  with the configuration that makes it so where the run's config.yaml says (KL off: algo.kl_coef=0);
- legends and notes sit outside the data, right of the panel.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from twinplane.tools.charts import (
    Panel,
    Series,
    Spec,
    in_chart_unit,
    same_series,
    short_number,
    smooth,
    smooth_window,
    stacked,
)

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


def load_config(run_dir: Path) -> dict:
    """The run's config.yaml as nested dicts ({} when absent or unreadable): only to explain flat panels and to
    draw the staleness bound. A key twinplane has removed since the run, where it changed the run, is the
    ReportError an unknown key gets (the panels would read the wrong setting)."""
    import yaml

    # (here, not at the top: the config loads torch, which a report of a run without one never needs)
    from twinplane.config import ConfigError, without_removed

    path = run_dir / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    try:
        return without_removed(cfg, str(path))
    except ConfigError as e:
        raise ReportError(str(e)) from None


def _train_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["step"] > 0]


def _cfg(config: dict, dotted: str, default=None):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def plot_reward(rows: list[dict], fig, config: dict) -> bool:
    """Reward mean over the step's samples, and accuracy (%). With a 0/1 reward they are the same curve: drawn
    once, and the std (then sqrt(p(1-p)), set by the mean) is left out; otherwise reward (± std) and accuracy get
    a panel each."""
    rows = _train_rows(rows)
    mean, std, acc = Series(rows, "reward/mean"), Series(rows, "reward/std"), in_chart_unit(rows, "reward/accuracy")
    if not (mean or acc):
        return False
    if mean and acc and same_series(Series(rows, "reward/mean", 100.0), acc):
        def one(p: Panel) -> None:
            p.add(acc, "accuracy = reward mean (0/1 reward)", "C1")
            p.notes.append("reward std not drawn: for a 0/1 reward it is sqrt(p(1-p)), set by the mean")
        return stacked(fig, [Spec("accuracy (%)", "%", one)], "Training rollouts: accuracy")

    def reward(p: Panel) -> None:
        p.add(mean, "reward mean", "C0")
        if p.drawn and std and std.x == mean.x:
            w = smooth_window(len(mean.x))
            m, sd = smooth(mean.y, w), smooth(std.y, w)
            floor, ceil = min(0.0, *mean.finite()), max(1.0, *mean.finite())  # a 0/1 reward stays in [0, 1]
            p.ax.fill_between(mean.x, [max(a - b, floor) for a, b in zip(m, sd, strict=True)],
                              [min(a + b, ceil) for a, b in zip(m, sd, strict=True)], color="C0", alpha=0.1,
                              linewidth=0, label="± std over the step's samples")
    specs = [Spec("reward", "", reward, (None, None)),
             Spec("accuracy (%)", "%", lambda p: p.add(acc, "accuracy", "C1"))]
    return stacked(fig, specs, "Training rollouts: reward and accuracy")


def plot_validation(rows: list[dict], fig, config: dict) -> bool:
    keys = sorted({k for r in rows for k in r if k.startswith("val/") and isinstance(r[k], (int, float))},
                  key=lambda k: (k != "val/accuracy", k))
    series = [(k, in_chart_unit(rows, k)) for k in keys if "errors" not in k]
    series = [(k, s) for k, s in series if s]
    if not series:
        return False
    colors = {k: f"C{i}" for i, (k, _) in enumerate(series)}

    def group(pred) -> Callable[[Panel], None]:
        def fill(p: Panel) -> None:
            for k, s in series:
                if pred(k):
                    p.add(s, k[4:].replace("_", " "), colors[k], marker="o")
        return fill
    specs = [Spec("accuracy (%)", "%", group(lambda k: not ("length" in k or "truncated" in k)), every="validation"),
             Spec("response length (tokens)", " tokens", group(lambda k: "length" in k), every="validation"),
             Spec("truncated (% of responses)", "%", group(lambda k: "truncated" in k), every="validation")]
    return stacked(fig, specs, "Validation (held-out prompts; step 0 = before RL)")


def plot_step_time(rows: list[dict], fig, config: dict) -> bool:
    rows = [r for r in _train_rows(rows) if any(k.startswith("time/") for k in r)]
    logged = sorted({k[5:] for r in rows for k in r if k.startswith("time/") and k != "time/step"})
    phases = [p for p in [*PHASES, *(k for k in logged if k not in PHASES)]  # (algorithms add phases: PPO's critic)
              if Series(rows, f"time/{p}")]
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
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0, fontsize=8,
              frameon=False)
    return True


def plot_throughput(rows: list[dict], fig, config: dict) -> bool:
    """Tokens/s, and MFU (%) in a panel of its own: MFU is tokens/s times a constant (FLOPs per token / peak), so
    on a twin axis it would lie exactly on its tokens/s line."""
    rows = _train_rows(rows)
    tps = [(Series(rows, f"perf/{k}_tokens_per_s"), label, c) for k, label, c in (
        ("rollout", "rollout tokens/s", "C0"), ("train", "train tokens/s", "C1"),
        ("prefill", "engine prefill tokens/s", "C4"), ("decode", "engine decode tokens/s", "C5"))]
    mfu = [(in_chart_unit(rows, f"perf/mfu_{k}"), f"MFU {k}", c) for k, c in (("rollout", "C0"), ("train", "C1"))]
    if not any(s for s, _, _ in tps + mfu):
        return False

    def speed(p: Panel) -> None:
        for s, label, c in tps:
            p.add(s, label, c)
        if not any(s for s, _, _ in mfu):
            p.notes.append("MFU unknown for this device (no peak FLOP/s)")

    def util(p: Panel) -> None:
        for s, label, c in mfu:
            p.add(s, label, c)
    return stacked(fig, [Spec("tokens / s", " tokens/s", speed), Spec("MFU (%)", "%", util)], "Throughput")


def plot_response_length(rows: list[dict], fig, config: dict) -> bool:
    rows = _train_rows(rows)
    mean, mx = Series(rows, "rollout/response_length_mean"), Series(rows, "rollout/response_length_max")
    trunc = in_chart_unit(rows, "rollout/truncated")
    if not (mean or mx or trunc):
        return False

    def lengths(p: Panel) -> None:
        p.add(mean, "mean length", "C0")
        p.add(mx, "max length", "C1")
    specs = [Spec("response length (tokens)", " tokens", lengths),
             Spec("truncated (% of responses)", "%", lambda p: p.add(trunc, "truncated", "C3"))]
    return stacked(fig, specs, "Response length (training rollouts)")


def _zero_because(config: dict) -> dict[str, str]:
    """The configuration that keeps a policy metric at 0, where it does."""
    out = {}
    if _cfg(config, "algo.kl_coef") == 0 and not _cfg(config, "algo.kl_in_reward", False):
        out["actor/kl"] = "off: algo.kl_coef=0"
    if _cfg(config, "train.mini_batches") == 1:
        out["actor/clip_frac"] = "one update per batch, so the ratio to the old policy is 1: train.mini_batches=1"
    return out


def plot_kl_entropy(rows: list[dict], fig, config: dict) -> bool:
    rows = _train_rows(rows)
    because = _zero_because(config)

    def fill(s: Series, label: str, color: str, why: str) -> Callable[[Panel], None]:
        return lambda p: p.add(s, label, color, zero_because=why)
    specs = []
    for i, (k, label, ylabel, u) in enumerate((
            ("actor/kl", "KL to reference", "KL (nats / token)", " nats"),
            ("actor/entropy", "entropy", "entropy (nats / token)", " nats"),
            ("actor/clip_frac", "clip fraction", "clipped (% of tokens)", "%"),
            ("actor/logprob_gap", "log-prob gap (rollout vs train)", "mean |Δ log p| / token", ""),
            ("actor/tis_weight_mean", "TIS weight (mean)", "π_old / π_rollout", ""),  # asynchronous RL's correction
            ("actor/tis_clip_frac", "TIS weights capped", "capped (% of tokens)", "%"))):
        s = in_chart_unit(rows, k)
        if s:
            specs.append(Spec(ylabel, u, fill(s, label, f"C{i}", because.get(k, ""))))
    tis = ", truncated importance weights" if Series(rows, "actor/tis_weight_mean") else ""
    title = f"Policy: KL, entropy, clipping, log-prob gap{tis}"
    return bool(specs) and stacked(fig, specs, title)


def plot_weight_sync(rows: list[dict], fig, config: dict) -> bool:
    rows = _train_rows(rows)
    gbps, secs = Series(rows, "sync/gb_per_s"), Series(rows, "time/weight_sync")
    if not gbps:
        return False
    adapters = _cfg(config, "train.lora.rank", 0) and not _cfg(config, "rollout.lora_merge", False)
    what = "fp32 LoRA adapters" if adapters else "engine-dtype weights"
    specs = [Spec(f"GB/s ({what})", " GB/s", lambda p: p.add(gbps, "bandwidth", "C0")),
             Spec("seconds per sync", " s", lambda p: p.add(secs, "duration", "C1"))]
    return stacked(fig, specs, "Weight sync trainer → engines")


def plot_engine(rows: list[dict], fig, config: dict) -> bool:
    """The rollout engine: occupancy, preemptions, KV-pool peak usage (%)."""
    rows = _train_rows(rows)
    running, pre = Series(rows, "rollout/running_seqs_mean"), Series(rows, "rollout/preemptions")
    usage = in_chart_unit(rows, "rollout/kv_cache_usage_peak")
    if not (running or usage):
        return False
    specs = [Spec("sequences", "", lambda p: p.add(running, "running sequences (mean)", "C0")),
             Spec("preemptions per step", "", lambda p: p.add(pre, "preemptions", "C3", smoothed=False,
                                                              zero_because="the KV pool held every sequence")),
             Spec("KV pool used (%)", "%", lambda p: p.add(usage, "KV cache peak usage", "C1"), (0, 105))]
    return stacked(fig, specs, "Rollout engine")


ASYNC_SECONDS = (("rollout_busy_s", "rollout plane busy", "C0", "-"),
                 ("rollout_idle_s", "rollout plane idle", "C0", ":"),
                 ("train_busy_s", "train plane busy", "C1", "-"),
                 ("train_idle_s", "train plane idle", "C1", ":"),
                 ("overlap_s", "both planes busy (overlap)", "C2", "-"))
ASYNC_GROUPS = (("groups_regenerated", "regenerated (too stale)", "C3"),
                ("groups_filtered", "filtered (dynamic sampling)", "C4"),
                ("groups_waiting", "left waiting after the batch", "C5"))
_STALE_FRAC = re.compile(r"async/staleness_frac_(\d+)$")


def _async_keys(rows: list[dict]) -> list[str]:
    """The `async/` metrics the async chart draws, as logged by an asynchronous run."""
    fixed = ["async/staleness_mean", "async/staleness_max", "async/tokens_in_flight_at_sync",
             *(f"async/{k}" for k, *_ in ASYNC_SECONDS + ASYNC_GROUPS)]
    return fixed + _stale_fracs(rows)


def _stale_fracs(rows: list[dict]) -> list[str]:
    """`async/staleness_frac_<s>` keys logged by the run, by s (which s are there varies with the run)."""
    return sorted({k for r in rows for k in r if _STALE_FRAC.match(k)}, key=lambda k: int(_STALE_FRAC.match(k)[1]))


def _stale_label(s: int) -> str:
    return f"{s} version{'' if s == 1 else 's'} stale" + (" (fresh)" if s == 0 else "")


def plot_async(rows: list[dict], fig, config: dict) -> bool:
    """An asynchronous run: staleness of the trained samples (policy versions, with the cluster.max_staleness
    bound, and the per-step histogram in % of the trained groups), seconds each plane was busy or idle and both
    at once next to the step's wall time, and the groups regenerated, filtered or left waiting, and the tokens
    in flight at each weight update."""
    rows = _train_rows(rows)
    if not any(in_chart_unit(rows, k) for k in _async_keys(rows)):
        return False
    bound = _cfg(config, "cluster.max_staleness")
    bound = bound if isinstance(bound, (int, float)) and not isinstance(bound, bool) else None
    mean, mx = Series(rows, "async/staleness_mean"), Series(rows, "async/staleness_max")
    top = max([*mean.finite(), *mx.finite(), *([bound] if bound is not None else [])], default=0.0)

    def versions(p: Panel) -> None:
        p.add(mean, "staleness mean", "C0", smoothed=False)
        p.add(mx, "staleness max", "C3", smoothed=False)
        if bound is None:
            p.notes.append("bound not in config.yaml (cluster.max_staleness)")
        elif p.drawn:
            p.ax.axhline(bound, color="0.35", linestyle="--", linewidth=1.2,
                         label=f"bound: cluster.max_staleness={short_number(bound)}")
        else:
            p.notes.append(f"bound: cluster.max_staleness={short_number(bound)}")

    def histogram(p: Panel) -> None:
        """Stacked in % of the step's trained groups, freshest at the bottom; a band at 0% on every step is a
        note, and a histogram the same at every step is notes only."""
        bands = [(int(_STALE_FRAC.match(k)[1]), in_chart_unit(rows, k)) for k in _stale_fracs(rows)]
        bands = [(s, ser) for s, ser in bands if ser]
        for s, ser in bands:
            if ser.constant() == 0:
                p.notes.append(f"{_stale_label(s)}: 0% at every step")
        bands = [(s, ser) for s, ser in bands if ser.constant() != 0]
        if not bands:
            return
        if all(ser.constant() is not None for _, ser in bands):
            for s, ser in bands:
                p.add(ser, _stale_label(s), "C0")
            return
        import matplotlib

        steps = sorted({x for _, ser in bands for x in ser.x})
        at = [dict(zip(ser.x, ser.y, strict=True)) for _, ser in bands]
        ys = [[v if math.isfinite(v := a.get(x, 0.0)) else 0.0 for x in steps] for a in at]
        cum = [[sum(col[:i]) for col in zip(*ys, strict=True)] for i in range(len(ys) + 1)]
        cmap, most = matplotlib.colormaps["YlOrRd"], max(1, bands[-1][0])
        for i in reversed(range(len(bands))):  # (top band first: the legend reads as the stack does)
            color, label = cmap(0.15 + 0.75 * bands[i][0] / most), _stale_label(bands[i][0])
            if len(steps) > 1:
                p.ax.fill_between(steps, cum[i], cum[i + 1], color=color, linewidth=0, label=label)
            else:  # (an area over one step has no width)
                p.ax.bar(steps, ys[i], bottom=cum[i], width=0.6, color=color, label=label)
        p.drawn += [(ser, _stale_label(s)) for s, ser in bands]

    def seconds(p: Panel) -> None:
        for k, label, color, style in ASYNC_SECONDS:
            p.add(Series(rows, f"async/{k}"), label, color, linestyle=style)
        p.add(Series(rows, "time/step"), "step (wall)", "0.2")

    def groups(p: Panel) -> None:
        import matplotlib.ticker

        for k, label, color in ASYNC_GROUPS:
            p.add(Series(rows, f"async/{k}"), label, color, smoothed=False)
        p.ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # (whole groups)

    tokens = Series(rows, "async/tokens_in_flight_at_sync")
    specs = [Spec("staleness (policy versions)", " versions", versions, (0, 1.08 * top if top > 0 else None)),
             Spec("trained groups (%)", "%", histogram, (0, 100)),
             Spec("seconds per step", " s", seconds),
             Spec("groups per step", "", groups),
             Spec("tokens", " tokens", lambda p: p.add(tokens, "in flight at the weight update", "C6"))]
    return stacked(fig, specs, "Asynchronous RL: staleness, overlap of the planes, groups")


@dataclass
class Chart:
    name: str
    plot: Callable[[list[dict], object, dict], bool]
    what: str


CHARTS = [
    Chart("reward.png", plot_reward, "training accuracy (%) and reward mean per step (one line when they are equal)"),
    Chart("validation.png", plot_validation, "held-out accuracy (and pass@k / mean@k), response length and truncation "
          "at each validation"),
    Chart("step_time.png", plot_step_time, "seconds per step stacked by phase; 'other' = step time not in a phase"),
    Chart("throughput.png", plot_throughput, "rollout and train tokens/s (and the engine's prefill/decode tokens/s); "
          "MFU (%) below when the device's peak is known"),
    Chart("response_length.png", plot_response_length, "mean and max response length, and the truncation rate (%)"),
    Chart("kl_entropy.png", plot_kl_entropy, "KL to the reference, policy entropy, clip fraction, log-prob gap, and "
          "the truncated importance weights of an async run"),
    Chart("weight_sync.png", plot_weight_sync, "weight-sync bandwidth (GB/s) and seconds per sync"),
    Chart("engine.png", plot_engine, "rollout engine: mean running sequences, preemptions, KV pool peak usage (%)"),
    Chart("async.png", plot_async, "asynchronous RL: staleness of the trained samples (policy versions, against "
          "cluster.max_staleness, and % of groups per staleness), seconds each plane was busy or idle and both at "
          "once, groups regenerated / filtered / waiting, tokens in flight at each weight update"),
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
            v = Series(train, f"time/{k}").finite()
            if v:
                phases[k] = sum(v) / len(v)
    out += [(f"mean time/{k} (s)", _fmt(v)) for k, v in phases.items()]
    return out


def async_rows(rows: list[dict], config: dict) -> list[tuple[str, str]]:
    """Table rows of an asynchronous run (none for a synchronous one): the staleness trained on against its
    bound, and how long both planes were busy at once."""
    train, out = _train_rows(rows), []
    mean, mx = Series(train, "async/staleness_mean").finite(), Series(train, "async/staleness_max").finite()
    if mean or mx:
        bound = _cfg(config, "cluster.max_staleness")
        parts = ([f"mean {_fmt(sum(mean) / len(mean))}"] if mean else []) + ([f"max {_fmt(max(mx))}"] if mx else [])
        out.append(("async: staleness trained on (policy versions)", ", ".join(parts)
                    + (f" (bound: cluster.max_staleness={bound})" if bound is not None else "")))
    overlap = Series(train, "async/overlap_s").finite()
    if overlap:
        value = _fmt(sum(overlap) / len(overlap))
        both = [r for r in train if all(isinstance(r.get(k), (int, float)) and math.isfinite(r[k])
                                        for k in ("async/overlap_s", "time/step"))]
        wall = sum(r["time/step"] for r in both)
        if wall > 0:
            value += f" ({100 * sum(r['async/overlap_s'] for r in both) / wall:.0f}% of the step time)"
        out.append(("async: both planes busy, mean (s per step)", value))
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
    config = load_config(run_dir)
    paths, written = [], []
    for chart in CHARTS:
        fig = plt.figure(figsize=(9, 4.5))
        try:
            if chart.plot(rows, fig, config):
                fig.savefig(out_dir / chart.name, dpi=110, bbox_inches="tight")  # (legends outside the axes)
                paths.append(out_dir / chart.name)
                written.append(chart)
        finally:
            plt.close(fig)
    table = summary_rows(rows, summary) + async_rows(rows, config)
    paths.append(write_markdown(run_dir, out_dir, table, written))
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
