"""benchmarks/gpu_probe.py runs end to end on CPU with tiny shapes, so the prepared GPU probe cannot rot."""

import argparse
import importlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("env", "copy", "engine", "train_fit", "train", "train_ranks", "decode", "profile", "kernels", "attention",
            "sampling", "host", "decode_sdpa", "decode_torch", "decode_triton", "engine_hf")


@pytest.mark.slow
def test_gpu_probe_smoke_writes_every_section(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_probe.py"), str(tmp_path), "--smoke",
           "--sections", ",".join(SECTIONS), "--commit", "abc"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    res = json.loads((tmp_path / "probe.json").read_text())
    for name in SECTIONS:
        assert "error" not in res[name], (name, res[name].get("traceback"))
    assert res["env"]["commit"] == "abc" and res["env"]["paged_attention_backend"] == "sdpa"
    assert res["env"]["rollout_kernels"] == res["env"]["logprob_kernels"] == "torch"  # auto on CPU
    assert res["env"]["train_compile_auto"] is False
    for n, row in res["decode"]["batches"].items():
        assert row["bucket"] >= int(n) and row["kernels_per_step"] > 0 and row["roofline_ms"] > 0
    assert (res["decode_sdpa"]["backend"], res["decode_sdpa"]["kernels"]) == ("sdpa", "torch")
    assert (res["decode_torch"]["kernels"], res["decode_triton"]["kernels"]) == ("torch", "triton")
    assert res["decode_triton"]["backend"] == "triton"  # (Triton's interpreter on CPU)
    for row in res["kernels"]["batches"].values():  # each kernel and its torch reference timed
        for name in ("paged_decode", "add_rms_norm", "silu_mul", "rope_write", "sampler"):
            assert row[name]["triton_us"] > 0 and row[name]["torch_us"] > 0, name
        assert set(row["paged_decode_by_splits_us"]) == {"1", "2"}
        assert set(row["paged_decode_by_tile_us"]) == {"16x4", "32x4"}
        assert all(isinstance(us, float) for us in row["paged_decode_by_tile_us"].values())
        assert list(row["sampler_by_launch_us"]) == ["256x4"] and row["sampler_by_launch_us"]["256x4"] > 0
        assert all(isinstance(row["attention_layer_us"][b], float) for b in ("triton", "flex", "sdpa"))
    # the engine's tokens are the samples' own: 4 prompts x 2 samples, at most 16 new tokens each
    assert 8 <= res["engine"]["tokens"] <= 4 * 2 * 16 and res["engine_hf"]["hf_tokens"] > 0
    for call in ("first_call", "second_call"):  # HF's rate against the engine's calls, from the same process
        assert res["engine_hf"][f"ratio_vs_hf_{call}"] > 0
    assert res["engine"]["second_call"]["tokens"] > 0 and "partial" not in res["engine"]
    for call in ("second_call", "step_by_step_call"):  # each later call's own steps against the roofline
        roofline = res["engine"][call]["roofline"]
        waits = [v for k, v in roofline.items() if k.endswith("_median_wait_ms")]
        assert roofline["decode_steps"] > 0 and waits and not any(waits)  # (CPU: nothing to wait for)
        assert all(v > 0 for k, v in roofline.items() if k.endswith("_median_launch_ms"))  # (static: the step too)
    assert res["host"]["batches"]["8"]["host_ms"] > 0 and len(res["host"]["batches"]["8"]["runs"]) == 3
    steps = res["engine"]["graph_steps"]  # the engine's own largest step, filled rows, back to back
    assert [row["replay_ms_median"] > 0 and row["roofline_ms"] > 0 for row in steps["buckets"].values()] == [True]
    later = res["engine"]["later_calls"]  # one call each way, alternating
    assert len(later["tokens_per_s"]["run_ahead"]) == len(later["tokens_per_s"]["step_by_step"]) == 1
    assert later["run_ahead_speedup"] > 0 and later["captures"] == 0
    for layout in ("shared", "unshared"):  # CPU: the portable path only, and the platform picks it
        row = res["attention"]["layouts"][layout]
        assert row["chosen"] == "sdpa" and row["sdpa"]["forward_backward_ms"] > row["sdpa"]["forward_ms"] > 0
    assert res["attention"]["layouts"]["shared"]["tokens"] < res["attention"]["layouts"]["unshared"]["tokens"]
    train = res["train"]
    assert train["response_tokens"] < train["tokens"] and 0 < train["mfu"] < 1
    for profiled in (res["profile"], train["profile"]):  # each kernel's time traced to an operator and its shapes
        assert all(row["calls"] > 0 and row["total_us"] >= 0 for row in profiled["ops"])
        assert any(row["op"].startswith("aten::") and row["shapes"] != "[]" for row in profiled["ops"])
    assert train["host_syncs"] is None  # (CPU: no census of host waits)
    cpu = train["cpu_timed_steps"]  # the host's CPU while the timed steps ran
    assert cpu["process_cpu_per_s"] > 0 and 0 < cpu["machine_busy"] <= 1 and cpu["child_processes"] >= 0
    assert train["profile"]["host"]["Optimizer.step"]["calls"] == 1 and train["profile"]["step_s"] > 0
    ranks = res["train_ranks"]  # the same step on 1 and on 2 gloo ranks (FSDP2), each rank half the rows
    assert [ranks["runs"][n]["rows_per_rank"] for n in ("1", "2")] == [train["rows"], train["rows"] // 2]
    assert ranks["scaling"] > 0 and ranks["runs"]["2"]["first_metrics"]["actor/grad_norm"] > 0
    assert max(ranks["first_step_rel_diff"].values()) < 1e-5  # (fp32: the two layouts differ by rounding only)
    assert ranks["runs"]["2"]["compile_counters_timed_steps"] == {}  # (compile off on CPU: nothing traced)
    for side in ("chunked", "one_chunk"):  # tiny shapes fit whole on CPU: every size up to the cap
        assert res["train_fit"][side]["largest_tokens"] == 64 and len(res["train_fit"][side]["peak_gib_by_tokens"]) == 3
    assert (tmp_path / "probe.log").read_text().count(": start") == len(SECTIONS)


def test_sync_sites_counts_host_waits_by_call_site(monkeypatch):
    """The probe's census of host waits (torch.cuda's sync debug mode warns at each) credits every warning to the
    innermost frame outside torch and the standard library; other warnings are not counted. CPU: no census."""
    probe = load_probe(monkeypatch, "probe.report")
    assert probe.sync_sites(lambda: None, torch.device("cpu")) is None
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step():
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("an unrelated warning", stacklevel=1)

    line = step.__code__.co_firstlineno + 2
    assert probe.sync_sites(step, torch.device("cuda")) == {
        "total": 3, "sites": {f"tests/e2e/test_gpu_probe.py:{line} step": 3}}
    assert modes == ["warn", "default"]


def load_probe(monkeypatch, module: str = "gpu_probe"):
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the probe puts benchmarks/ first on import)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return importlib.import_module(f"benchmarks.{module}")


class Span:
    def __init__(self, start, end):
        self.start, self.end = start, end

    def elapsed_us(self):
        return self.end - self.start


class Event:
    def __init__(self, name, start, end, annotation=False, device="CUDA"):
        self.name, self.time_range, self.is_user_annotation = name, Span(start, end), annotation
        self.device_type = type("DeviceType", (), {"name": device})()


def test_kernel_table_counts_device_work_only(monkeypatch):
    """On a GPU the profiler draws a compiled graph's annotated call and CUPTI's "Command Buffer Full" on the
    device's timeline: the table counts neither as a kernel, and the device's busy time is the union of its
    kernels' spans (overlapping kernels of two streams count once)."""
    probe = load_probe(monkeypatch, "probe.report")
    events = [Event("## Call CompiledFxGraph abc ##", 0, 100, annotation=True), Event("Command Buffer Full", 5, 45),
              Event("nvjet_gemm", 0, 30), Event("triton_poi_fused", 20, 40), Event("flash_bwd", 60, 70),
              Event("aten::mm", 0, 500, device="CPU")]
    prof = type("Profile", (), {"events": lambda self: events})()
    table = probe.kernel_table(prof, gpu=True)
    assert table["kernels"] == 3 and table["total_us"] == 30 + 20 + 10
    assert table["by_category_us"] == {"gemm": 30, "elementwise": 20, "attention": 10}
    assert (table["busy_us"], table["span_us"], table["launch_queue_full_us"]) == (50, 70, 40)


def test_compiled_sections_share_one_inductor_cache(monkeypatch, tmp_path):
    """Each compiled training section runs in a child process with Inductor's cache in one folder and its own
    switches in the environment; what its first step found there (cold, warm) is read from its counters. A stand-in
    child keys the cache as Inductor does, the launcher setting included."""
    probe = load_probe(monkeypatch)
    seen = []

    def run(cmd, timeout, check, env):
        name, out = cmd[cmd.index("--sections") + 1], Path(cmd[2])
        seen.append((name, env["TORCHINDUCTOR_CACHE_DIR"], env.get("TORCHINDUCTOR_AUTOGRAD_CACHE")))
        entry = Path(env["TORCHINDUCTOR_CACHE_DIR"]) / f"launcher{env.get('TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER')}"
        counts = {f"inductor/fxgraph_cache_{'hit' if entry.exists() else 'miss'}": 4}
        if env.get("TORCHINDUCTOR_FX_GRAPH_CACHE") == "0":  # (Inductor neither looks nor writes)
            counts = {}
        entry.mkdir(exist_ok=True)
        out.mkdir(parents=True)
        (out / "probe.json").write_text(json.dumps({name: {"mfu": 0.5, "compile_counters_first_step": counts}}))

    monkeypatch.setattr(probe.subprocess, "run", run)
    cache = tmp_path / "cache"
    cache.mkdir()
    a = argparse.Namespace(out=tmp_path / "out", smoke=True, inductor_cache=str(cache), until=1e12, child_limit=60)
    got = {name: probe.isolated(a, name) for name in probe.COMPILED}
    assert {name: g["inductor_cache"] for name, g in got.items()} == {
        "train_compiled": "cold", "train_compiled_warm": "warm", "train_compiled_warm_no_aot_cache": "warm",
        "train_compiled_warm_no_graph_cache": "unused", "train_compiled_triton_launcher": "cold",
        "train_compiled_warm_triton_launcher": "warm"}
    assert all(g["mfu"] == 0.5 for g in got.values())
    assert [(name, c) for name, c, _ in seen] == [(name, str(cache)) for name in probe.COMPILED]
    assert [aot for *_, aot in seen] == [None, None, "0", "0", None, None]
