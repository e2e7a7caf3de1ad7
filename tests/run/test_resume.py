"""Never lose a run: kill/resume equivalence, damaged checkpoints, config changes on resume, export."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import TINY_RUN, outcome, train

from twinplane.cli import main
from twinplane.run import checkpoint


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("uninterrupted")
    assert train(run) == 0
    return outcome(run)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["rollout@2", "train@3", "checkpoint@4", "weight_sync@5", "reward@1"])
def test_sigterm_then_resume_is_bitwise_identical(fault, tmp_path, reference_run):
    assert train(tmp_path, fault=fault) == 75  # preempted: emergency checkpoint written
    assert checkpoint.resolve(tmp_path, "auto") is not None
    assert train(tmp_path, "--resume", "auto") == 0
    weights, rows = outcome(tmp_path)
    assert weights == reference_run[0]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]  # every step exactly once
    assert rows == reference_run[1]


@pytest.mark.slow
def test_resume_takes_the_runs_own_settings(tmp_path, reference_run, capsys):
    """`--run-dir X --resume auto` alone continues the run with its config.yaml, not the defaults (which would
    refuse: warmstart.steps cannot change on resume), says so, and ends as the uninterrupted run."""
    assert train(tmp_path, fault="train@3") == 75
    capsys.readouterr()
    assert main(["train", "--run-dir", str(tmp_path), "--resume", "auto"]) == 0
    assert f"twinplane: resuming with the run's own settings ({tmp_path / 'config.yaml'})\n" in capsys.readouterr().out
    assert outcome(tmp_path) == reference_run


@pytest.mark.slow
@pytest.mark.parametrize("fault, sig, code", [
    ("load@0", "TERM", 75), ("warmstart@3", "INT", 75), ("eval@0", "TERM", 75), ("eval@3", "INT", 75),
    ("final@6", "TERM", 0)])
def test_signal_in_every_phase_then_resume_is_bitwise_identical(fault, sig, code, tmp_path, reference_run, capsys,
                                                                 monkeypatch):
    """Model loading and the warm start (rerun on resume), validation before RL (checkpoint at step 0) and
    mid-run, and the final save (the run completes): SIGTERM or SIGINT, no traceback, then an exact resume."""
    monkeypatch.setenv("TWINPLANE_FAULT_SIGNAL", sig)
    assert train(tmp_path, fault=fault) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"received SIG{sig}" in err
    if code == 75:
        assert train(tmp_path, "--resume", "auto") == 0
    weights, rows = outcome(tmp_path)
    assert weights == reference_run[0] and rows == reference_run[1]


@pytest.mark.slow
def test_second_ctrl_c_exits_at_once_without_traceback(tmp_path):
    env = {**os.environ, "TWINPLANE_FAULT": "warmstart@2x2", "TWINPLANE_FAULT_SIGNAL": "INT"}
    out = subprocess.run([sys.executable, "-m", "twinplane.cli", "train", "--run-dir", str(tmp_path), *TINY_RUN],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 130 and "Traceback" not in out.stderr, out.stderr


@pytest.mark.slow
def test_second_signal_mid_checkpoint_exits_at_once_and_resume_skips_it(tmp_path, reference_run):
    env = {**os.environ, "TWINPLANE_FAULT": "checkpoint@4x2"}
    out = subprocess.run([sys.executable, "-m", "twinplane.cli", "train", "--run-dir", str(tmp_path), *TINY_RUN],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 128 + 15
    assert [c.name for c in checkpoint.list_checkpoints(tmp_path)] == ["step_00000002"]
    assert list((tmp_path / "checkpoints").glob(".tmp-*"))  # the half-written one, never picked
    assert train(tmp_path, "--resume", "auto") == 0
    assert outcome(tmp_path) == reference_run


def test_damaged_checkpoints_are_skipped(tmp_path, capsys):
    def writer(payload):
        return lambda out: (out / "weights.bin").write_bytes(payload)

    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, writer(bytes([step]) * 1000), keep=5)
    ckpts = checkpoint.list_checkpoints(tmp_path)
    (ckpts[2] / "weights.bin").write_bytes(b"\x03" * 10)  # truncated
    data = bytearray((ckpts[1] / "weights.bin").read_bytes())
    data[5] ^= 0xFF
    (ckpts[1] / "weights.bin").write_bytes(bytes(data))  # corrupted, same size
    messages = []
    assert checkpoint.resolve(tmp_path, "auto", messages.append) == ckpts[0]
    assert "truncated" in messages[0] and "checksum" in messages[1]
    (ckpts[0] / checkpoint.MANIFEST).unlink()
    assert checkpoint.resolve(tmp_path, "auto", messages.append) is None
    assert "no manifest" in messages[-1]
    with pytest.raises(checkpoint.CheckpointError, match="truncated"):
        checkpoint.resolve(tmp_path, str(ckpts[2]))


def test_pruning_keeps_newest_complete(tmp_path):
    write = lambda out: (out / "x").write_text("x")  # noqa: E731
    checkpoint.save(tmp_path, 1, write, keep=1)
    (tmp_path / "checkpoints" / "step_00000002").mkdir()  # incomplete: no manifest
    checkpoint.save(tmp_path, 3, write, keep=1)
    names = [c.name for c in checkpoint.list_checkpoints(tmp_path)]
    assert "step_00000003" in names and "step_00000001" not in names
    # a failing write never removes the only complete checkpoint
    with pytest.raises(RuntimeError):
        checkpoint.save(tmp_path, 4, lambda out: (_ for _ in ()).throw(RuntimeError("disk full")), keep=1)
    assert checkpoint.resolve(tmp_path, "auto").name == "step_00000003"


@pytest.mark.slow
def test_resume_config_changes(tmp_path, capsys):
    assert train(tmp_path, "train.steps=2") == 0
    capsys.readouterr()
    assert train(tmp_path, "train.steps=2", "algo.kl_coef=0.1", "--resume", "auto") == 2
    err = capsys.readouterr().err
    assert "algo.kl_coef cannot change on resume" in err and len(err.strip().splitlines()) == 1
    assert train(tmp_path, "train.steps=4", "--resume", "auto") == 0  # more steps: allowed, reported
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert main(["train", *TINY_RUN, "--resume", "auto"]) == 2  # auto needs the run dir


def snapshot(root):
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_resume_of_a_finished_run_leaves_it_and_extending_adds_up(tmp_path, monkeypatch, capsys):
    """A finished run is reported and left byte for byte (no spurious changed key for a run dir named by default);
    it cannot be shortened; extending it continues from its last checkpoint, with the run's wall time in all."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY_RUN, "train.steps=4"]) == 0  # run dir: runs/<time>
    (run,) = (tmp_path / "runs").iterdir()
    before = snapshot(run)
    capsys.readouterr()
    assert train(run, "train.steps=4", "--resume", "auto") == 0
    assert capsys.readouterr().out.endswith(f"\ntwinplane: {run}: the run finished at step 4 (summary.json); nothing "
                                            "to do (a larger train.steps continues it)\n")
    assert train(run, "train.steps=3", "--resume", "auto") == 2
    assert f"train.steps: the run in {run} finished at step 4; 3 cannot shorten it" in capsys.readouterr().err
    assert snapshot(run) == before
    last = checkpoint.list_checkpoints(run)[-1]
    until_last = json.loads((last / "state.json").read_text())["summary"]["wall_seconds"]
    started = time.perf_counter()
    assert train(run, "train.steps=5", "--resume", "auto") == 0
    took = time.perf_counter() - started
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume:")] == [
        "resume: train.steps: 4 -> 5"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 5 and until_last <= summary["wall_seconds"] <= until_last + took
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3,
                                                                                                         4, 5]


@pytest.mark.slow
def test_export_loads_in_transformers(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    assert train(tmp_path / "run", "train.steps=2") == 0
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    ckpt = checkpoint.list_checkpoints(tmp_path / "run")[-1]
    assert capsys.readouterr().out == f"exported step 2 ({ckpt}) to {out}\n"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).exists(), name
    import twinplane

    ours = twinplane.load_model(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.tensor([twinplane.load_tokenizer(out).encode("12+34=")])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-5, rtol=0)
    assert main(["export", str(tmp_path / "nowhere"), "--out", str(out)]) == 2


@pytest.mark.slow
def test_restart_loop_resumes_after_crash_and_stops_on_config_error(tmp_path, reference_run):
    """A second SIGTERM mid-checkpoint kills the child at once (exit 143, a crash to the supervisor), which
    relaunches it with --resume auto; the run then ends exactly like the uninterrupted one."""
    env = {**os.environ, "TWINPLANE_FAULT": "checkpoint@4x2", "TWINPLANE_FAULT_ONCE": str(tmp_path / "fired")}
    # the child at the thread count this process ran the reference with: the weights' last bits depend on it
    cmd = [sys.executable, "-m", "twinplane.cli", "train", "--run-dir", str(tmp_path), *TINY_RUN,
           f"threads={torch.get_num_threads()}"]
    supervise = [sys.executable, "-m", "twinplane.cli", "supervise", "--max-restarts", "2", "--backoff", "0.1", "--"]
    out = subprocess.run([*supervise, *cmd], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "restarting with --resume auto" in out.stderr
    assert outcome(tmp_path) == reference_run
    bad = subprocess.run([*cmd, "train.lrr=1", "--max-restarts", "3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("unknown key train.lrr") == 1


@pytest.mark.slow
def test_moe_run_with_routing_replay_resumes_bitwise(tmp_path):
    """A tiny MoE policy with recorded/replayed routing and the aux loss, killed mid-train and resumed."""
    moe = ["model.num_experts=4", "model.moe_intermediate_size=32", "rollout.record_routing=true",
           "algo.routing_replay=true", "train.router_aux_loss_coef=0.01", "train.steps=3", "eval.every=0",
           "eval.before=false", "eval.after=false"]
    assert train(tmp_path / "whole", *moe) == 0
    assert train(tmp_path / "cut", *moe, fault="train@2") == 75
    assert train(tmp_path / "cut", *moe, "--resume", "auto") == 0
    weights, rows = outcome(tmp_path / "cut")
    want = outcome(tmp_path / "whole")
    assert weights == want[0] and rows == want[1]
    assert rows[-1]["rollout/routing_agreement"] == 1.0 and rows[-1]["moe/aux_loss"] > 0
