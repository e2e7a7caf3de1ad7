"""Agents with `cluster.max_staleness >= 1`: episodes run on while the trainer trains, within the staleness bound;
every task of the data order trains exactly once across a stop and a resume; the engine is lent out (weight sync,
validation, checkpoint) only between calls."""

from __future__ import annotations

import json
import textwrap
import threading
import time

import pytest
import torch
from conftest import rows, train

pytest.importorskip("openai")

from twinplane.model import ModelConfig, Transformer  # noqa: E402
from twinplane.rollout import RolloutEngine, SamplingParams  # noqa: E402
from twinplane.run import checkpoint  # noqa: E402
from twinplane.serving.engine_loop import EngineLoop  # noqa: E402

# Each episode waits on "its environment" before answering, as real agents do: the trainer works meanwhile.
SLOW_SUM_AGENT = """
import asyncio
from openai import AsyncOpenAI

CLIENT = AsyncOpenAI(base_url="http://unused/v1", api_key="none")

async def run(base_url, task):
    await asyncio.sleep(0.02)
    out = await CLIENT.with_options(base_url=base_url).completions.create(model="policy", prompt=task["prompt"],
                                                                          max_tokens=8)
    return {"reward": float(out.choices[0].text.strip() == task["answer"]), "metrics": {"waited": 1.0}}
"""
ASYNC_AGENT_RUN = ["cluster.max_staleness=2", "rollout.max_new_tokens=8", "checkpoint.every=1"]


def accounting(run_dir) -> list[int]:
    """Every task drawn: trained, used up, or outstanding at the last checkpoint (data-order places)."""
    steps = [r for r in rows(run_dir) if "data/draws" in r]
    state = json.loads((checkpoint.list_checkpoints(run_dir)[-1] / "state.json").read_text())
    p = state["controller"]["producer"]
    return [d for r in steps for d in r["data/draws"] + r["data/draws_filtered"]] + \
        [g["draw"] for key in ("in_flight", "finished", "ready") for g in p[key]]


@pytest.mark.slow
def test_asynchronous_episodes_stay_within_the_bound_and_every_task_trains_once_across_a_resume(tmp_path):
    spec = tmp_path / "agent.py"
    spec.write_text(textwrap.dedent(SLOW_SUM_AGENT))
    run_dir = tmp_path / "run"
    assert train(run_dir, f"agent.entrypoint={spec}:run", *ASYNC_AGENT_RUN, fault="rollout@4") == 75
    assert train(run_dir, "--resume", "auto") == 0
    steps = [r for r in rows(run_dir) if "data/draws" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]  # each step once
    assert all(r["async/staleness_max"] <= 2 for r in steps)
    assert max(r["async/staleness_max"] for r in steps) >= 1  # episodes of older weights did train
    ended = [r for r in steps if r["agent/episodes"]]  # (a step may train only on groups that ended before it)
    assert ended and all(r["agent/splits"] == 0 and r["agent/errors"] == 0 and r["agent/waited"] == 1.0
                         for r in ended)
    assert all(len(r["data/draws"]) == 4 for r in steps)  # rollout.prompts_per_step groups per step
    everything = accounting(run_dir)
    assert sorted(everything) == list(range(len(everything))), "a task skipped or trained twice"
    assert sum(r["agent/episodes"] for r in steps) >= 6 * 4 * 4  # (episodes that ended, in each step's window)


def test_a_run_whose_episodes_all_fail_stops_with_the_first_error(tmp_path, capsys):
    spec = tmp_path / "bad_agent.py"
    spec.write_text("def run(base_url, task):\n    return 'yes'\n")
    assert train(tmp_path / "run", f"agent.entrypoint={spec}:run", "cluster.max_staleness=1") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "prompts in a row had every episode fail, the first with: " in err and "not a finite reward" in err


def test_the_engine_is_lent_out_between_calls_only():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                    num_kv_heads=2, head_dim=8))
    loop = EngineLoop(RolloutEngine(model, eos_token_id=None, pad_token_id=0), max_model_len=64)
    sp = SamplingParams(temperature=1.0, max_new_tokens=40)
    try:
        running = loop.submit([1, 2, 3], sp, seed=0)
        time.sleep(0.01)
        with loop.held():
            assert running.done()  # the call in flight finished first
            waiting = loop.submit([4, 5, 6], sp, seed=1)  # accepted, not refused...
            time.sleep(0.2)
            assert not waiting.done()  # ...but not served while the engine is lent out
            lent = threading.get_ident()
        assert len(waiting.result(timeout=60)[0].token_ids) == 40 and lent == threading.get_ident()
    finally:
        loop.close()


@pytest.mark.slow
def test_asynchronous_moe_episodes_replay_their_routing_and_train_lora_adapters(tmp_path):
    spec = tmp_path / "agent.py"
    spec.write_text(textwrap.dedent(SLOW_SUM_AGENT))
    run_dir = tmp_path / "run"
    assert train(run_dir, f"agent.entrypoint={spec}:run", "cluster.max_staleness=1", "rollout.max_new_tokens=8",
                 "model.num_experts=4", "rollout.record_routing=true", "algo.routing_replay=true",
                 "train.lora.rank=4", "train.lr=1e-3", "train.steps=4") == 0
    steps = [r for r in rows(run_dir) if "data/draws" in r]
    assert len(steps) == 4 and max(r["async/staleness_max"] for r in steps) == 1
    assert all(r["rollout/routing_agreement"] == 1.0 for r in steps)  # the trainer ran the recorded experts
    assert (run_dir / "final_adapter" / "adapter_model.safetensors").is_file()
