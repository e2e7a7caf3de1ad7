"""verifiers environments through the session endpoint: a taskset built with verifiers' own classes (a task whose
weighted rewards and metric read the reply), played by verifiers' tool-less `null` harness, its model calls relayed
to the episodes' sessions. Each episode's reward is what the task's rewards compute from the reply the sample
trains on, the tokens are the engine's and scored as the trainer scores them; a short `twinplane train` through it;
bad settings are one-line errors. Runs in its own virtual environment (.ci/agent-envs-lane: verifiers pins
openai<3); skipped without verifiers, or without `uv` (verifiers runs its harnesses' programs through it)."""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import assert_multi_turn_logprobs_match_trainer, rows, train

pytest.importorskip("verifiers.v1")
if shutil.which("uv") is None:
    pytest.skip("verifiers runs its harnesses' chat programs through uv, which is not on PATH",
                allow_module_level=True)
sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))

from chat_model import chat_model_dir, record_calls  # noqa: E402

from twinplane.agents.runner import AgentRollout  # noqa: E402
from twinplane.cli import main  # noqa: E402
from twinplane.data.prompts import Prompt  # noqa: E402
from twinplane.errors import InputError  # noqa: E402
from twinplane.model.weights import load_model  # noqa: E402
from twinplane.rollout import RolloutEngine, SamplingParams  # noqa: E402
from twinplane.serving.templates import ChatTemplate  # noqa: E402
from twinplane.tokenizer import load_tokenizer  # noqa: E402

TASKSET = '''
import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def digits(self, trace: vf.Trace) -> float:
        return float(sum(c.isdigit() for c in trace.last_reply))

    @vf.reward(weight=0.5)
    async def brevity(self, trace: vf.Trace) -> float:
        return 1.0 / (1 + len(trace.last_reply))

    @vf.metric
    async def chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        return [SumTask(SumData(prompt=f"{a}+{a}=", answer=str(2 * a))) for a in range(4)]


__all__ = ["SumTaskset"]
'''
AGENT = """
from twinplane.agents.verifiers_adapter import verifiers_agent

run = verifiers_agent("tp_sum_taskset", env={"agent": {"harness": {"id": "null"}}})
"""


def expected_reward(reply: str) -> float:
    """The task's rewards, weighted: digits x 1 + brevity x 0.5."""
    return sum(c.isdigit() for c in reply) + 0.5 / (1 + len(reply))


@pytest.fixture(scope="module")
def agent_spec(tmp_path_factory) -> str:
    """The taskset as an installed package (`tp_sum_taskset`, verifiers' id for it) and an agent file for it."""
    root = tmp_path_factory.mktemp("verifiers")
    (root / "tp_sum_taskset.py").write_text(TASKSET)
    (root / "agent.py").write_text(textwrap.dedent(AGENT))
    sys.path.insert(0, str(root))
    yield f"{root / 'agent.py'}:run"
    sys.path.remove(str(root))


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("chat") / "model")


def rollout(folder: Path, spec: str, n: int = 2):
    tok, model = load_tokenizer(folder), load_model(folder, "cpu", "float32")
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    sp = SamplingParams(temperature=1.0, max_new_tokens=48, n=n)
    agents = AgentRollout(spec, engine, tok, sp, 256, ChatTemplate.from_model_dir(folder), concurrency=8,
                          timeout_s=300, max_turns=4, seed=0)
    return agents, model, tok


def prompts(tok, rows_: list[dict]) -> list[Prompt]:
    return [Prompt(tok.encode(r["prompt"]), r.get("answer", ""), r["prompt"], r) for r in rows_]


def test_episodes_are_scored_by_the_tasks_rewards_on_the_replies_the_samples_train_on(agent_spec, chat_folder):
    agents, model, tok = rollout(chat_folder, agent_spec)
    calls = record_calls(agents.loop)
    try:
        samples, rewards, _, m = agents.run(prompts(tok, [{"prompt": "3+3=", "answer": "6"},
                                                          {"prompt": "7+7=", "answer": "14"}]), step=0)
    finally:
        agents.close()
    assert m["agent/episodes"] == 4 and m["agent/errors"] == 0 and m["agent/splits"] == 0
    assert len(samples) == 4 and all(s.num_turns == 1 for s in samples)  # (the null harness: one chat turn)
    done = [(ids, f.result()[0].token_ids) for ids, f in calls]
    replies = []
    for s, reward, task in zip(samples, rewards.tolist(), ["3+3="] * 2 + ["7+7="] * 2, strict=True):
        assert s.loss_mask == [1] * len(s.token_ids)
        ids = s.token_ids[:-1] if s.token_ids[-1] == tok.eos_token_id else s.token_ids  # (the client never sees it)
        reply = tok.decode(ids, skip_special_tokens=False).strip()  # (as verifiers' `trace.last_reply` reads it)
        replies.append(reply)
        assert reward == pytest.approx(expected_reward(reply), rel=1e-6)  # (float32)
        prompt = tok.decode(s.prompt_ids, skip_special_tokens=False)
        assert prompt.endswith(f"<|im_start|>user\n{task}<|im_end|>\n<|im_start|>assistant\n")
        assert [(ids_, out) for ids_, out in done if ids_ + out == s.prompt_ids + s.token_ids] != []
    assert m["agent/chars"] == pytest.approx(sum(map(len, replies)) / 4)
    assert m["agent/digits"] == pytest.approx(sum(sum(c.isdigit() for c in r) for r in replies) / 4)
    assert len(set(rewards.tolist())) > 1
    assert_multi_turn_logprobs_match_trainer(model, samples, tok.pad_token_id, 1.0)


def test_a_row_the_task_cannot_take_fails_its_episode_with_verifiers_error(agent_spec, chat_folder):
    agents, _, tok = rollout(chat_folder, agent_spec, n=1)
    try:
        with pytest.raises(InputError, match=r"every episode of step 0 failed, the first with: ValidationError: "
                                             r"1 validation error for SumData"):
            agents.run(prompts(tok, [{"prompt": "3+3="}]), step=0)  # (no answer: the task's data needs one)
    finally:
        agents.close()


def test_a_short_training_run_through_the_taskset(agent_spec, chat_folder, tmp_path):
    run = ["warmstart.steps=0", "train.steps=3", "rollout.prompts_per_step=2", "rollout.n=2",
           "rollout.max_new_tokens=16", "task.heldout_size=8", "eval.before=false", "eval.every=0",
           "log.progress=false", "checkpoint.every=0", "train.micro_batch_size=4"]
    assert train(tmp_path / "run", f"model.path={chat_folder}", f"agent.entrypoint={agent_spec}", args=run) == 0
    steps = [r for r in rows(tmp_path / "run") if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["agent/episodes"] == 4 and r["agent/errors"] == 0 and "agent/digits" in r for r in steps)


def test_a_taskset_that_is_not_installed_is_a_one_line_error(agent_spec, tmp_path, capsys):
    (tmp_path / "agent.py").write_text("from twinplane.agents.verifiers_adapter import verifiers_agent\n"
                                       "run = verifiers_agent('no_such_taskset')\n")
    assert main(["train", "--run-dir", str(tmp_path / "r"), "warmstart.steps=0", "model.hidden_size=32",
                 f"agent.entrypoint={tmp_path / 'agent.py'}:run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "verifiers environment 'no_such_taskset': ModuleNotFoundError: taskset 'no_such_taskset' not found" \
        in err.splitlines()[-1] and "Traceback" not in err
