"""Anthropic's Messages API and OpenAI's Responses API against a real uvicorn server (plain httpx): greedy text equals
the chat route's for the same conversation, a session driven through them with a tool round trip keeps one
trajectory of exactly the tokens each call saw (the prompt is the chat template's rendering of the equivalent chat
messages), Anthropic's stream adds up to the whole reply, errors come in each protocol's shape."""

from __future__ import annotations

import json

import httpx
import pytest
from chat_model import Scripted, chat_model_dir, serving

from twinplane.serving.sessions import Session

KEY = {"x-api-key": "sekret"}
CHAT = [{"role": "system", "content": "You add."}, {"role": "user", "content": "What is 2+3?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": SCHEMA}}

# the conversations of the tool round trips, as transformers' chat templates take them (arguments a mapping)
SAME = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "x", "content": "sunny"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(chat_model_dir(tmp_path_factory.mktemp("m")), name="tiny", max_model_len=1024,
                 api_key="sekret") as both:
        yield both


def post(url, path, body, headers=KEY):
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def sse(url, path, body) -> list[tuple[str, dict]]:
    with httpx.stream("POST", url + path, json=body, headers=KEY, timeout=60) as r:
        assert r.status_code == 200, r.text
        text = "".join(r.iter_text())
    events = []
    for chunk in text.strip().split("\n\n"):
        kind, data = (line.split(": ", 1)[1] for line in chunk.split("\n"))
        assert json.loads(data)["type"] == kind
        events.append((kind, json.loads(data)))
    return events


def assert_one_exact_trajectory(served, session, script):
    """No split, and the trajectory is each call's prompt followed by exactly what it sampled."""
    t = session.current
    assert session.splits == 0 and len(session.trajectories) == 1 and t.calls == len(script.prompts)
    for ids, out in script.prompts:
        assert t.ids[:len(ids)] == ids and t.ids[len(ids):len(ids) + len(out)] == out
    assert sum(t.loss_mask) == sum(len(out) for _, out in script.prompts)


def test_greedy_text_equals_the_chat_route(server):
    served, url = server
    chat = post(url, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 20,
                                              "temperature": 0}).json()
    text, prompt_tokens = chat["choices"][0]["message"]["content"], chat["usage"]["prompt_tokens"]
    assert len(text) >= 6
    for system, user in [("You add.", "What is 2+3?"),
                         ([{"type": "text", "text": "You add."}], [{"type": "text", "text": "What is 2+3?"}])]:
        r = post(url, "/v1/messages", {"model": "tiny", "max_tokens": 20, "temperature": 0, "system": system,
                                       "messages": [{"role": "user", "content": user}]}).json()
        assert r["type"] == "message" and r["id"].startswith("msg_") and r["content"] == [{"type": "text",
                                                                                            "text": text}]
        assert r["stop_reason"] == {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
        assert r["usage"] == {"input_tokens": prompt_tokens, "output_tokens": chat["usage"]["completion_tokens"]}
    stop = text[3:5]
    r = post(url, "/v1/messages", {"model": "tiny", "max_tokens": 20, "temperature": 0, "system": "You add.",
                                   "messages": [{"role": "user", "content": "What is 2+3?"}],
                                   "stop_sequences": ["never there", stop]}).json()
    assert (r["content"][0]["text"], r["stop_reason"], r["stop_sequence"]) == \
        (text[:text.find(stop)], "stop_sequence", stop)
    r = post(url, "/v1/responses", {"model": "tiny", "instructions": "You add.", "input": "What is 2+3?",
                                    "max_output_tokens": 20, "temperature": 0}).json()
    assert r["object"] == "response" and r["output_text"] == text
    assert r["output"][0]["content"] == [{"type": "output_text", "text": text, "annotations": []}]
    assert r["usage"]["input_tokens"] == prompt_tokens
    r = post(url, "/v1/responses", {"model": "tiny", "input": [{"role": "developer", "content": "You add."},
                                                               {"role": "user", "content": "What is 2+3?"}],
                                    "max_output_tokens": 3, "temperature": 0}).json()
    assert (r["status"], r["output_text"], r["usage"]["output_tokens"]) == ("incomplete", text[:3], 3)


def test_the_anthropic_stream_adds_up_to_the_reply(server):
    served, url = server
    body = {"model": "tiny", "max_tokens": 20, "temperature": 0, "system": "You add.",
            "messages": [{"role": "user", "content": "What is 2+3?"}]}
    whole = post(url, "/v1/messages", body).json()
    events = sse(url, "/v1/messages", body | {"stream": True})
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == ["content_block_stop",
                                                                                    "message_delta", "message_stop"]
    assert "".join(e["delta"]["text"] for k, e in events if k == "content_block_delta") == whole["content"][0]["text"]
    assert events[-2][1]["delta"]["stop_reason"] == whole["stop_reason"]
    assert events[-2][1]["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    assert events[0][1]["message"]["usage"]["input_tokens"] == whole["usage"]["input_tokens"]

    real, served.loop = served.loop, Scripted(served, [CALL])
    try:  # with tools the parsed blocks come at the end: the call's input as JSON deltas
        tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": SCHEMA}]
        events = sse(url, "/v1/messages", body | {"stream": True, "tools": tools})
    finally:
        served.loop = real
    start = next(e for k, e in events if k == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["name"] == "get_weather"
    partial = "".join(e["delta"]["partial_json"] for k, e in events if k == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris"} and events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_a_messages_session_with_a_tool_round_trip_keeps_its_exact_tokens(server):
    served, url = server
    session = served.sessions.open(Session("a1", served.tokenizer))
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": SCHEMA}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]
    script = Scripted(served, [CALL, "It is sunny."])
    real, served.loop = served.loop, script
    try:
        r = post(url, "/sessions/a1/v1/messages", {"model": "m", "max_tokens": 50, "system": "You help.",
                                                   "tools": tools, "messages": messages}).json()
        assert r["stop_reason"] == "tool_use" and [b["type"] for b in r["content"]] == ["tool_use"]
        use = r["content"][0]
        assert (use["name"], use["input"]) == ("get_weather", {"city": "Paris"})
        messages += [{"role": "assistant", "content": r["content"]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                   "content": [{"type": "text", "text": "sunny"}]}]}]
        r = post(url, "/sessions/a1/v1/messages", {"model": "m", "max_tokens": 50, "system": "You help.",
                                                   "tools": tools, "messages": messages}).json()
        assert r["content"] == [{"type": "text", "text": "It is sunny."}] and r["stop_reason"] == "end_turn"
        want = served.template.render(SAME, tools=[WEATHER], add_generation_prompt=True)
        assert served.tokenizer.decode(script.prompts[1][0], skip_special_tokens=False) == want
    finally:
        served.loop = real
    messages += [{"role": "assistant", "content": r["content"]}, {"role": "user", "content": "Thanks. And Lyon?"}]
    spy_script = Scripted(served, [])  # the real engine's turn, its prompt and sample kept as the script's
    submit = served.loop.submit

    def spy(ids, sp, seed, on_tokens=None, key=None):
        f = submit(ids, sp, seed, on_tokens, key)
        f.add_done_callback(lambda f: spy_script.prompts.append((list(ids), f.result()[0].token_ids)))
        return f

    served.loop.submit = spy
    try:
        r = post(url, "/sessions/a1/v1/messages", {"model": "m", "max_tokens": 12, "system": "You help.",
                                                   "tools": tools, "messages": messages})
        assert r.status_code == 200, r.text
    finally:
        served.loop.submit = submit
        served.sessions.close("a1")
    script.prompts += spy_script.prompts
    assert_one_exact_trajectory(served, session, script)


def test_a_responses_session_with_a_function_call_round_trip(server):
    served, url = server
    session = served.sessions.open(Session("r1", served.tokenizer))
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": SCHEMA}]
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]
    script = Scripted(served, [CALL, "It is sunny."])
    real, served.loop = served.loop, script
    try:
        r = post(url, "/sessions/r1/v1/responses", {"model": "m", "instructions": "You help.", "tools": tools,
                                                    "input": items}).json()
        assert r["status"] == "completed" and [o["type"] for o in r["output"]] == ["function_call"]
        call = r["output"][0]
        assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "Paris"}')
        items += r["output"] + [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]
        r = post(url, "/sessions/r1/v1/responses", {"model": "m", "instructions": "You help.", "tools": tools,
                                                    "input": items}).json()
        assert r["output_text"] == "It is sunny." and r["usage"]["output_tokens"] == len("It is sunny.") + 1
    finally:
        served.loop = real
        served.sessions.close("r1")
    assert_one_exact_trajectory(served, session, script)
    want = served.template.render(SAME, tools=[WEATHER], add_generation_prompt=True)
    assert served.tokenizer.decode(script.prompts[1][0], skip_special_tokens=False) == want


def test_errors_come_in_each_protocols_shape_and_the_server_stays_up(server):
    _, url = server
    ok = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}

    def anthropic_error(r, status, kind, match):
        assert r.status_code == status and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == kind and match in r.json()["error"]["message"]

    anthropic_error(post(url, "/v1/messages", {k: v for k, v in ok.items() if k != "max_tokens"}), 400,
                    "invalid_request_error", "max_tokens")
    anthropic_error(post(url, "/sessions/ghost/v1/messages", ok), 404, "not_found_error", "session 'ghost'")
    anthropic_error(post(url, "/v1/messages", ok, {"x-api-key": "wrong"}), 401, "authentication_error", "key")
    anthropic_error(post(url, "/v1/messages", ok | {"model": "nope"}), 404, "not_found_error", "model 'nope'")
    anthropic_error(post(url, "/v1/messages", ok | {"tool_choice": {"type": "any"}}), 400, "invalid_request_error",
                    "tool_choice")
    image = {"role": "user", "content": [{"type": "image", "source": {}}]}
    anthropic_error(post(url, "/v1/messages", ok | {"messages": [image]}), 400, "invalid_request_error", "image")
    r = httpx.post(url + "/v1/messages", content=b"{not json", headers=KEY)
    anthropic_error(r, 400, "invalid_request_error", "JSON")

    def openai_error(r, status, match):
        assert r.status_code == status and match in r.json()["error"]["message"]

    base = {"model": "tiny", "input": "hi", "max_output_tokens": 3}
    openai_error(post(url, "/v1/responses", base | {"previous_response_id": "resp_1"}), 400, "previous_response_id")
    openai_error(post(url, "/sessions/ghost/v1/responses", base), 404, "session 'ghost'")
    openai_error(post(url, "/v1/responses", base | {"tool_choice": "required"}), 400, "tool_choice")
    openai_error(post(url, "/v1/responses", base | {"input": [{"type": "item_reference", "id": "x"}]}), 400,
                 "item_reference")
    openai_error(post(url, "/v1/responses", {"model": "tiny"}), 400, "input")
    assert post(url, "/v1/messages", ok).json()["type"] == "message"


def test_both_protocols_convert_to_the_chat_messages_written_out_by_hand():
    from twinplane.serving import anthropic_api, responses_api

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    want = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "let me look", "tool_calls": [call], "reasoning_content": "hmm"},
            {"role": "tool", "tool_call_id": "c1", "content": "r"}, {"role": "user", "content": "more"}]
    req = anthropic_api.MessagesRequest(model="m", max_tokens=5, system=[{"type": "text", "text": "S"}], messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                          {"type": "text", "text": "let me look"},
                                          {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "r"},
                                     {"type": "text", "text": "more", "cache_control": {"type": "ephemeral"}}]}])
    assert anthropic_api.chat_messages(req) == want
    req = responses_api.ResponsesRequest(model="m", instructions="S", input=[
        {"role": "user", "content": "q"}, {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "r"},
        {"role": "user", "content": [{"type": "input_text", "text": "more"}]}])
    assert responses_api.chat_messages(req) == want
    parsed = {"role": "assistant", "content": "let me look", "reasoning_content": "hmm",
              "tool_calls": [{"id": "call_c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert anthropic_api.content_blocks(parsed) == [
        {"type": "thinking", "thinking": "hmm", "signature": ""}, {"type": "text", "text": "let me look"},
        {"type": "tool_use", "id": "toolu_c1", "name": "f", "input": {"a": 1}}]
    assert [(o["type"], o.get("call_id")) for o in responses_api.output_items(parsed)] == \
        [("reasoning", None), ("message", None), ("function_call", "call_c1")]
