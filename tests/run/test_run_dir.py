"""A run dir belongs to one run: re-runs refused, --overwrite moves the old run aside, resume never mixes runs,
damaged checkpoints are quarantined (never overwritten), files follow the umask."""

import json
import stat

import pytest

from twinplane.cli import main
from twinplane.run import checkpoint

pytestmark = pytest.mark.slow  # whole runs

ARGS = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "warmstart.steps=2",
        "rollout.prompts_per_step=4", "rollout.n=4", "task.heldout_size=8", "log.progress=false",
        "checkpoint.every=1", "eval.before=false"]


def tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def steps(run):
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_rerun_refused_then_overwrite_moves_old_run_aside_and_resume_continues_the_new_one(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *ARGS, "train.steps=2"]) == 0
    before = tree(run)
    assert main(["train", "--run-dir", str(run), *ARGS, "train.steps=1"]) == 2
    assert "already holds a run" in capsys.readouterr().err and tree(run) == before
    assert main(["train", "--run-dir", str(run), *ARGS, "train.steps=1", "seed=1", "--overwrite"]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and tree(aside[0]) == before  # the earlier run, intact, where the log said
    assert str(aside[0]) in capsys.readouterr().out
    assert steps(run) == [1] and [c.name for c in checkpoint.list_checkpoints(run)] == ["step_00000001"]
    # the old run's config cannot continue in the new run's folder; the new one's own settings can
    assert main(["train", "--run-dir", str(run), *ARGS, "train.steps=2", "seed=0", "--resume", "auto"]) == 2
    assert "seed cannot change" in capsys.readouterr().err
    assert main(["train", "--run-dir", str(run), *ARGS, "train.steps=2", "--resume", "auto"]) == 0
    assert steps(run) == [1, 2]
    assert main(["train", "--run-dir", str(run), *ARGS, "train.steps=1", "seed=1", "--overwrite",
                 "--delete-old"]) == 0
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]) == 1


def test_damaged_checkpoints_are_quarantined_not_overwritten(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *ARGS, "train.steps=2"]) == 0
    ck1, ck2 = checkpoint.list_checkpoints(run)
    weights = ck2 / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    damaged, finished = tree(ck2), tree(run)
    assert main(["train", "--run-dir", str(run), *ARGS, "train.steps=2", "--resume", "auto"]) == 0
    assert tree(run) == finished and "the run finished at step 2" in capsys.readouterr().out  # left as it is
    assert main(["train", "--run-dir", str(run), *ARGS, "train.steps=3", "--resume", "auto"]) == 0  # extended
    moved = run / "checkpoints" / "quarantine" / "step_00000002"
    assert tree(moved) == damaged and "moved to" in capsys.readouterr().out
    assert checkpoint.verify(ck2) is None and steps(run) == [1, 2, 3]  # step 2 redone from step 1
    # a run that never finished, with only damaged checkpoints left, starts over; they are kept, not overwritten
    (run / "summary.json").unlink()
    for ck in checkpoint.list_checkpoints(run):
        (ck / checkpoint.MANIFEST).unlink()
    assert main(["train", "--run-dir", str(run), *ARGS, "train.steps=3", "--resume", "auto"]) == 0
    names = sorted(p.name for p in (run / "checkpoints" / "quarantine").iterdir())
    assert len(names) == 3 and steps(run) == [1, 2, 3]
    modes = {stat.S_IMODE(p.stat().st_mode) for p in run.rglob("*") if p.is_file()}
    assert len(modes) == 1  # every file the run writes has the umask's mode (safetensors' 0600 included)


def test_the_start_up_line_says_what_the_data_files_left_out():
    from twinplane.run.loop import data_note

    assert data_note({}) == "" and data_note({"train": {"loaded": 64, "skipped": 0, "too_long": 0}}) == ""
    assert data_note({"train": {"loaded": 64, "skipped": 2, "too_long": 1}, "val": {"loaded": 5, "too_long": 3}}) == (
        " (train: 2 unreadable records skipped (data.on_error=skip), 1 prompts over data.max_prompt_tokens left out; "
        "val: 3 prompts over data.max_prompt_tokens left out)")
