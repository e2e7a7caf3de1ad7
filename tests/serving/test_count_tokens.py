"""Anthropic's `POST /v1/messages/count_tokens`, through the official `anthropic` client against a real server: the
count is the prompt length `/v1/messages` uses for the same request (system, tools, a forced call's opener), in a
session the length of the trajectory the request extends (its ids, not the text encoded afresh) with nothing
recorded, and errors come in Anthropic's shape."""

from __future__ import annotations

import concurrent.futures

import pytest
from chat_model import chat_model_dir, record_calls, serving

from twinplane.rollout.sequence import Sample
from twinplane.serving.sessions import Session

anthropic = pytest.importorskip("anthropic")

TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(chat_model_dir(tmp_path_factory.mktemp("m")), name="tiny", max_model_len=1024,
                 api_key="sekret") as both:
        yield both


def claude(url, base="", key="sekret"):
    return anthropic.Anthropic(base_url=url + base, api_key=key, max_retries=0)


class Pieces:
    """Stands in for the engine: answers with `pieces` tokenized one by one (then the end-of-turn token), so the
    reply's ids are not its text tokenized afresh."""

    def __init__(self, served, pieces):
        self.max_model_len, self.served, self.pieces = 1024, served, pieces

    def submit(self, ids, sp, seed, on_tokens=None, key=None):
        tok = self.served.tokenizer
        out = [t for p in self.pieces for t in tok.encode(p)] + [tok.eos_token_id]
        f = concurrent.futures.Future()
        f.set_result([Sample(0, list(ids), out, [-0.5] * len(out), "stop", 0)])
        return f


def test_the_count_is_the_prompt_length_of_the_same_messages_request(server):
    served, url = server
    c = claude(url)
    cases = [{"messages": ASK}, {"system": "You help.", "messages": ASK},
             {"system": "You help.", "messages": ASK, "tools": TOOLS},
             {"system": "You help.", "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "any"}},
             {"system": "You help.", "messages": ASK, "tools": TOOLS,
              "tool_choice": {"type": "tool", "name": "get_weather"}}]
    counts = []
    calls = record_calls(served.loop)
    try:
        for case in cases:
            counts.append(c.messages.count_tokens(model="tiny", **case).input_tokens)
            r = c.messages.create(model="tiny", max_tokens=2, **case)
            assert counts[-1] == r.usage.input_tokens == len(calls[-1][0])
    finally:
        del served.loop.submit
    assert len(set(counts)) == len(cases) and counts[2] < counts[3] < counts[4]  # (an opener, a longer one)


def test_in_a_session_it_counts_the_trajectory_the_request_extends_and_records_nothing(server):
    served, url = server
    session = served.sessions.open(Session("c1", served.tokenizer))
    c = claude(url, "/sessions/c1")
    real, served.loop = served.loop, Pieces(served, ["<", "tool_call>", " maybe"])
    try:
        r = c.messages.create(model="m", max_tokens=20, messages=ASK)
    finally:
        served.loop = real
    messages = [*ASK, {"role": "assistant", "content": r.content[0].text}, {"role": "user", "content": "Sure?"}]
    before = (session.calls, session.splits, len(session.trajectories), list(session.current.token_ids))
    n = c.messages.count_tokens(model="m", messages=messages).input_tokens
    fresh = claude(url).messages.count_tokens(model="tiny", messages=messages).input_tokens
    assert (session.calls, session.splits, len(session.trajectories), session.current.token_ids) == before
    assert n == fresh + len("<tool_call>") - 1  # the sampled pieces, not the one token the text encodes to
    calls = record_calls(served.loop)
    try:
        r = c.messages.create(model="m", max_tokens=3, messages=messages)
    finally:
        del served.loop.submit
        served.sessions.close("c1")
    assert session.splits == 0 and n == r.usage.input_tokens == len(calls[0][0])


def test_count_tokens_errors_are_anthropics_and_the_server_stays_up(server):
    _, url = server
    with pytest.raises(anthropic.NotFoundError, match="model 'nope' not found"):
        claude(url).messages.count_tokens(model="nope", messages=ASK)
    with pytest.raises(anthropic.AuthenticationError, match="authentication_error"):
        claude(url, key="wrong").messages.count_tokens(model="tiny", messages=ASK)
    with pytest.raises(anthropic.NotFoundError, match="session 'ghost'"):
        claude(url, "/sessions/ghost").messages.count_tokens(model="tiny", messages=ASK)
    with pytest.raises(anthropic.BadRequestError, match="messages"):
        claude(url).messages.count_tokens(model="tiny", messages=[])
    with pytest.raises(anthropic.BadRequestError, match="'image' blocks are not served"):
        claude(url).messages.count_tokens(model="tiny", messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}]}])
    with pytest.raises(anthropic.BadRequestError, match="no tools to call"):
        claude(url).messages.count_tokens(model="tiny", messages=ASK, tool_choice={"type": "any"})
    assert claude(url).messages.count_tokens(model="tiny", messages=ASK).input_tokens > 0
