"""What the adapters need from twinplane itself, in the main environment: without their packages they are one-line
errors naming the extra to install, and an environment's `close()` runs once its episode ends (the OpenEnv
adapter ends sessions with it), also when the episode failed."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

pytest.importorskip("openai")

from twinplane.agents.openenv_adapter import is_openenv, openenv_environment  # noqa: E402
from twinplane.agents.runner import AgentRollout  # noqa: E402
from twinplane.agents.verifiers_adapter import verifiers_agent  # noqa: E402
from twinplane.cli import main  # noqa: E402
from twinplane.data.prompts import Prompt  # noqa: E402
from twinplane.errors import InputError  # noqa: E402
from twinplane.model import ModelConfig, Transformer  # noqa: E402
from twinplane.rollout import RolloutEngine, SamplingParams  # noqa: E402
from twinplane.tokenizer import build_char_tokenizer  # noqa: E402


def test_without_openenv_core_the_adapter_names_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core.env_client", None)  # (an import of it fails, installed or not)
    with pytest.raises(InputError, match=r"^OpenEnv environments need openenv-core \(pip install "
                                         r"'twinplane\[openenv\]'\): "):
        openenv_environment(object)


def test_without_verifiers_an_agent_file_using_it_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(InputError, match=r"verifiers package \(pip install 'twinplane\[verifiers\]'\)"):
        verifiers_agent("reverse-text")
    (tmp_path / "agent.py").write_text("from twinplane.agents.verifiers_adapter import verifiers_agent\n"
                                       "run = verifiers_agent('reverse-text')\n")
    assert main(["train", "--run-dir", str(tmp_path / "r"), "warmstart.steps=0", "model.hidden_size=32",
                 f"agent.entrypoint={tmp_path / 'agent.py'}:run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'twinplane[verifiers]'" in err.splitlines()[-1] and "Traceback" not in err


def test_gym_classes_are_not_taken_for_openenv_ones():
    class Guess:
        def reset(self, task):
            return ""

        def step(self, action):
            return "", 0.0, True

    assert not is_openenv(Guess) and not is_openenv(len)


def test_an_environments_close_runs_after_each_episode_even_a_failed_one(tmp_path):
    closed = tmp_path / "closed"
    (tmp_path / "env.py").write_text(textwrap.dedent(f"""
        class Twice:
            def reset(self, task):
                self.task = task
                return task["prompt"]

            def step(self, action):
                if self.task["answer"] == "021":
                    raise RuntimeError("the environment broke")
                return "=", 1.0, True

            async def close(self):
                open({str(closed)!r}, "a").write(self.task["answer"] + "\\n")
    """))
    tok = build_char_tokenizer("0123456789+=")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                                    num_heads=4, num_kv_heads=2, head_dim=8))
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    agents = AgentRollout(f"{tmp_path / 'env.py'}:Twice", engine, tok, SamplingParams(max_new_tokens=8, n=2), 16,
                          None, concurrency=4, timeout_s=30, max_turns=2, seed=0)
    rows = [{"prompt": "07+85=", "answer": "092"}, {"prompt": "10+11=", "answer": "021"}]
    try:
        samples, rewards, _, m = agents.run([Prompt(tok.encode(r["prompt"]), r["answer"], r["prompt"], r)
                                             for r in rows], step=0)
    finally:
        agents.close()
    assert m["agent/errors"] == 2 and rewards.tolist() == [1.0, 1.0]
    assert sorted(closed.read_text().split()) == ["021", "021", "092", "092"]
