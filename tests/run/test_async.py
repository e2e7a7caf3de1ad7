"""Fully asynchronous RL in one process: the staleness bound, partial rollouts, streaming dynamic sampling, and
exact accounting of every prompt across SIGTERM and SIGKILL."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from conftest import CLUSTER_RUN, computed, rows, weights

from twinplane.cli import main
from twinplane.run import checkpoint

ASYNC = [*CLUSTER_RUN, "train.steps=6", "cluster.max_staleness=2", "cluster.async_schedule=3", "train.lr=1e-2",
         "algo.entropy_coef=0.01"]


@pytest.fixture(scope="module", autouse=True)
def keep_threads():
    threads = torch.get_num_threads()  # threads=1 (CLUSTER_RUN) must not leak into later tests
    yield
    torch.set_num_threads(threads)


def run(run_dir, *extra, fault=None, signal="TERM"):
    env = {"TWINPLANE_FAULT": fault, "TWINPLANE_FAULT_SIGNAL": signal} if fault else {}
    os.environ.update(env)
    try:
        return main(["train", "--run-dir", str(run_dir), *ASYNC, *extra])
    finally:
        for k in env:
            os.environ.pop(k)


def killed(run_dir, fault, *extra) -> int:
    """The run in a child process that SIGKILLs itself at `fault`: nothing is saved on the way out."""
    env = os.environ | {"TWINPLANE_FAULT": fault, "TWINPLANE_FAULT_SIGNAL": "KILL"}
    cmd = [sys.executable, "-m", "twinplane.cli", "train", "--run-dir", str(run_dir), *ASYNC, *extra]
    return subprocess.run(cmd, env=env, capture_output=True, timeout=300).returncode


def accounting(run_dir) -> tuple[list[int], list[int], list[int]]:
    """(trained, filtered, outstanding at the last checkpoint): the data-order places of every prompt drawn."""
    steps = [r for r in rows(run_dir) if "data/draws" in r]
    trained = [d for r in steps for d in r["data/draws"]]
    filtered = [d for r in steps for d in r["data/draws_filtered"]]
    state = json.loads((checkpoint.list_checkpoints(run_dir)[-1] / "state.json").read_text())
    p = state["controller"]["producer"]
    outstanding = [g["draw"] for key in ("in_flight", "finished", "ready") for g in p[key]]
    return trained, filtered, outstanding


def assert_exactly_once(run_dir) -> None:
    trained, filtered, outstanding = accounting(run_dir)
    everything = trained + filtered + outstanding
    assert sorted(everything) == list(range(len(everything))), "a prompt skipped or repeated"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("async_reference")
    assert run(d) == 0
    return d


def test_staleness_is_bounded_and_every_prompt_is_accounted_for(reference):
    steps = [r for r in rows(reference) if "data/draws" in r]
    assert len(steps) == 6
    assert all(r["async/staleness_max"] <= 2 for r in steps)
    assert max(r["async/staleness_max"] for r in steps) == 2  # the bound is used
    assert all(sum(r[f"async/staleness_frac_{s}"] for s in range(3)) == pytest.approx(1.0) for r in steps)
    assert any(r["async/tokens_in_flight_at_sync"] > 0 for r in steps)  # partial rollouts happened
    assert any(r["actor/tis_weight_mean"] != pytest.approx(1.0, abs=1e-6) for r in steps)  # corrected
    assert_exactly_once(reference)


def test_a_checkpoint_holds_partial_rollouts_with_each_tokens_version(reference):
    state = json.loads((checkpoint.list_checkpoints(reference)[-1] / "state.json").read_text())
    waiting = [s for e in state["controller"]["producer"]["engines"] for s in e["waiting"]]
    mixed = [s for s in waiting if len(set(s["versions"])) > 1]
    assert mixed, "no sample in flight spans a weight update"
    for s in waiting:
        assert len(s["versions"]) == len(s["logprobs"]) == len(s["tokens"]) - s["prompt_len"]
        assert s["versions"] == sorted(s["versions"])
        assert state["weight_version"] - s["versions"][0] <= 2 if s["versions"] else True


POINTS = random.Random(0).sample([f"{phase}@{step}" for phase in ("rollout", "train", "weight_sync", "checkpoint")
                                  for step in range(2, 6)], 4)


@pytest.mark.slow
@pytest.mark.parametrize("fault", POINTS[:2])
def test_sigterm_anywhere_then_resume_is_bitwise_identical(fault, tmp_path, reference):
    assert run(tmp_path, fault=fault) == 75
    assert run(tmp_path, "--resume", "auto") == 0
    a, b = weights(tmp_path), weights(reference)
    assert all(torch.equal(a[n], b[n]) for n in b)
    assert [computed(r) for r in rows(tmp_path)] == [computed(r) for r in rows(reference)]
    assert_exactly_once(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("fault", POINTS[2:])
def test_sigkill_anywhere_then_resume_is_bitwise_identical(fault, tmp_path, reference):
    """No emergency checkpoint: the run continues from the last periodic one (every step here)."""
    assert killed(tmp_path, fault) == -9
    assert run(tmp_path, "--resume", "auto") == 0
    a, b = weights(tmp_path), weights(reference)
    assert all(torch.equal(a[n], b[n]) for n in b)
    assert [computed(r) for r in rows(tmp_path)] == [computed(r) for r in rows(reference)]
    assert_exactly_once(tmp_path)


def test_streaming_dynamic_sampling_trains_only_informative_groups(tmp_path):
    """DAPO's filter as groups complete: zero-variance groups are dropped (and counted, their prompts used up),
    their slots refilled; every trained group has rewards that differ."""
    assert run(tmp_path, "algo.name=dapo", "algo.max_gen_batches=60", "train.steps=4", "warmstart.steps=300") == 0
    steps = [r for r in rows(tmp_path) if "data/draws" in r]
    under_cap = [r for r in steps if r["async/groups_filtered"] < (60 - 1) * 4]  # (max_gen_batches - 1) x P
    assert under_cap and sum(r["async/groups_filtered"] for r in steps) > 0
    assert all(r["rollout/zero_var_groups"] == 0 for r in under_cap)
    assert all(len(r["data/draws_filtered"]) == r["async/groups_filtered"] for r in steps)
    assert_exactly_once(tmp_path)


def test_partial_false_restarts_in_flight_samples_under_the_new_weights(tmp_path):
    assert run(tmp_path, "rollout.partial=false", "train.steps=4") == 0
    state = json.loads((checkpoint.list_checkpoints(tmp_path)[-1] / "state.json").read_text())
    p = state["controller"]["producer"]
    assert all(not s["versions"] for e in p["engines"] for s in e["waiting"])  # all back to their prompts
    waiting = [s for key in ("finished", "ready") for g in p[key] for s in g["samples"]]
    assert waiting and all(len(set(s["versions"])) == 1 for s in waiting)  # each sample from one policy
    assert_exactly_once(tmp_path)


def test_a_checkpoint_from_another_engine_count_generates_what_was_in_flight_again(tmp_path, reference):
    """A checkpoint written by 2 engines, resumed on 1: the groups that were in flight are generated again (new
    attempts of the same prompts), the waiting ones train as saved, and no prompt is lost or repeated."""
    from rich.console import Console

    from twinplane.config import load_config
    from twinplane.run.loop import Run
    from twinplane.run.prepare import prepare

    state = json.loads((checkpoint.list_checkpoints(reference)[-1] / "state.json").read_text())
    saved = state["controller"]["producer"]
    saved = saved | {"engines": saved["engines"] * 2, "outbox": saved["outbox"] * 2}  # as if by 2 engines
    in_flight = sorted(g["draw"] for g in saved["in_flight"])
    assert in_flight
    cfg = load_config(None, [*ASYNC, f"run_dir={tmp_path / 'run'}", "eval.before=false"])
    run = Run(prepare(cfg), Console(stderr=True))
    try:
        run.start()
        producer = run.controller.producer
        producer.prompts.load_state_dict(state["stream"])
        producer.load_state(saved)
        assert sorted(g.draw for g in producer.in_flight.values()) == in_flight
        assert all(g.attempt == 1 for g in producer.in_flight.values())
        trained = []
        for _ in range(3):
            run.controller.step()
            trained += run.controller.draws["trained"]
    finally:
        run.close()
    before = [d for r in rows(reference) if "data/draws" in r for d in r["data/draws"]]
    left = [g.draw for g in [*producer.in_flight.values(), *producer.finished, *producer.ready]]
    everything = before + trained + left
    assert sorted(everything) == list(range(len(everything)))
