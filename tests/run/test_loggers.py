"""TensorBoard and W&B (offline) receive the same metric names as metrics.jsonl."""

import json

import pytest

from twinplane.cli import main

TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "warmstart.steps=2",
        "train.steps=2", "rollout.prompts_per_step=2", "rollout.n=2", "task.heldout_size=8", "log.progress=false"]


@pytest.mark.slow
def test_tensorboard_and_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert main(["train", "--run-dir", str(tmp_path), *TINY, "log.backends=[console,jsonl,tensorboard,wandb]"]) == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    tags = set(acc.Tags()["scalars"])
    assert {"reward/mean", "actor/kl", "time/step", "perf/tflops_train", "val/accuracy"} <= tags
    events = acc.Scalars("reward/mean")
    assert [e.step for e in events] == [1, 2] and events[-1].value == pytest.approx(last["reward/mean"])
    assert any((tmp_path / "wandb").glob("offline-run-*"))


def test_missing_backend_package_is_a_config_error(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["train", "--run-dir", str(tmp_path), *TINY, "log.backends=[wandb]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install wandb" in err[0]
