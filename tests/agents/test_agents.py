"""Agents through the session endpoint: the samples are exactly the tokens each call saw and sampled (scored like
the trainer scores them), failures cost their episode only, a seeded agent run is bitwise reproducible, and bad
agents get one line."""

from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import SUM_AGENT, assert_multi_turn_logprobs_match_trainer, outcome, rows, train

pytest.importorskip("openai")

from twinplane.agents.runner import AgentRollout  # noqa: E402
from twinplane.cli import main  # noqa: E402
from twinplane.data.prompts import Prompt  # noqa: E402
from twinplane.errors import InputError  # noqa: E402
from twinplane.model import ModelConfig, Transformer  # noqa: E402
from twinplane.rollout import RolloutEngine, SamplingParams  # noqa: E402
from twinplane.tokenizer import build_char_tokenizer  # noqa: E402

HEAD = """
from openai import AsyncOpenAI, OpenAI
"""


def agent_file(tmp_path, body: str, name="agent.py"):
    path = tmp_path / name
    path.write_text(HEAD + textwrap.dedent(body))
    return f"{path}:run"


def rollout(spec, n=4, timeout_s=30.0, temperature=1.0):
    tok = build_char_tokenizer("0123456789+= ,?aginortwy\n")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                                    num_heads=4, num_kv_heads=2, head_dim=8))
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    sp = SamplingParams(temperature=temperature, max_new_tokens=40, n=n)
    return AgentRollout(spec, engine, tok, sp, 16, None, concurrency=8, timeout_s=timeout_s, max_turns=4,
                        seed=0), model, tok


PROBLEMS = [("07+85=", "092"), ("10+11=", "021"), ("33+44=", "077")]


def prompts(tok):
    return [Prompt(tok.encode(p), a, p, {"prompt": p, "answer": a, "level": 1}) for p, a in PROBLEMS]


def test_two_turn_episodes_are_one_sample_each_scored_as_the_trainer_scores_it(tmp_path):
    spec = agent_file(tmp_path, """
        async def run(base_url, task):
            client = AsyncOpenAI(base_url=base_url, api_key="none")
            first = await client.completions.create(model="policy", prompt=task["prompt"], max_tokens=6)
            text = first.choices[0].text
            again = task["prompt"] + text + " no, try again\\n" + task["prompt"]
            second = await client.completions.create(model="policy", prompt=again, max_tokens=6)
            return {"reward": float(second.choices[0].text == task["answer"]), "metrics": {"level": task["level"]}}
    """)
    agents, model, tok = rollout(spec)
    try:
        samples, rewards, correct, m = agents.run(prompts(tok), step=0)
    finally:
        agents.close()
    assert len(samples) == 12 and [s.request_index for s in samples] == sorted(s.request_index for s in samples)
    assert m["agent/episodes"] == 12 and m["agent/splits"] == 0 and m["agent/errors"] == 0
    assert m["agent/turns_mean"] == 2 and m["agent/level"] == 1.0
    feedback = tok.encode(" no, try again\n")
    for s, (p, _) in zip(samples, [x for x in PROBLEMS for _ in range(4)], strict=True):
        assert s.prompt_ids == tok.encode(p) and s.num_turns == 2
        cut = s.loss_mask.index(0)  # the first reply (up to its EOS, which the model saw), then the feedback
        assert s.token_ids[cut:cut + len(feedback)] == feedback
        assert s.token_ids[cut + len(feedback):cut + len(feedback) + len(p)] == tok.encode(p)
        assert s.loss_mask.count(0) == len(feedback) + len(p)
    assert_multi_turn_logprobs_match_trainer(model, samples, tok.pad_token_id, 1.0)
    assert rewards.shape == (12,) and correct.dtype == torch.bool


def test_an_agent_that_raises_hangs_or_returns_garbage_costs_that_episode_only(tmp_path):
    marks = tmp_path / "aborted"
    spec = agent_file(tmp_path, f"""
        import time

        def run(base_url, task):
            out = OpenAI(base_url=base_url, api_key="none").completions.create(model="policy",
                                                                               prompt=task["prompt"], max_tokens=4)
            if task["answer"] == "021":
                raise RuntimeError("tool crashed")
            if task["answer"] == "077":
                time.sleep(3)
            return "not a reward" if out.choices[0].index < 0 else 1.0

        def abort(task):
            open({str(marks)!r}, "a").write(task["answer"] + "\\n")
    """)
    agents, model, tok = rollout(spec, n=2, timeout_s=1.5)
    try:
        samples, rewards, _, m = agents.run(prompts(tok), step=3)
        assert m["agent/errors"] == 2 and m["agent/timeouts"] == 2 and m["agent/episodes"] == 6
        assert [s.request_index for s in samples] == [0, 0] and rewards.tolist() == [1.0, 1.0]
        assert marks.read_text().split() == ["077", "077"]
        again, *_ = agents.run(prompts(tok)[:1], step=4)  # the run goes on
        assert len(again) == 2
    finally:
        agents.close()


def test_every_episode_failing_is_an_input_error_naming_the_first(tmp_path):
    spec = agent_file(tmp_path, """
        def run(base_url, task):
            return {"score": 1}
    """)
    agents, _, tok = rollout(spec, n=1)
    try:
        with pytest.raises(InputError, match=r"every episode of step 0 failed, the first with: .*without 'reward'"):
            agents.run(prompts(tok), step=0)
    finally:
        agents.close()


AGENT_RUN = ["rollout.max_new_tokens=8"]


# Which calls share an engine step depends on when the agents' requests arrive, and a batch's composition moves a
# row's logits in the last bits (the engine's own caveat): the engine's log-probs, and what compares them, agree
# to ~1e-7 only; the weights, the samples' tokens and every reward are bitwise.
TIMING = ("rollout/running_seqs_mean", "rollout/kv_cache_usage_peak", "rollout/engine_steps", "actor/logprob_gap",
          "actor/ratio")


def same_run(a, b) -> bool:
    (wa, ma), (wb, mb) = outcome(a), outcome(b)
    return wa == wb and [{k: v for k, v in r.items() if k not in TIMING} for r in ma] == \
        [{k: v for k, v in r.items() if k not in TIMING} for r in mb]


@pytest.mark.slow
def test_a_seeded_agent_run_is_bitwise_reproducible_trains_on_policy_and_resumes_exactly_once(tmp_path):
    spec = agent_file(tmp_path, SUM_AGENT)
    a, b, cut = tmp_path / "a", tmp_path / "b", tmp_path / "cut"
    assert train(a, f"agent.entrypoint={spec}", *AGENT_RUN) == 0
    assert train(b, f"agent.entrypoint={spec}", *AGENT_RUN) == 0
    assert same_run(a, b)
    assert train(cut, f"agent.entrypoint={spec}", *AGENT_RUN, fault="rollout@3") == 75  # stopped mid-episodes
    assert train(cut, "--resume", "auto") == 0
    assert [r["step"] for r in rows(cut)] == [r["step"] for r in rows(a)]  # every step exactly once
    assert same_run(a, cut)
    steps = [r for r in rows(a) if "agent/episodes" in r]
    assert len(steps) == 6 and all(r["agent/episodes"] == 16 and r["agent/splits"] == 0 for r in steps)
    assert max(r["actor/logprob_gap"] for r in steps) < 1e-5


def test_bad_agent_settings_are_one_line_errors(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path / "r"), "agent.entrypoint=missing_agent.py:run"]) == 2
    err = capsys.readouterr().err
    assert "agent.entrypoint: agent '" in err and "missing_agent.py:run': cannot load (no such file" in err
    assert len(err.strip().splitlines()) == 1
    spec = agent_file(tmp_path, "def run(base_url, task):\n    return 1.0\n")
    bad = ["train", "--run-dir", str(tmp_path / "r"), f"agent.entrypoint={spec}", "algo.dynamic_sampling=true"]
    assert main(bad) == 2
    assert "agent.entrypoint: does not combine with algo.dynamic_sampling" in capsys.readouterr().err


def test_a_gym_style_environment_is_played_through_the_endpoint(tmp_path):
    (tmp_path / "env.py").write_text(textwrap.dedent("""
        class Countdown:
            \"\"\"Three rounds; each reply scores 1 when it starts with the digit asked for.\"\"\"

            def reset(self, task):
                self.left, self.want = 3, task["answer"][-1]
                return task["prompt"]

            async def step(self, action):
                self.left -= 1
                reward = float(action[:1] == self.want)
                return ("=" + task_echo(self.left), reward, self.left == 0)

        def task_echo(n):
            return str(n) + "="
    """))
    agents, model, tok = rollout(f"{tmp_path / 'env.py'}:Countdown", n=2)
    try:
        samples, rewards, _, m = agents.run(prompts(tok), step=0)
    finally:
        agents.close()
    assert m["agent/errors"] == 0 and m["agent/env_steps"] == 3.0 and m["agent/splits"] == 0
    assert all(s.num_turns <= 3 for s in samples) and len(samples) == 6
    for s in samples:  # the observations are in the sample, masked (cut where the budget ends); the replies trained
        seen = tok.decode([t for t, k in zip(s.token_ids, s.loss_mask, strict=True) if k == 0])
        assert "=2==1=".startswith(seen) and (seen == "=2==1=" or s.finish_reason == "length")
    assert_multi_turn_logprobs_match_trainer(model, samples, tok.pad_token_id, 1.0)
    assert rewards.max() <= 3.0


def test_moe_episodes_carry_the_routing_of_every_token_for_replay(tmp_path):
    """A two-call MoE episode: its sample's routing record (the last call's, which ran every earlier token) equals
    what the engine routes for the same tokens in one fresh forward."""
    from conftest import tiny_moe

    spec = agent_file(tmp_path, """
        def run(base_url, task):
            c = OpenAI(base_url=base_url, api_key="none")
            first = c.completions.create(model="policy", prompt=task["prompt"], max_tokens=5).choices[0].text
            c.completions.create(model="policy", prompt=task["prompt"] + first + "==" + task["prompt"], max_tokens=5)
            return 1.0
    """)
    tok = build_char_tokenizer("0123456789+=")
    model = tiny_moe(vocab_size=tok.vocab_size)
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id, record_routing=True)
    sp = SamplingParams(temperature=1.0, max_new_tokens=20, n=2)
    agents = AgentRollout(spec, engine, tok, sp, 16, None, concurrency=4, timeout_s=30, max_turns=4, seed=0)
    try:
        samples, *_ = agents.run(prompts(tok)[:2], step=0)
    finally:
        agents.close()
    assert len(samples) == 4 and all(s.num_turns == 2 for s in samples)
    for s in samples:
        ids = s.prompt_ids + s.token_ids
        assert s.routing.shape[0] == len(ids) and (s.routing[:-1] >= 0).all()
        fresh = engine.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=1))[0].routing
        assert torch.equal(fresh[:len(ids) - 1], s.routing[:-1])


@pytest.mark.slow
def test_an_agent_trains_lora_adapters(tmp_path):
    spec = agent_file(tmp_path, SUM_AGENT)
    assert train(tmp_path / "r", f"agent.entrypoint={spec}", *AGENT_RUN, "train.lora.rank=4", "train.lr=1e-3") == 0
    steps = [r for r in rows(tmp_path / "r") if "agent/episodes" in r]
    assert len(steps) == 6 and max(r["actor/logprob_gap"] for r in steps) < 1e-5
    assert (tmp_path / "r" / "final_adapter" / "adapter_model.safetensors").is_file()
