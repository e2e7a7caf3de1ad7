"""`twinplane train rollout.backend=vllm` end to end on tiny settings: every step's weight sync verified by the
engine's checksum (a mismatch stops the run), the rollout-vs-trainer log-prob gap logged and small, truncated
importance sampling on for the engine mismatch; then `twinplane eval` of the trained model with either backend."""

import json

import pytest

pytest.importorskip("vllm")

from twinplane.cli import main  # noqa: E402

# head size 32: what vLLM's CPU attention takes (64 hidden / 2 heads)
TINY = ["model.hidden_size=64", "model.num_heads=2", "model.num_kv_heads=2", "model.intermediate_size=128",
        "model.num_layers=2", "warmstart.steps=30", "train.steps=3", "rollout.prompts_per_step=4", "rollout.n=4",
        "task.heldout_size=20", "log.progress=false", "algo.entropy_coef=0.01", "rollout.backend=vllm",
        "algo.recompute_old_logprobs=true"]  # the trainer's old log-probs: truncated IS against vLLM's


def test_train_with_vllm(tmp_path):
    assert main(["train", "--run-dir", str(tmp_path), *TINY]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/weight_version"] for r in rows] == [0, 1, 2]  # samples from the synced weights
    assert all(r["actor/logprob_gap"] < 1e-3 for r in rows)  # vLLM's log-probs vs the trainer's, fp32
    assert all(r["time/weight_sync"] > 0 for r in rows)
    assert all(abs(r["actor/tis_weight_mean"] - 1) < 1e-2 for r in rows)  # fp32 engines: nearly on-policy
    assert "val/accuracy" in rows[-1]
    results = {}
    for backend in ("twinplane", "vllm"):  # greedy on the held-out problems: the same answers either way
        out = tmp_path / f"eval_{backend}.json"
        assert main(["eval", "--model", str(tmp_path / "final"), "--out", str(out), "task.heldout_size=20",
                     f"rollout.backend={backend}"]) == 0
        results[backend] = json.loads(out.read_text())
    assert results["vllm"]["prompts"] == results["twinplane"]["prompts"] == 20
    for key in ("accuracy", "response_length", "truncated"):
        assert results["vllm"][key] == results["twinplane"][key], key
