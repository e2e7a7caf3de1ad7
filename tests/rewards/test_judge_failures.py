"""What a failed judgement scores: against a local judge that answers 500 or too late, a sample whose judgement
fails after its retries fails (0, reward/errors) by default, or scores `reward.judge_failure_score`; either way it
counts in reward/judge_failures. Only judge failures get the score (also when the function wraps the error), and
a judgement that succeeds on a retry keeps its real score."""

from __future__ import annotations

import http.server
import json
import textwrap
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from twinplane.config import ConfigError, load_config
from twinplane.rewards.judge import JudgeSettings
from twinplane.rewards.runner import RewardRunner
from twinplane.run.prepare import start_judge

REWARDS = textwrap.dedent("""
    def judged(completion, answer, judge):
        return 1.0 if judge.ask(f"Is {completion} {answer}?").startswith("yes") else 0.5

    def wrapped(completion, answer, judge):
        try:
            return judged(completion, answer, judge)
        except Exception as e:
            raise ValueError("could not judge") from e

    def broken(completion, answer, judge):
        raise ValueError("not a judgement")

    def batch(completions, answers, judge):
        replies = judge.ask_many([f"Is {c} {a}?" for c, a in zip(completions, answers)])
        return [1.0 if r.startswith("yes") else 0.5 for r in replies]
    batch.batched = True
""")


class _Judge(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("content-length", 0)))
        server = self.server
        with server.lock:
            server.hits += 1
            fail = server.fail_first > 0 or server.mode == "500"
            server.fail_first -= 1
        if server.mode == "slow":
            time.sleep(server.delay)
        body = {"error": "down"} if fail else {"choices": [{"message": {"role": "assistant", "content": "yes"}}]}
        try:
            self.send_response(500 if fail else 200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())
        except OSError:  # (the client gave up waiting)
            pass

    def log_message(self, *args):
        pass


@contextmanager
def judge_server(mode: str, fail_first: int = 0, delay: float = 0.0):
    """A judge on 127.0.0.1 that answers 500 ("500"), after `delay` s ("slow"), or "yes" after `fail_first` 500s."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    server.daemon_threads = True
    server.mode, server.fail_first, server.delay, server.hits, server.lock = mode, fail_first, delay, 0, \
        threading.Lock()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "judged_rewards.py"
    path.write_text(REWARDS)
    return path


def score(path, fn: str, url: str, failure_score: float | None, n: int = 2, **judge):
    settings = JudgeSettings(url, model="m", retries=1, timeout_s=5.0, failure_score=failure_score) if not judge \
        else JudgeSettings(url, model="m", failure_score=failure_score, **judge)
    with RewardRunner(f"{path}:{fn}", judge=settings, timeout_s=20.0) as runner:
        rewards, metrics = runner([f"c{i}" for i in range(n)], ["a"] * n)
        return rewards, metrics, runner.last_error


def test_a_judgement_that_fails_after_its_retries_fails_its_sample_or_scores_the_failure_score(rewards_file):
    with judge_server("500") as (server, url):
        rewards, metrics, why = score(rewards_file, "judged", url, None)
        assert rewards == [0.0, 0.0] and metrics["reward/errors"] == 2 and metrics["reward/judge_failures"] == 2
        assert why.startswith("sample 0: judgement failed: JudgeError: judge") and "failed after 2 attempts (500" in why
        assert server.hits == 4  # each judgement: a first attempt and one retry
        for fn in ("judged", "wrapped", "batch"):
            rewards, metrics, why = score(rewards_file, fn, url, 0.25)
            assert rewards == [0.25, 0.25] and why is None, fn
            assert metrics["reward/errors"] == 0 and metrics["reward/judge_failures"] == 2, fn
        rewards, metrics, why = score(rewards_file, "broken", url, 0.25)  # not a judgement: a failed sample
        assert rewards == [0.0, 0.0] and metrics["reward/errors"] == 2 and metrics["reward/judge_failures"] == 0
        assert why == "sample 0: ValueError: not a judgement"


def test_a_judge_that_times_out_scores_the_failure_score(rewards_file):
    with judge_server("slow", delay=3.0) as (server, url):
        t0 = time.monotonic()
        rewards, metrics, _ = score(rewards_file, "judged", url, -1.0, n=1, retries=1, timeout_s=0.3)
        assert rewards == [-1.0] and metrics["reward/judge_failures"] == 1 and metrics["reward/errors"] == 0
        assert server.hits == 2 and time.monotonic() - t0 < 3.0  # (two attempts of 0.3 s, not the judge's 3 s)


def test_a_judgement_that_succeeds_on_a_retry_keeps_its_score(rewards_file):
    with judge_server("ok", fail_first=1) as (server, url):
        rewards, metrics, _ = score(rewards_file, "judged", url, 0.25)
        assert rewards == [1.0, 1.0] and metrics["reward/judge_failures"] == 0 and server.hits == 3


def test_the_config_key_reaches_the_judge_settings():
    def settings(*overrides):
        cfg = load_config(None, ["reward.judge=http://127.0.0.1:9/v1", *overrides])
        return start_judge(cfg, torch.device("cpu"))[0]

    assert settings().failure_score is None
    assert settings("reward.judge_failure_score=0.5").failure_score == 0.5
    with pytest.raises(ConfigError, match="reward.judge_failure_score"):
        settings("reward.judge_failure_score=high")
