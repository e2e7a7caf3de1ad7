"""LLM judges: a reward function that takes `judge` gets a client of an OpenAI-compatible model; a model folder is
served by the run itself; answers are cached within a step; failures are retried, then fail their sample only."""

from __future__ import annotations

import socket
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import rows, train

sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))
from chat_model import chat_model_dir, serving  # noqa: E402

from twinplane.rewards.judge import Judge, JudgeError, JudgeSettings  # noqa: E402


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("judge"))


def test_the_judge_asks_caches_within_a_step_and_fails_after_its_retries(judge_folder):
    with serving(judge_folder, name="j", max_model_len=600) as (_, url):
        url += "/v1"
        judge = Judge(JudgeSettings(url, concurrency=4))
        first = judge.ask("Is 2+2 4?", max_tokens=6)
        calls = judge.calls  # (/models, then the question)
        assert judge.ask("Is 2+2 4?", max_tokens=6) == first and judge.calls == calls == 2
        assert judge.ask_many(["a?", "b?", "a?"], max_tokens=6)[0] == judge.ask("a?", max_tokens=6)
        judge.new_step()
        assert judge.ask("Is 2+2 4?", max_tokens=6) == first and judge.calls > calls  # greedy: the same reply
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with pytest.raises(JudgeError, match="failed after 2 attempts"):
        Judge(JudgeSettings(dead, model="m", retries=1, timeout_s=2)).ask("anyone?")


@pytest.mark.slow
def test_a_run_scored_by_a_judge_that_it_serves_itself(tmp_path, judge_folder):
    (tmp_path / "judged.py").write_text(textwrap.dedent("""
        def reward(completion, answer, prompt, judge):
            verdict = judge.ask(f"Question {prompt} answered {completion}; the reference is {answer}. Right?",
                                max_tokens=4)
            return 1.0 if completion.strip() == answer else 0.25 + 0.0 * len(verdict)
    """))
    assert train(tmp_path / "run", f"reward.name={tmp_path / 'judged.py'}:reward", f"reward.judge={judge_folder}",
                 "train.steps=2", "eval.every=0") == 0
    steps = [r for r in rows(tmp_path / "run") if "reward/errors" in r and "reward/mean" in r]
    assert len(steps) == 2 and all(r["reward/errors"] == 0 and r["reward/mean"] >= 0.25 for r in steps)


def test_a_reward_that_takes_a_judge_without_one_is_a_one_line_error(tmp_path, capsys):
    from twinplane.cli import main

    (tmp_path / "judged.py").write_text("def reward(completion, answer, judge):\n    return 1.0\n")
    assert train(tmp_path / "run", f"reward.name={tmp_path / 'judged.py'}:reward") == 2
    assert "takes a judge: set reward.judge" in capsys.readouterr().err
    assert main(["train", "--run-dir", str(tmp_path / "r2"), "reward.judge=/nowhere"]) == 2
    assert "reward.judge: /nowhere is neither an http(s) URL nor a model folder" in capsys.readouterr().err
