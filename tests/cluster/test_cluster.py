"""Scale-out on CPU: Ray actors (local cluster, 2 CPUs), gloo collectives, bucketed weight sync, worker failure."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import CLUSTER_RUN, RAY, SUM_AGENT, cluster_train, computed, ray_init, rows, weights

from twinplane.cli import main
from twinplane.cluster.sync import SyncReport, bucket_plan
from twinplane.config import ConfigError, load_config
from twinplane.model.checksum import weights_checksum
from twinplane.train.balance import assign_rows

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a local Ray cluster, whole runs on it


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    threads = torch.get_num_threads()  # threads=1 (as in the 1-CPU actors) must not leak into later tests
    ray_init(num_cpus=2)
    yield
    ray.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("local")
    assert cluster_train(d) == 0
    return d


@pytest.fixture(scope="module")
def disaggregated_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray")
    assert cluster_train(d, *RAY) == 0
    return d


def test_disaggregated_run_equals_local(local_run, disaggregated_run):
    """1 trainer actor + 1 engine actor: the same computation as one process (engine 0 samples from the run's
    seed; one rank trains unsharded), with the weights crossing processes by broadcast."""
    got, want = rows(disaggregated_run), rows(local_run)
    assert [r["step"] for r in got] == [1, 2]
    for g, w in zip(got, want, strict=True):
        assert g["rollout/weight_version"] == g["step"] - 1  # samples carry the version that generated them
        assert 0 < g["rollout/engine_busy_s_min"] <= g["rollout/engine_busy_s_max"]
        assert g["rollout/running_seqs_mean"] > 0 and g["perf/decode_tokens_per_s"] > 0  # merged engine counters
        assert g["sync/bytes"] == w["sync/bytes"] > 0 and g["sync/gb_per_s"] > 0
        for k, v in computed(w).items():
            assert g[k] == pytest.approx(v, abs=1e-5), k
    a, b = weights(disaggregated_run), weights(local_run)
    assert max(float((a[n] - b[n]).abs().max()) for n in b) < 1e-5


def test_fsdp2_ranks_on_ray_train_like_one_process_and_engines_follow(tmp_path):
    """Planes driven directly, 2 colocated FSDP2 ranks: each update equals one process's on the same batch
    (rows dealt to ranks by token count, log-probs reassembled), and after each sync every engine's checksum
    equals the trainer's and an independent checksum of the gathered weights; samples carry the new version."""
    import copy

    from twinplane.cluster import build_planes
    from twinplane.rollout import SamplingParams
    from twinplane.run.prepare import prepare
    from twinplane.train import Batch, Trainer

    cfg = load_config(None, [*CLUSTER_RUN, *RAY, "cluster.colocate=true", "cluster.train_devices=2",
                             "cluster.rollout_devices=2", f"run_dir={tmp_path}", "train.lr=1e-2"])
    setup = prepare(cfg)
    planes = build_planes(cfg, setup.model, None, setup.tokenizer, log=lambda *_: None)
    local = Trainer(copy.deepcopy(setup.model), cfg.train, cfg.algo, 1.0, 10)
    try:
        prompts = [p.ids for p in setup.train_prompts[:5]]
        checksums = set()
        for version in (1, 2):
            samples = planes.rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=4))
            assert [s.request_index for s in samples] == [i for i in range(5) for _ in range(2)]
            assert {s.weight_version for s in samples} == {version - 1}
            batch = Batch.collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], 0,
                                  [s.logprobs for s in samples])
            batch.advantages = torch.linspace(-1, 1, len(batch))[:, None] * batch.response_mask
            batch.ref_logprobs = (batch.rollout_logprobs - 0.1) * batch.response_mask  # a KL term with gradient
            assert torch.allclose(planes.trainer.logprobs(batch), local.logprobs(batch), atol=1e-5)
            got, want = planes.trainer.train_step(batch), local.train_step(batch)
            for k, v in want.items():
                assert got[k] == pytest.approx(v, abs=1e-5), k
            report = planes.sync(version)
            assert [n.split(" (pid")[0] for n in report.checksums] == ["training rank 0 (and engine 0)",
                                                                        "training rank 1 (and engine 1)"]
            assert report.mismatched() == [] and report.bytes > 0
            policy = planes.state()["policy"]
            assert set(report.checksums.values()) == {weights_checksum(policy.items())}
            checksums.add(report.expected)
            for n, p in local.model.named_parameters():
                assert torch.allclose(policy[n], p, atol=1e-5), n
        assert len(checksums) == 2  # the updates changed the weights the engines hold
    finally:
        planes.close()
        setup.scorer.close()


COLOCATED2 = ["cluster.colocate=true", "cluster.train_devices=2", "cluster.rollout_devices=2"]


@pytest.fixture(scope="module")
def colocated_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("colocated")
    assert cluster_train(d, *RAY, *COLOCATED2) == 0
    return d


def test_colocated_fsdp2_run(colocated_run):
    """2 training ranks (FSDP2 over gloo), each hosting an engine: a 2-step run with checkpoints, sharded (each rank
    wrote its own file; no full weights or optimizer state in the checkpoint)."""
    got = rows(colocated_run)
    assert [r["step"] for r in got] == [1, 2]
    assert all(r["sync/bytes"] > 0 and r["rollout/weight_version"] == r["step"] - 1 for r in got)
    ckpt = colocated_run / "checkpoints" / "step_00000002"
    assert (ckpt / "manifest.json").exists()
    assert {p.name for p in (ckpt / "policy").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    assert not (ckpt / "optimizer.pt").exists() and not list((ckpt / "model").glob("*.safetensors"))


def test_sharded_checkpoint_on_ray_resumes_exactly_and_onto_one_rank(tmp_path, monkeypatch, colocated_run):
    """Preempted after step 1 with 2 training ranks (sharded checkpoint), resumed on 2 ranks: the uninterrupted
    run's weights and metrics, bitwise. The same checkpoint resumed on 1 rank (2 -> 1; the engine count changes with
    it, so sampling is reseeded: not bitwise) runs to the end."""
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    assert cluster_train(a, *RAY, *COLOCATED2, "checkpoint.every=0", fault="weight_sync@1",
                         monkeypatch=monkeypatch) == 75
    monkeypatch.delenv("TWINPLANE_FAULT")
    shutil.copytree(a, b)
    assert main(["train", "--run-dir", str(a), *CLUSTER_RUN, *RAY, *COLOCATED2, "checkpoint.every=0", "--resume",
                 "auto"]) == 0
    got, want = weights(a), weights(colocated_run)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert [computed(r) for r in rows(a)] == [computed(r) for r in rows(colocated_run)]
    assert main(["train", "--run-dir", str(b), *CLUSTER_RUN, *RAY, "cluster.colocate=true", "cluster.train_devices=1",
                 "cluster.rollout_devices=1", "checkpoint.every=0", "--resume", "auto"]) == 0
    assert [r["step"] for r in rows(b)] == [1, 2]


def test_killed_engine_names_worker_and_checkpoint_then_resumes(tmp_path, monkeypatch, capsys,
                                                              disaggregated_run):
    t0 = time.monotonic()
    assert cluster_train(tmp_path, *RAY, fault="kill:rollout engine 0@rollout@2", monkeypatch=monkeypatch) == 1
    assert time.monotonic() - t0 < 60 + 30  # within cluster.timeout_s (and nothing hangs)
    err = capsys.readouterr().err
    assert "rollout engine 0 (pid" in err and "died during rollout" in err, err
    assert "last complete checkpoint" in err and "step_00000001" in err, err
    time.sleep(1)  # resource accounting is asynchronous
    assert ray.available_resources().get("CPU") == 2  # the surviving actor and the placement group were released
    monkeypatch.delenv("TWINPLANE_FAULT")
    assert main(["train", "--run-dir", str(tmp_path), *CLUSTER_RUN, *RAY, "--resume", "auto"]) == 0
    assert [r["step"] for r in rows(tmp_path)] == [1, 2]
    a, b = weights(tmp_path), weights(disaggregated_run)
    assert all(torch.equal(a[n], b[n]) for n in b)  # resumed exactly: same weights as the uninterrupted run


def test_assign_rows_balances_load():
    loads = [9, 1, 1, 1, 8, 2]
    shares = assign_rows(loads, 2)
    assert sorted(i for s in shares for i in s) == list(range(6))
    assert [len(s) for s in shares] == [3, 3]
    assert abs(sum(loads[i] for i in shares[0]) - sum(loads[i] for i in shares[1])) <= 2
    free = assign_rows([10, 1, 1, 1], 2, balance_counts=False)  # engines: by load only
    assert free == [[0], [1, 2, 3]]


def test_bucket_plan_covers_every_tensor_in_order():
    shapes = [("a", torch.Size([10])), ("b", torch.Size([300])), ("c", torch.Size([5])), ("d", torch.Size([5]))]
    plan = bucket_plan(shapes, 4, 100 * 4)
    assert [[n for n, _ in b] for b in plan] == [["a"], ["b"], ["c", "d"]]
    assert [x for b in plan for x in b] == shapes


def test_sync_report_names_mismatched_engines():
    r = SyncReport(3, 7, {"rollout engine 0": 7, "rollout engine 1": 8}, 10, 0.1)
    assert r.mismatched() == ["rollout engine 1"]


@pytest.mark.parametrize(("override", "key"), [
    (["cluster.train_devices=2"], "cluster.backend"),
    (["cluster.backend=slurm"], "cluster.backend"),
    (["cluster.backend=ray", "cluster.colocate=true", "cluster.train_devices=2", "cluster.rollout_devices=3"],
     "cluster.rollout_devices"),
    (["rollout.tools=[calculator]"], "rollout.tools"),
])
def test_bad_cluster_config_names_the_key(override, key):
    with pytest.raises(ConfigError, match=f"^{key}"):
        load_config(None, override)


ASYNC = ["cluster.max_staleness=2", "cluster.async_schedule=3", "train.steps=4", "algo.entropy_coef=0.01",
         "train.lr=1e-2"]


@pytest.fixture(scope="module")
def async_local_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("async_local")
    assert cluster_train(d, *ASYNC) == 0
    return d


def test_fully_async_with_a_fixed_schedule_ray_equals_local(async_local_run, tmp_path):
    """On Ray the engine runs its scheduled steps while the trainer trains; in one process they run first, on the
    same weights. Same groups, same staleness, same corrected updates."""
    assert cluster_train(tmp_path, *RAY, *ASYNC) == 0
    got, want = rows(tmp_path), rows(async_local_run)
    assert max(r["async/staleness_max"] for r in got) == 2  # the bound is reached, never passed
    assert any(r["actor/tis_weight_mean"] != pytest.approx(1.0, abs=1e-6) for r in got)  # the lag is corrected
    assert got[-1]["async/overlap_s"] > 0
    for g, w in zip(got, want, strict=True):
        for k, v in computed(w).items():
            assert g[k] == pytest.approx(v, abs=1e-5), k


def test_async_in_process_rollout_rate_is_each_steps_own(async_local_run):
    """In one process a step's engine calls also generate later steps' groups; rates use the engine's own busy
    time, so no step is a thousandfold outlier."""
    rates = [r["perf/rollout_tokens_per_s"] for r in rows(async_local_run)]
    assert max(rates) < 20 * min(rates), rates


def test_async_resume_is_exact(async_local_run, tmp_path, monkeypatch):
    """The groups in flight and waiting at a checkpoint came from weights that no longer exist: saved with it."""
    assert cluster_train(tmp_path, *ASYNC, fault="train@2", monkeypatch=monkeypatch) == 75
    monkeypatch.delenv("TWINPLANE_FAULT")
    assert main(["train", "--run-dir", str(tmp_path), *CLUSTER_RUN, *ASYNC, "--resume", "auto"]) == 0
    a, b = weights(tmp_path), weights(async_local_run)
    assert all(torch.equal(a[n], b[n]) for n in b)
    assert [computed(r) for r in rows(tmp_path)] == [computed(r) for r in rows(async_local_run)]


FREE = ["cluster.max_staleness=2", "train.steps=5", "checkpoint.every=1"]


def exactly_once(run_dir) -> None:
    """Every prompt drawn from the data order was trained on once, filtered once or is still outstanding in the
    last checkpoint (in flight or waiting) — none skipped, none repeated."""
    steps = [r for r in rows(run_dir) if "data/draws" in r]
    state = json.loads((sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "state.json").read_text())
    p = state["controller"]["producer"]
    everything = [d for r in steps for d in r["data/draws"] + r["data/draws_filtered"]]
    everything += [g["draw"] for key in ("in_flight", "finished", "ready") for g in p[key]]
    assert sorted(everything) == list(range(len(everything)))


@pytest.mark.parametrize("fault", ["train@3", "kill:rollout engine 0@train@3"])
def test_free_running_async_on_ray_trains_every_prompt_exactly_once_across_faults(tmp_path, monkeypatch, fault):
    """The engine generates while the trainer trains, as long as it trains (not reproducible); a SIGTERM of the
    driver (checkpoint, exit 75) or a killed engine (the run stops; the last checkpoint is a step earlier) and a
    resume lose and repeat no prompt."""
    code = cluster_train(tmp_path, *RAY, *FREE, fault=fault, monkeypatch=monkeypatch)
    assert code == (75 if fault == "train@3" else 1)
    monkeypatch.delenv("TWINPLANE_FAULT")
    assert main(["train", "--run-dir", str(tmp_path), *CLUSTER_RUN, *RAY, *FREE, "--resume", "auto"]) == 0
    steps = [r for r in rows(tmp_path) if "data/draws" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert all(r["async/staleness_max"] <= 2 for r in steps) and any(r["async/overlap_s"] > 0 for r in steps)
    exactly_once(tmp_path)


def test_sigterm_to_a_driver_that_started_ray_is_a_preemption(tmp_path):
    """`twinplane train` starting (and stopping) its own Ray instance keeps its stop handling (Ray's driver
    installs handlers of its own that would exit at once): mid-run a checkpoint and exit 75; during the final save,
    after Ray has stopped, the run completes."""
    cmd = [sys.executable, "-m", "twinplane.cli", "train", "--run-dir", str(tmp_path), *CLUSTER_RUN, *RAY]
    for fault, code in (("train@2", 75), ("final@2", 0)):
        out = subprocess.run(cmd + ["--resume", "auto"] * (code == 0), env=os.environ | {"TWINPLANE_FAULT": fault},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == code, out.stderr[-2000:]
    assert [r["step"] for r in rows(tmp_path)] == [1, 2]
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_silent_worker_times_out_with_its_name():
    from types import SimpleNamespace

    from twinplane.cluster import WorkerError
    from twinplane.cluster.ray_planes import RayPlanes

    @ray.remote(num_cpus=0)
    class Sleeper:
        def sleep(self, s):
            time.sleep(s)

    actor = Sleeper.remote()
    fake = SimpleNamespace(timeout=1.0, _name=lambda a: "rollout engine 3")
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"^rollout engine 3: no answer to rollout within 1 s"):
        RayPlanes._wait(fake, [(actor, actor.sleep.remote(30))], "rollout")
    assert time.monotonic() - t0 < 5
    ray.kill(actor)


def test_unplaceable_cluster_is_a_clear_error_and_releases_resources(tmp_path, capsys):
    before = ray.available_resources().get("CPU")
    t0 = time.monotonic()
    assert cluster_train(tmp_path / "too_big", *RAY, "cluster.train_devices=2", "cluster.rollout_devices=2") == 2
    assert "4 workers of {'CPU': 1} need {'CPU': 4}, the Ray cluster has {'CPU': 2.0}" in capsys.readouterr().err
    assert time.monotonic() - t0 < 30  # at once, not after cluster.timeout_s
    # resources exist but are taken: wait up to cluster.timeout_s, then say so
    blocker = ray.util.placement_group([{"CPU": 1}])
    ray.get(blocker.ready())
    # a fresh run dir: the first one is claimed
    assert cluster_train(tmp_path / "taken", *RAY, "cluster.timeout_s=2") == 1
    assert "could not place 2 workers of {'CPU': 1} within 2 s" in capsys.readouterr().err
    ray.util.remove_placement_group(blocker)
    time.sleep(1)  # resource accounting is asynchronous
    assert ray.available_resources().get("CPU") == before  # the placement group was removed


def test_checkpoint_loads_on_another_rank_count(disaggregated_run):
    """A 1-rank checkpoint (named full-tensor optimizer state) loads into 2 FSDP2 ranks, which shard it; gathered
    back it is the same state, and the weights are the checkpoint's."""
    from twinplane.cluster import build_planes
    from twinplane.data import PromptStream
    from twinplane.run import run_state
    from twinplane.run.prepare import prepare

    ckpt = sorted((disaggregated_run / "checkpoints").iterdir())[-1]
    cfg = load_config(None, [*CLUSTER_RUN, *RAY, "cluster.colocate=true", "cluster.train_devices=2",
                             "cluster.rollout_devices=2"])
    setup = prepare(cfg)
    saved = run_state.restore(ckpt, policy=setup.model, reference=None, stream=PromptStream(setup.train_prompts, 0))
    planes = build_planes(cfg, setup.model, None, setup.tokenizer, log=lambda *_: None)
    try:
        planes.load_state(saved["optimizer"], saved["scheduler"], saved["engine_rng"], saved["weight_version"])
        got = planes.state()
        assert got["weight_version"] == saved["weight_version"] == 2
        assert set(got["optimizer"]["state"]) == set(saved["optimizer"]["state"])
        for name, st in saved["optimizer"]["state"].items():
            for k, v in st.items():
                assert torch.equal(got["optimizer"]["state"][name][k], v), (name, k)
        assert all(torch.equal(got["policy"][n], p) for n, p in setup.model.named_parameters())
    finally:
        planes.close()
        setup.scorer.close()


@pytest.mark.parametrize("mode", [[], ["cluster.max_staleness=2", "cluster.async_schedule=4"]],
                         ids=["sync", "async"])
def test_tool_rollouts_on_ray_equal_local(tmp_path, mode):
    """Multi-turn tool rollouts run inside the engine actor (tokenizer and tools travel with the worker spec),
    synchronously or streamed by the asynchronous producer."""
    import string

    from twinplane.model import ModelConfig, Transformer
    from twinplane.run.prepare import save_hf_folder
    from twinplane.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(string.printable[:95])  # covers the tool-call markup
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                                    num_heads=2, num_kv_heads=1, head_dim=16, eos_token_id=tok.eos_token_id,
                                    pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id))
    save_hf_folder(model, tok, tmp_path / "model")
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} plus {i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(1, 5)))
    args = [f"model.path={tmp_path / 'model'}", f"data.train_file={data}", "reward.name=gsm8k",
            "rollout.tools=[calculator]", "rollout.max_turns=2", "rollout.max_new_tokens=6", "train.steps=2",
            "rollout.prompts_per_step=2", "rollout.n=2", "log.progress=false", "eval.before=false",
            "checkpoint.every=0", "threads=1", *mode]
    for name, extra in (("local", []), ("ray", RAY)):
        assert main(["train", "--run-dir", str(tmp_path / name), *args, *extra]) == 0
    got, want = rows(tmp_path / "ray"), rows(tmp_path / "local")
    assert "rollout/turns_mean" in got[0]
    assert [computed(r) for r in got] == [computed(r) for r in want]


def test_sigterm_on_ray_checkpoints_and_resumes_exactly(tmp_path, monkeypatch, disaggregated_run):
    """Preemption of the driver: the step finishes, the checkpoint gathers state from the actors, exit 75."""
    assert cluster_train(tmp_path, *RAY, "checkpoint.every=0", fault="weight_sync@1", monkeypatch=monkeypatch) == 75
    monkeypatch.delenv("TWINPLANE_FAULT")
    assert main(["train", "--run-dir", str(tmp_path), *CLUSTER_RUN, *RAY, "checkpoint.every=0", "--resume",
                 "auto"]) == 0
    a, b = weights(tmp_path), weights(disaggregated_run)
    assert all(torch.equal(a[n], b[n]) for n in b)
    assert [computed(r) for r in rows(tmp_path)] == [computed(r) for r in rows(disaggregated_run)]


def test_ray_backend_without_ray_is_a_config_error(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert main(["train", "--run-dir", str(tmp_path), *CLUSTER_RUN, *RAY]) == 2
    assert "cluster.backend=ray needs Ray: pip install 'twinplane[cluster]'" in capsys.readouterr().err


def test_agents_on_ray_train_as_in_one_process_and_asynchronously_every_task_once(tmp_path):
    """Sessions' calls go to the engine actor and batch there: the same episodes, rewards and updates as in one
    process; with max_staleness=2 the episodes run on while the trainer actor trains, every task trained once."""
    pytest.importorskip("openai")
    (tmp_path / "agent.py").write_text(SUM_AGENT)
    agent = [f"agent.entrypoint={tmp_path / 'agent.py'}:run", "rollout.max_new_tokens=8"]
    assert cluster_train(tmp_path / "local", *agent) == 0
    assert cluster_train(tmp_path / "ray", *RAY, *agent) == 0
    got, want = rows(tmp_path / "ray"), rows(tmp_path / "local")
    for g, w in zip(got, want, strict=True):
        assert g["agent/episodes"] == w["agent/episodes"] == 16 and g["agent/splits"] == 0
        for k in ("reward/mean", "rollout/response_length_mean", "actor/pg_loss", "actor/grad_norm"):
            assert g[k] == pytest.approx(w[k], abs=1e-5), k
    a, b = weights(tmp_path / "ray"), weights(tmp_path / "local")
    assert max(float((a[n] - b[n]).abs().max()) for n in b) < 1e-5
    assert cluster_train(tmp_path / "async", *RAY, *agent, *FREE) == 0
    steps = rows(tmp_path / "async")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert all(r["async/staleness_max"] <= 2 for r in steps) and all(r["agent/errors"] == 0 for r in steps
                                                                     if r["agent/episodes"])
    exactly_once(tmp_path / "async")
