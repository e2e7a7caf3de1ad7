"""`twinplane train rollout.backend=vllm cluster.backend=ray` on tiny settings: vLLM engines as Ray actors, one
engine actor beside one training rank (disaggregated: weights broadcast, then loaded into vLLM by name) and one
training rank hosting its engine (colocated: loaded in-process). Every sync is verified by the engine's checksum,
computed inside vLLM's own process (a mismatch stops the run), and the log-prob gap shows the engine samples from
the trainer's updated weights (with the engine left at its starting weights it is 0.02-0.05 here)."""

import json

import pytest
import torch

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from conftest import ray_init  # noqa: E402

from twinplane.cli import main  # noqa: E402

# head size 32: what vLLM's CPU attention takes (64 hidden / 2 heads)
TINY = ["model.hidden_size=64", "model.num_heads=2", "model.num_kv_heads=2", "model.intermediate_size=128",
        "model.num_layers=2", "warmstart.steps=30", "train.steps=3", "rollout.prompts_per_step=4", "rollout.n=4",
        "task.heldout_size=8", "eval.before=false", "log.progress=false", "algo.entropy_coef=0.01",
        "rollout.backend=vllm", "algo.recompute_old_logprobs=true", "cluster.backend=ray", "cluster.cpus_per_worker=1",
        "threads=1", "cluster.timeout_s=300"]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    threads = torch.get_num_threads()
    ray_init(num_cpus=2)
    yield
    ray.shutdown()
    torch.set_num_threads(threads)


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("placement", [
    ["cluster.colocate=false", "cluster.train_devices=1", "cluster.rollout_devices=1"],
    ["cluster.colocate=true", "cluster.train_devices=1"],
], ids=["disaggregated", "colocated"])
def test_train_with_vllm_engine_actors(tmp_path, capsys, placement):
    assert main(["train", "--run-dir", str(tmp_path), *TINY, *placement]) == 0
    colocated = "cluster.colocate=true" in placement
    log = " ".join(capsys.readouterr().err.split())  # (the console wraps long lines)
    assert f"ray: 1 training rank(s) + 1 engine(s) {'colocated' if colocated else 'disaggregated'}" in log
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [r["rollout/weight_version"] for r in got] == [0, 1, 2]  # samples from the synced weights
    assert all(r["sync/bytes"] > 0 and r["time/weight_sync"] > 0 for r in got)
    assert all(r["actor/grad_norm"] > 0 for r in got)  # every update moved the weights the engine must follow
    assert all(r["actor/logprob_gap"] < 1e-3 for r in got)  # vLLM's log-probs vs the trainer's, fp32
    assert "val/accuracy" in got[-1]
