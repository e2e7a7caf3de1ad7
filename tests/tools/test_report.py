"""`twinplane report`: charts and report.md from a synthetic run dir (finished, running, partial, missing)."""

import json
import math
import random

import pytest

pytest.importorskip("matplotlib")
import matplotlib.image  # noqa: E402

from twinplane.tools import charts, report  # noqa: E402
from twinplane.tools.charts import smooth  # noqa: E402
from twinplane.tools.report import load_metrics, main, make_report  # noqa: E402

ALL_CHARTS = ["reward.png", "validation.png", "step_time.png", "throughput.png", "response_length.png",
              "kl_entropy.png", "weight_sync.png", "engine.png"]
SUMMARY = {"heldout_size": 64, "warmstart_accuracy": 0.3125, "final_accuracy": 0.8594, "steps": 30,
           "wall_seconds": 123.4, "phase_seconds_mean": {"rollout": 0.5, "train": 0.25, "step": 0.9}}


def step_row(step: int, rng: random.Random) -> dict:
    acc = min(1.0, 0.3 + 0.02 * step + rng.uniform(-0.05, 0.05))
    return {"step": step, "reward/mean": acc, "reward/std": 0.2 + rng.uniform(0, 0.1), "reward/accuracy": acc,
            "reward/errors": 0, "rollout/response_length_mean": 12 + rng.uniform(-1, 1),
            "rollout/response_length_max": 20, "rollout/truncated": rng.uniform(0, 0.1),
            "rollout/zero_var_groups": 0.25, "actor/kl": 0.001 * step, "actor/entropy": 1.0 - 0.01 * step,
            "actor/clip_frac": 0.05, "actor/grad_norm": 1.0, "actor/lr": 1e-4,
            "actor/logprob_gap": None if step == 3 else 1e-6,  # a NaN written as null
            "perf/rollout_tokens_per_s": 900 + rng.uniform(-50, 50), "perf/train_tokens_per_s": 2000.0,
            "perf/mfu_train": None, "time/rollout": 0.5, "time/reward": 0.01, "time/old_logprob": 0.05,
            "time/train": 0.25, "time/weight_sync": 0.02, "time/step": 0.9, "sync/bytes": 4e6,
            "sync/gb_per_s": 0.2 + rng.uniform(0, 0.05), "rollout/running_seqs_mean": 40 + rng.uniform(-5, 5),
            "rollout/preemptions": step % 3, "rollout/kv_cache_usage_peak": 0.6,
            "perf/prefill_tokens_per_s": 3000.0,
            "perf/decode_tokens_per_s": 900.0}  # no time/ref_logprob: kl_coef 0


def async_row(step: int, rng: random.Random) -> dict:
    """An asynchronous run's step (bound 2): the staleness histogram has no 2-versions-stale bin on some steps."""
    fracs = [rng.uniform(0.2, 1.0), rng.uniform(0.0, 0.6)] + ([rng.uniform(0.0, 0.3)] if step % 3 else [])
    fracs = [f / sum(fracs) for f in fracs]
    busy, train = 0.7 + rng.uniform(0, 0.15), 0.3 + rng.uniform(0, 0.1)
    return {**{f"async/staleness_frac_{s}": f for s, f in enumerate(fracs)},
            "async/staleness_mean": sum(s * f for s, f in enumerate(fracs)), "async/staleness_max": len(fracs) - 1,
            "async/rollout_busy_s": busy, "async/rollout_idle_s": 0.9 - busy, "async/train_busy_s": train,
            "async/train_idle_s": 0.9 - train, "async/overlap_s": train - rng.uniform(0, 0.1),
            "async/groups_regenerated": int(step % 4 == 0), "async/groups_filtered": rng.randint(0, 3),
            "async/groups_waiting": rng.randint(0, 2), "async/tokens_in_flight_at_sync": rng.randint(500, 3000)}


def write_run(run_dir, steps: int = 30, summary: bool = True, drop: tuple[str, ...] = (),
              asynchronous: bool = False) -> None:
    rng = random.Random(0)
    rows = [{"step": 0, "val/accuracy": 0.3125, "val/pass@4": 0.5}]
    for s in range(1, steps + 1):
        row = step_row(s, rng) | (async_row(s, rng) if asynchronous else {})
        if s % 10 == 0:
            row |= {"val/accuracy": 0.3 + 0.018 * s, "val/pass@4": 0.5 + 0.01 * s}
        rows.append(row)
    rows = [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(text + '{"step": 31, "reward/mean": 0.')  # a line being written
    (run_dir / "config.yaml").write_text("seed: 0\n" + ("cluster:\n  max_staleness: 2\n" if asynchronous else ""))
    if summary:
        (run_dir / "summary.json").write_text(json.dumps(SUMMARY))


def check_png(path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] >= 300 and img.shape[1] >= 600 and img.shape[2] in (3, 4)


def test_finished_run(tmp_path):
    run = tmp_path / "run"
    write_run(run)
    paths = make_report(run)
    out = run / "report"
    assert paths == [out / name for name in ALL_CHARTS] + [out / "report.md"]
    for p in paths[:-1]:
        check_png(p)
    md = (out / "report.md").read_text()
    assert str(run) in md.splitlines()[0] and "finished" in md
    for name in ALL_CHARTS:
        assert f"`{name}`" in md and f"]({name})" in md  # described and embedded with a relative link
    for value in ("0.3125", "0.8594", "64", "123.4", "time/rollout"):
        assert value in md


def test_running_run(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, summary=False)
    out = tmp_path / "elsewhere"
    assert main([str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / name) for name in ALL_CHARTS] + [str(out / "report.md")]
    md = (out / "report.md").read_text()
    assert "running: 30 steps so far" in md
    assert "| last step | 30 |" in md
    assert "0.84 (step 30)" in md  # latest validation accuracy: 0.3 + 0.018 * 30
    assert "| warm-start accuracy (step 0) | 0.3125 |" in md
    assert "mean time/rollout (s) | 0.5 |" in md and "ref_logprob" not in md


def test_async_run(tmp_path):
    """An async run gets async.png and its staleness / overlap lines in report.md; a synchronous run neither."""
    run = tmp_path / "run"
    write_run(run, steps=12, asynchronous=True)
    paths = make_report(run)
    assert [p.name for p in paths] == ALL_CHARTS + ["async.png", "report.md"]
    check_png(paths[-2])
    md = paths[-1].read_text()
    assert "`async.png`" in md and "](async.png)" in md
    assert "| async: staleness trained on (policy versions) | mean " in md and "cluster.max_staleness=2" in md
    assert "| async: both planes busy, mean (s per step) |" in md and "% of the step time)" in md

    fig = figure()
    rows = load_metrics(run / "metrics.jsonl")
    assert report.plot_async(rows, fig, report.load_config(run))
    assert [ax.get_ylabel() for ax in fig.axes] == ["staleness (policy versions)", "trained groups (%)",
                                                    "seconds per step", "groups per step", "tokens"]
    versions, hist, seconds = fig.axes[:3]
    bound = labeled_lines(versions)["bound: cluster.max_staleness=2"]
    assert tuple(bound.get_ydata()) == (2, 2) and versions.get_ylim()[1] > 2
    assert [t.get_text() for t in hist.get_legend().get_texts()] == ["2 versions stale", "1 version stale",
                                                                      "0 versions stale (fresh)"]
    top = hist.collections[0].get_paths()[0].vertices[:, 1]  # (the stack's top, in percent: 100 at every step)
    assert top.max() == pytest.approx(100.0) and hist.get_ylim() == (0, 100)
    assert {"both planes busy (overlap) (smoothed)", "rollout plane idle (smoothed)"} <= set(labeled_lines(seconds))
    assert "step (wall): 0.9 s at every step" in legend_texts(fig)  # (time/step is constant here: a note)

    sync = tmp_path / "sync"
    write_run(sync, steps=12)
    assert "async.png" not in [p.name for p in make_report(sync)]
    md = (sync / "report" / "report.md").read_text()
    assert "async.png" not in md and "| async:" not in md
    fig = figure()
    assert not report.plot_async(load_metrics(sync / "metrics.jsonl"), fig, {"cluster": {"max_staleness": 2}})


def test_the_bound_is_cluster_max_staleness_alone(tmp_path, capsys):
    """The staleness bound comes from cluster.max_staleness alone. A config.yaml saved before cluster.async was
    removed: `async: false` changed nothing and is dropped; `async: true` (max_staleness=1 then) would be charted
    against the wrong bound, so it is the one-line error an unknown key gets, exit 2."""
    run = tmp_path / "run"
    write_run(run, steps=6, asynchronous=True)
    (run / "config.yaml").write_text("cluster:\n  max_staleness: 2\n  async: false\n")
    assert report.load_config(run) == {"cluster": {"max_staleness": 2}}
    make_report(run)
    assert "(bound: cluster.max_staleness=2)" in (run / "report" / "report.md").read_text()
    (run / "config.yaml").write_text("cluster:\n  max_staleness: 0\n  async: true\n")
    assert main([str(run)]) == 2
    assert capsys.readouterr().err == (f"twinplane: error: {run / 'config.yaml'}: unknown key cluster.async (did you "
                                       "mean cluster.max_staleness=1?)\n")


def test_async_flat_histogram_is_notes():
    """Every group fresh at every step: the histogram is notes, not a stack filling the panel; without a bound in
    the config the staleness panel says so."""
    rows = [{"step": s, "async/staleness_frac_0": 1.0, "async/staleness_frac_1": 0.0,
             "async/staleness_mean": 0.0, "async/staleness_max": 0, "async/overlap_s": 0.1 * s,
             "time/step": 1.0 + 0.1 * s} for s in range(1, 6)]
    fig = figure()
    assert report.plot_async(rows, fig, {})
    [ax] = fig.axes
    assert ax.get_ylabel() == "seconds per step" and not ax.collections
    notes = legend_texts(fig)
    for note in ("0 versions stale (fresh): 100% at every step", "1 version stale: 0% at every step",
                 "staleness max: 0 versions at every step", "bound not in config.yaml (cluster.max_staleness)"):
        assert note in notes


def test_missing_groups_are_skipped(tmp_path):
    run = tmp_path / "run"
    write_run(run, steps=5, drop=("perf/", "actor/", "time/", "val/", "sync/"))
    paths = make_report(run)
    assert [p.name for p in paths] == ["reward.png", "response_length.png", "engine.png", "report.md"]
    md = paths[-1].read_text()
    assert "kl_entropy" not in md and "throughput" not in md


def test_all_null_metric_counts_as_absent(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "time/step": 1.0, "actor/kl": None, "perf/mfu_train": None} for s in range(1, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p.name for p in make_report(run)] == ["step_time.png", "report.md"]


def test_errors_are_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl" in err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/m')  # only a partial line so far
    assert main([str(tmp_path)]) == 2
    assert "no metrics rows" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time/step": 1.0}\n')
    (tmp_path / "taken").write_text("a file where the report folder would go")
    for out in (tmp_path / "taken", "/proc/twinplane-report"):  # (no folder can be made there, even as root)
        assert main([str(tmp_path), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{out}: cannot make the report folder" in err


def test_load_metrics_merges_and_skips(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 2, "a": 1}\nnot json\n[1]\n{"step": 1, "a": 0}\n{"step": 2, "a": 5, "b": null}\n')
    assert load_metrics(path) == [{"step": 1, "a": 0}, {"step": 2, "a": 5, "b": None}]


def test_smooth_ignores_nan():
    out = smooth([1.0, math.nan, 3.0, 5.0], 2)
    assert out == [1.0, 1.0, 3.0, 4.0]
    assert math.isnan(smooth([math.nan], 3)[0])


def figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure()
    FigureCanvasAgg(fig)
    return fig


def labeled_lines(ax) -> dict:
    return {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}


def legend_texts(fig) -> list[str]:
    """Legend rows, each on one line (notes are wrapped to fit beside the panel)."""
    return [" ".join(t.get_text().split()) for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def test_reward_equal_to_accuracy_is_drawn_once():
    """A 0/1 reward: reward mean = accuracy at every step, so one line (in %), and no std band; a shaped reward
    (here 0.1 below accuracy) gets its own panel with the band, accuracy (%) below it."""
    rows = [step_row(s, random.Random(s)) for s in range(1, 31)]
    fig = figure()
    assert report.plot_reward(rows, fig, {})
    [ax] = fig.axes
    [(label, line)] = labeled_lines(ax).items()
    assert label.startswith("accuracy = reward mean") and not ax.collections
    assert max(line.get_ydata()) > 50 and ax.get_ylabel() == "accuracy (%)"
    assert any("std not drawn" in t for t in legend_texts(fig))

    shaped = [r | {"reward/mean": r["reward/accuracy"] - 0.1} for r in rows]
    fig = figure()
    assert report.plot_reward(shaped, fig, {})
    top, bottom = fig.axes
    assert list(labeled_lines(top)) == ["reward mean (smoothed)"] and len(top.collections) == 1  # the ± std band
    assert list(labeled_lines(bottom)) == ["accuracy (smoothed)"] and bottom.get_ylabel() == "accuracy (%)"


def test_one_unit_per_quantity():
    """Every rate is in percent on every chart: truncation of training rollouts and of validation alike."""
    for key in ("rollout/truncated", "val/truncated", "val/sampled_truncated", "reward/accuracy", "val/accuracy",
                "val/pass@4", "val/mean@4", "perf/mfu_train", "rollout/kv_cache_usage_peak", "actor/clip_frac",
                "async/staleness_frac_0", "async/staleness_frac_12"):
        assert charts.unit(key) == ("%", 100.0), key
    for key in ("rollout/response_length_mean", "actor/entropy", "async/staleness_mean", "async/staleness_max",
                "async/overlap_s", "async/train_idle_s", "async/groups_waiting", "async/tokens_in_flight_at_sync"):
        assert charts.unit(key) == ("", 1.0), key  # (counts, versions and seconds: as logged)
    rows = [{"step": 0, "val/accuracy": 0.3, "val/truncated": 0.02}]
    rows += [step_row(s, random.Random(s)) | ({"val/accuracy": 0.5, "val/truncated": 0.05} if s == 10 else {})
             for s in range(1, 11)]
    labels = {}
    for chart in (report.plot_validation, report.plot_response_length):
        fig = figure()
        assert chart(rows, fig, {})
        labels |= {ax.get_ylabel(): labeled_lines(ax) for ax in fig.axes}
    truncation = [lab for lab in labels if "truncated" in lab]
    assert truncation == ["truncated (% of responses)"]  # the same axis label on both charts (one key: merged)
    for lab, lines in labels.items():
        assert "fraction" not in lab
        if "truncated" in lab:
            assert all(max(ln.get_ydata()) > 1 for ln in lines.values())  # (logged 0.02-0.1: drawn as 2-10)


def test_no_twin_axes_no_hidden_series_and_legends_outside_the_data(tmp_path):
    """On every chart of a run: each panel has its own place (no twin axes to lay one line exactly on another), no
    two lines of a panel are the same, and every legend lies outside its panel."""
    write_run(tmp_path, asynchronous=True)
    rows = [r | ({"perf/mfu_train": 0.001 * (1 + r["step"] % 3), "actor/kl": 0.0} if r["step"] else {})
            for r in load_metrics(tmp_path / "metrics.jsonl")]
    config = {"algo": {"kl_coef": 0.0}, "train": {"mini_batches": 1}, "cluster": {"max_staleness": 2}}
    for chart in report.CHARTS:
        fig = figure()
        assert chart.plot(rows, fig, config), chart.name
        fig.canvas.draw()
        boxes = [tuple(ax.get_position().bounds) for ax in fig.axes]
        assert len(set(boxes)) == len(boxes), chart.name
        for ax in fig.axes:
            ys = [tuple(ln.get_ydata()) for ln in labeled_lines(ax).values()]
            assert len(set(ys)) == len(ys), chart.name
            legend = ax.get_legend()
            if legend is not None:
                assert not legend.get_window_extent().overlaps(ax.get_window_extent()), chart.name


def test_constant_series_are_notes_with_the_configuration_behind_them():
    """KL at 0 with algo.kl_coef=0, clip fraction at 0 with one mini-batch, no preemptions: notes saying so, not
    lines on the axis; without a config the notes only give the value."""
    rows = [step_row(s, random.Random(s)) | {"actor/kl": 0.0, "actor/clip_frac": 0.0, "rollout/preemptions": 0}
            for s in range(1, 31)]
    config = {"algo": {"kl_coef": 0.0}, "train": {"mini_batches": 1}}
    fig = figure()
    assert report.plot_kl_entropy(rows, fig, config)
    assert [list(labeled_lines(ax)) for ax in fig.axes] == [["entropy (smoothed)"]]  # the other two are flat
    notes = legend_texts(fig)
    assert "KL to reference: 0 nats at every step (off: algo.kl_coef=0)" in notes
    assert any(n.startswith("clip fraction: 0% at every step (one update per batch") for n in notes)
    fig = figure()
    assert report.plot_kl_entropy(rows, fig, {})
    assert "KL to reference: 0 nats at every step" in legend_texts(fig)
    fig = figure()
    assert report.plot_engine(rows, fig, {})
    assert not any("preemptions" in label for ax in fig.axes for label in labeled_lines(ax))
    assert any(n.startswith("preemptions: 0 at every step (the KV pool") for n in legend_texts(fig))


def test_mfu_has_its_own_panel():
    """MFU is train tokens/s times a constant: on a twin axis the two lines coincide, so MFU (%) gets a panel."""
    rows = [step_row(s, random.Random(s)) | {"perf/train_tokens_per_s": 1000.0 + s,
                                             "perf/mfu_train": (1000.0 + s) * 2e-5} for s in range(1, 31)]
    fig = figure()
    assert report.plot_throughput(rows, fig, {})
    speed, mfu = fig.axes
    assert "train tokens/s (smoothed)" in labeled_lines(speed) and mfu.get_ylabel() == "MFU (%)"
    assert list(labeled_lines(mfu)) == ["MFU train (smoothed)"]


def test_step_time_stacks_every_logged_phase():
    """PPO's critic phases are stacked under their own names, so 'other' is only the step time outside phases."""
    rows = [{"step": s, "time/rollout": 1.0, "time/train": 2.0, "time/critic_train": 3.0, "time/values": 0.5,
             "time/step": 7.0} for s in range(1, 5)]
    fig = figure()
    assert report.plot_step_time(rows, fig, {})
    [ax] = fig.axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["other", "values", "critic_train", "train",
                                                                    "rollout"]
    assert ax.collections[-1].get_paths()[0].vertices[:, 1].max() == pytest.approx(7.0)  # the stack's top: the step


def test_axes_start_at_zero_unless_the_data_goes_below():
    rows = [step_row(s, random.Random(s)) | {"actor/kl": 0.01 * ((-1) ** s) * s} for s in range(1, 31)]
    fig = figure()
    assert report.plot_kl_entropy(rows, fig, {})
    kl, entropy = fig.axes[:2]
    assert kl.get_ylim()[0] < -0.25 and entropy.get_ylim()[0] == 0
