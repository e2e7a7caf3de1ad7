"""Tokens in, tokens out, end to end: 128 concurrent agent episodes of 4 chat turns with a tool, against a tiny
random model with a ChatML (Qwen2.5) template that has a tools section. Every trajectory is exactly the engine's
tokens call by call, no episode splits, and the trainer scores the sampled tokens as the engine did (fp32)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from conftest import assert_multi_turn_logprobs_match_trainer

pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))

from chat_model import chat_model_dir, record_calls  # noqa: E402

from twinplane.agents.runner import AgentRollout  # noqa: E402
from twinplane.data.prompts import Prompt  # noqa: E402
from twinplane.model.weights import load_model  # noqa: E402
from twinplane.rollout import RolloutEngine, SamplingParams  # noqa: E402
from twinplane.serving.templates import ChatTemplate  # noqa: E402
from twinplane.tokenizer import load_tokenizer  # noqa: E402

AGENT = """
import json
from openai import AsyncOpenAI

ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


async def run(base_url, task):
    client = AsyncOpenAI(base_url=base_url, api_key="none")
    messages = [{"role": "system", "content": "Use the add tool."}, {"role": "user", "content": task["prompt"]}]
    for turn in range(4):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD], max_tokens=12)
        m = r.choices[0].message  # (the reply as returned, calls included: a random model rarely makes one)
        messages.append(m.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": json.dumps({"sum": turn + 1})})
    return 1.0 if "4" in (m.content or "") else 0.0
"""


def test_128_four_turn_tool_sessions_train_on_exactly_the_engines_tokens(tmp_path):
    folder = chat_model_dir(tmp_path / "model", max_len=4096)
    (tmp_path / "agent.py").write_text(textwrap.dedent(AGENT))
    tok, model = load_tokenizer(folder), load_model(folder, "cpu", "float32")
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    sp = SamplingParams(temperature=1.0, max_new_tokens=1024, n=4)
    agents = AgentRollout(f"{tmp_path / 'agent.py'}:run", engine, tok, sp, 512, ChatTemplate.from_model_dir(folder),
                          concurrency=128, timeout_s=300, max_turns=4, seed=0)
    calls = record_calls(agents.loop)
    prompts = [Prompt(tok.encode(f"{i}+3="), str(i + 3), f"{i}+3=", {"prompt": f"What is {i}+3?"}) for i in range(32)]
    try:
        samples, _, _, m = agents.run(prompts, step=0)
    finally:
        agents.close()
    assert m["agent/episodes"] == 128 and m["agent/splits"] == 0 and m["agent/errors"] == 0
    assert len(samples) == 128 and all(s.num_turns == 4 for s in samples) and len(calls) == 512
    done = [(ids, f.result()[0].token_ids) for ids, f in calls]
    used = set()
    for s in samples:  # its 4 calls: each one's prompt is the trajectory so far, its sampled tokens follow at once
        whole = s.prompt_ids + s.token_ids
        mine = [k for k, (ids, out) in enumerate(done) if whole[:len(ids) + len(out)] == ids + out]
        assert len(mine) == 4 and sorted(len(done[k][0]) for k in mine)[0] == len(s.prompt_ids)
        used.update(mine)
    assert len(used) == 512
    assert_multi_turn_logprobs_match_trainer(model, samples, tok.pad_token_id, 1.0)  # (|gap| < 1e-5, fp32)
