"""The drawing rules every chart of `twinplane report` follows: one unit per metric (`unit`: every rate in percent),
a metric as a `Series` over steps, panels that turn a constant series or a repeat of a drawn one into a note
(`Panel`), and panels stacked on one step axis (`stacked`). matplotlib is imported only when a panel is drawn."""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

# metrics that are a fraction of something (samples, tokens, peak FLOPs, KV blocks): drawn in percent everywhere
# (an async run's staleness histogram, `async/staleness_frac_<s>`, is a fraction of the step's trained groups)
_RATE = re.compile(r"(accuracy|pass@\d+|mean@\d+|truncated|mfu_\w+|kv_cache_usage_peak|clip_frac|staleness_frac_\d+)$")


def unit(key: str) -> tuple[str, float]:
    """The unit a metric is drawn in on every chart, and its factor from the logged value."""
    return ("%", 100.0) if _RATE.search(key) else ("", 1.0)


class Series:
    """One metric over steps times `scale`: `x` the steps where it was logged, `y` its values (null -> nan)."""

    def __init__(self, rows: list[dict], key: str, scale: float = 1.0):
        pairs = [(r["step"], r[key]) for r in rows if key in r]
        self.x = [p[0] for p in pairs]
        self.y = [scale * float(v) if isinstance(v, (int, float)) else math.nan for _, v in pairs]

    def __bool__(self) -> bool:  # present with at least one finite value
        return any(math.isfinite(v) for v in self.y)

    def finite(self) -> list[float]:
        return [v for v in self.y if math.isfinite(v)]

    def last(self) -> float | None:
        finite = self.finite()
        return finite[-1] if finite else None

    def constant(self) -> float | None:
        """The value when it is the same at every logged step (two or more), else None."""
        v = self.finite()
        return v[0] if len(v) > 1 and all(abs(a - v[0]) <= 1e-12 * max(1.0, abs(v[0])) for a in v) else None


def in_chart_unit(rows: list[dict], key: str) -> Series:
    """A metric in the unit every chart draws it in (`unit`)."""
    return Series(rows, key, unit(key)[1])


def same_series(a: Series, b: Series) -> bool:
    """Equal at every step (both nan counts as equal): drawn on one panel, one would hide the other."""
    return a.x == b.x and all(u == v or (math.isnan(u) and math.isnan(v)) or abs(u - v) <= 1e-9 * max(1.0, abs(u))
                              for u, v in zip(a.y, b.y, strict=True))


def smooth(y: list[float], window: int) -> list[float]:
    """Centred moving average over the finite values in each window (nan where a window has none); centred so the
    smoothed line does not lag the raw one."""
    out, half = [], window // 2
    for i in range(len(y)):
        w = [v for v in y[max(0, i - half):i - half + window] if math.isfinite(v)]
        out.append(sum(w) / len(w) if w else math.nan)
    return out


def smooth_window(n: int) -> int:
    return max(1, min(25, n // 10))


def short_number(v: float) -> str:
    return f"{v:.4g}"


class Panel:
    """One axes in one unit. `add` draws a series, or turns it into a note when it is constant or equal to one
    already drawn here; `finish` puts the legend and the notes right of the data (or, with nothing drawn, the
    notes in the middle)."""

    def __init__(self, ax, spec: Spec):
        self.ax, self.spec = ax, spec
        self.drawn: list[tuple[Series, str]] = []
        self.notes: list[str] = []
        ax.set_ylabel(spec.ylabel)

    def add(self, s: Series, label: str, color: str, smoothed: bool = True, marker: str = "",
            zero_because: str = "", linestyle: str = "-") -> None:
        """`zero_because`: the configuration that keeps the series at 0, said in its note when it is."""
        if not s:
            return
        value = s.constant()
        if value is not None:
            why = f" ({zero_because})" if zero_because and value == 0 else ""
            self.notes.append(f"{label}: {short_number(value)}{self.spec.unit} at every {self.spec.every}{why}")
            return
        twin = next((lab for other, lab in self.drawn if same_series(s, other)), None)
        if twin is not None:
            self.notes.append(f"{label} = {twin} at every {self.spec.every} (drawn once)")
            return
        if marker or len(s.finite()) == 1:  # (one point drawn as a line is invisible)
            self.ax.plot(s.x, s.y, color=color, marker=marker or "o", linewidth=1.5, linestyle=linestyle, label=label)
        elif smoothed and len(s.x) >= 10:
            self.ax.plot(s.x, s.y, color=color, alpha=0.25, linewidth=1, linestyle=linestyle)
            self.ax.plot(s.x, smooth(s.y, smooth_window(len(s.x))), color=color, linewidth=2, linestyle=linestyle,
                         label=f"{label} (smoothed)")
        else:
            self.ax.plot(s.x, s.y, color=color, linewidth=1.5, linestyle=linestyle, label=label)
        self.drawn.append((s, label))

    def finish(self) -> None:
        ax = self.ax
        notes = [textwrap.fill(n, 36, subsequent_indent="  ") for n in self.notes]
        if not self.drawn:
            ax.set_yticks([])
            ax.text(0.5, 0.5, "\n".join(notes), transform=ax.transAxes, ha="center", va="center", fontsize=9,
                    color="0.3")
            return
        lo, hi = self.spec.ylim
        values = [v for s, _ in self.drawn for v in s.finite()]
        if lo is not None and min(values) < lo:  # (a k1 KL estimate can go below 0: then the data sets the floor)
            lo = None
        if lo is not None and hi is None and max(values) > lo:  # headroom: a line at its maximum is not on the frame
            hi = lo + 1.08 * (max(values) - lo)
        ax.set_ylim(lo, hi)
        handles, labels = ax.get_legend_handles_labels()
        if notes:  # as legend rows without a marker, under the series they explain
            import matplotlib.lines

            handles += [matplotlib.lines.Line2D([], [], linestyle="none") for _ in notes]
            labels += notes
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=8,
                  frameon=False, handlelength=1.5)


@dataclass
class Spec:
    """A panel: its axis label, the unit its notes give values in, what it draws, its y range, and what a logged
    point is (a step, a validation)."""

    ylabel: str
    unit: str
    fill: Callable[[Panel], None]
    ylim: tuple[float | None, float | None] = (0, None)  # from 0 to where the data ends (1% accuracy stays readable)
    every: str = "step"


def stacked(fig, specs: list[Spec], title: str) -> bool:
    """Panels from top to bottom sharing the step axis. A panel left with nothing drawn (every series constant)
    gives its notes to the first panel that has a line instead of taking a row of its own."""
    import matplotlib.figure
    import matplotlib.ticker

    trial = []
    for spec in specs:  # (on a scratch figure, to know which panels will have a line)
        p = Panel(matplotlib.figure.Figure().add_subplot(), spec)
        spec.fill(p)
        trial.append(p)
    if not any(p.drawn or p.notes for p in trial):
        return False
    keep = [i for i, p in enumerate(trial) if p.drawn] or [0]
    fig.set_size_inches(9, 1.2 + 2.6 * len(keep))
    axes = fig.subplots(len(keep), 1, sharex=True, squeeze=False)[:, 0]
    panels = [Panel(ax, specs[i]) for ax, i in zip(axes, keep, strict=True)]
    for p in panels:
        p.spec.fill(p)
    panels[0].notes += [n for i, p in enumerate(trial) if i not in keep for n in p.notes]
    for p in panels:
        p.finish()
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True, min_n_ticks=1))  # (steps)
    axes[0].set_title(title)
    return True
