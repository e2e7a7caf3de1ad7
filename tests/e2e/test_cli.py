"""The `twinplane train` job end to end (tiny settings) and config errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

import twinplane
from twinplane.cli import main

REQUIRED = [
    "reward/mean", "reward/std", "reward/accuracy", "rollout/response_length_mean", "rollout/response_length_max",
    "rollout/zero_var_groups", "actor/kl", "actor/entropy", "actor/clip_frac", "actor/grad_norm", "actor/lr",
    "perf/rollout_tokens_per_s", "perf/train_tokens_per_s", "actor/logprob_gap", "time/rollout", "time/reward",
    "time/ref_logprob", "time/old_logprob", "time/train", "time/weight_sync", "time/step", "perf/tflops_train",
    "perf/tflops_rollout", "perf/mfu_train", "perf/mfu_rollout", "mem/peak_gb_rollout", "mem/peak_gb_train",
]
TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "warmstart.steps=5",
        "train.steps=3", "rollout.prompts_per_step=4", "rollout.n=4", "task.heldout_size=20", "train.mini_batches=2",
        "train.micro_batch_size=5", "algo.kl_coef=0.05", "algo.recompute_old_logprobs=true", "log.progress=false",
        "algo.entropy_coef=0.01"]  # a gradient even when the tiny warm start leaves every reward at 0


@pytest.mark.slow
def test_train_end_to_end(tmp_path):
    assert main(["train", "--run-dir", str(tmp_path), *TINY]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0: validation before any update
    assert set(rows[0]) == {"step"} | {k for k in rows[0] if k.startswith("val/")}
    rows = rows[1:]
    for key in REQUIRED:
        assert all(r[key] is not None for r in rows), key
    assert "val/accuracy" in rows[-1] and "val/accuracy" not in rows[0]
    assert all(r["actor/logprob_gap"] < 1e-4 for r in rows)
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    assert [r["rollout/weight_version"] for r in rows] == [0, 1, 2]  # samples record the weights that made them
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("warmstart_accuracy", "final_accuracy", "heldout_size", "steps", "wall_seconds", "phase_seconds_mean"):
        assert key in summary
    assert summary["heldout_size"] == 20 and summary["steps"] == 3
    assert (tmp_path / "config.yaml").exists()
    # final weights: an HF folder that differs from a fresh warm start only through training
    final = twinplane.load_model(tmp_path / "final")
    tok = twinplane.load_tokenizer(tmp_path / "final")
    assert tok.decode(tok.encode("12+34=")) == "12+34="
    assert main(["train", "--run-dir", str(tmp_path / "again"), *TINY, "train.steps=0"]) == 0
    untrained = twinplane.load_model(tmp_path / "again" / "final")
    assert any(not torch.equal(a, b) for a, b in zip(final.parameters(), untrained.parameters(), strict=False))


@pytest.mark.slow
def test_seeded_run_is_bitwise_reproducible(tmp_path):
    for d in ("a", "b"):
        assert main(["train", "--run-dir", str(tmp_path / d), *TINY]) == 0
    a, b = (twinplane.load_model(tmp_path / d / "final") for d in ("a", "b"))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=False))


@pytest.mark.parametrize("args, message", [
    (["train.lrr=1"], "unknown key train.lrr (did you mean train.lr?)"),
    (["train.steps=abc"], "train.steps: expected an integer, got 'abc'"),
    (["algo.kl_estimator=k9"], "algo.kl_estimator: must be one of k1, k2, k3, abs"),
    (["no_such.cfg.yaml"], "config file no_such.cfg.yaml not found"),
    (["train.lr"], "train.lr"),
    (["data.plain_template={prompt:>99999999999}"],  # checked by parsing: rendering would exhaust memory
     "data.plain_template: field {prompt:>99999999999} has a format spec"),
])
def test_bad_config_is_one_line_exit_2(args, message):
    out = subprocess.run([sys.executable, "-m", "twinplane.cli", "train", *args], capture_output=True, text=True)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in out.stderr, out.stderr


def test_overrides_after_an_option(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("train:\n  steps: 3\n")
    assert main(["train", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "r"), "train.steps=abc"]) == 2
    assert "train.steps: expected an integer, got 'abc'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "r"), "--no-such-option"])


def test_yaml_config_file(tmp_path):
    from twinplane.config import load_config

    (tmp_path / "c.yaml").write_text("train:\n  lr: 1e-5\n  betas: [0.9, 0.95]\nrollout:\n  n: 4\n")
    cfg = load_config(tmp_path / "c.yaml", ["rollout.n=2"])
    assert cfg.train.lr == 1e-5 and cfg.train.betas == [0.9, 0.95] and cfg.rollout.n == 2
    (tmp_path / "bad.yaml").write_text("train:\n  lr: [1\n")
    with pytest.raises(ValueError, match="invalid YAML"):
        load_config(tmp_path / "bad.yaml")


@pytest.mark.parametrize("override, hint", [
    ("train.learning_rate=1e-5", "train.lr"),  # not train.mini_batches, the closest string
    ("trian.steps=5", "train.steps"),  # the same last part, in the section closest to the one written
    ("warmstrat.steps=5", "warmstart.steps"),
    ("steps=5", "train.steps"),
    ("train.lrr=1", "train.lr"),
    ("train.beta=0.5", "train.betas"),  # a typo in the right section beats TRL's beta
    ("seedd=1", "seed"),
    ("critic.optim.lr=1e-5", "critic.lr"),  # verl's path, twinplane's key
    ("actor_rollout_ref.actor.optim.lr=1e-6", "train.lr"),
    ("per_device_train_batch_size=8", "train.micro_batch_size"),
    ("num_generations=8", "rollout.n"),
    ("max_completion_length=256", "rollout.max_new_tokens"),
    ("max_prompt_length=512", "data.max_prompt_tokens"),
    ("beta=0.04", "algo.kl_coef"),
    ("epsilon=0.2", "algo.clip_low"),
    ("kl_coef=0.001", "algo.kl_coef"),
    ("clip_ratio=0.2", "algo.clip_low"),
    ("temperature=0.7", "rollout.temperature"),
    ("num_train_epochs=1", "train.steps"),
    ("gradient_accumulation_steps=4", "train.micro_batch_size"),
    ("data.max_prompt_length=512", "data.max_prompt_tokens"),
    ("cluster.async=true", "cluster.max_staleness=1"),  # a removed key: what replaced it
])
def test_did_you_mean(override, hint):
    from twinplane.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    key = override.split("=")[0]
    assert str(e.value).startswith(f"unknown key {key} (did you mean {hint}?")


def test_every_alias_names_a_key():
    from twinplane.config import ALIASES, Config, _all_keys

    assert {key for key, _ in ALIASES.values()} <= set(_all_keys(Config))


def test_every_number_setting_refuses_inf_and_nan():
    """No setting means anything at inf or NaN (kv_cache_gb=inf crashed the engine's int conversion)."""
    from twinplane.config import Config, ConfigError, load_config

    numbers = [k for k, f in _fields(Config) if f in (float, float | None)]
    assert "rollout.kv_cache_gb" in numbers and "algo.clip_high" in numbers and len(numbers) > 30
    for key in numbers:
        for bad in ("inf", "-inf", "nan"):
            with pytest.raises(ConfigError, match=f"^{key}: must be a finite number"):
                load_config(overrides=[f"{key}={bad}"])


def _fields(cls, prefix=""):
    """(dotted key, annotated type) of every leaf setting."""
    import dataclasses
    import typing

    for f in dataclasses.fields(cls):
        t = typing.get_type_hints(cls)[f.name]
        name = f.name.rstrip("_")
        yield from _fields(t, f"{prefix}{name}.") if dataclasses.is_dataclass(t) else [(prefix + name, t)]


def test_help_lists_options():
    out = subprocess.run([sys.executable, "-m", "twinplane.cli", "train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "algo.kl_estimator" in out.stdout and "--run-dir" in out.stdout
    from twinplane.config import TaskSection
    from twinplane.data.tasks import ArithmeticTask

    # the demo as the help describes it: two operands of task.digits digits, each below 10**digits
    digits = TaskSection.digits
    assert f"learns {digits}-digit addition, a+b= with a and b below {10 ** digits}," in " ".join(out.stdout.split())
    problems = ArithmeticTask(digits, 10, 0).train_problems()
    operands = [int(x) for p in problems for x in p.prompt.removesuffix("=").split("+")]
    assert max(operands) == 10 ** digits - 1 and all(p.prompt.count("+") == 1 for p in problems)


def test_stop_message_starts_on_its_own_line(tmp_path):
    """On a terminal the progress line is rewritten in place; a Ctrl-C's message must not be glued to it."""
    import pty
    import re

    env = {**os.environ, "TWINPLANE_FAULT": "rollout@2", "TWINPLANE_FAULT_SIGNAL": "INT", "COLUMNS": "120"}
    main_fd, child_fd = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "twinplane.cli", "train", "--run-dir", str(tmp_path), *TINY,
                             "log.progress=true"], stdin=child_fd, stdout=child_fd, stderr=child_fd, env=env)
    os.close(child_fd)
    chunks = []
    while True:
        try:
            chunk = os.read(main_fd, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert proc.wait(timeout=60) == 75
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", b"".join(chunks).decode())  # without colours and line clearing
    lines = [line.strip("\r") for line in text.split("\n")]
    stop = [line for line in lines if "received SIGINT" in line]
    assert stop == ["received SIGINT: stopping after the current step (a second signal exits at once)"], lines
    assert any(line.startswith("step 1/3") for line in text.replace("\r", "\n").split("\n"))  # the live line
