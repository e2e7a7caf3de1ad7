"""Forced tool calls (`tool_choice` `required` or a named function) without constrained decoding, through the
official clients against a real server: the prompt ends with the opening of a call as the template writes it, the
reply is parsed with it in front, and in a session the opener is prompt-side (loss mask 0) and the next request
extends the trajectory without a split. Every other choice is a 400 in the protocol's shape."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from chat_model import Scripted, chat_model_dir, record_calls, serving
from template_texts import LLAMA31, QWEN3, QWEN3_CODER, QWEN25

from twinplane.serving.sessions import Session
from twinplane.serving.templates import ChatTemplate
from twinplane.serving.tool_parsers import CALL_OPENERS, TOOL_PARSERS, ParsedMessage, ToolCall, register_tool_parser

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": SCHEMA}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time",
                                          "parameters": {"type": "object", "properties": {}}}}
CHAT = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}]
ANY = '<tool_call>\n{"name": "'
NAMED = '<tool_call>\n{"name": "get_weather", "arguments": '
AFTER_ANY = 'get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'  # what a model writes after each opener
AFTER_NAMED = '{"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(chat_model_dir(tmp_path_factory.mktemp("m")), name="tiny", max_model_len=1024) as both:
        yield both


@contextmanager
def scripted(served, texts):
    real, served.loop = served.loop, Scripted(served, texts)
    try:
        yield served.loop
    finally:
        served.loop = real


def text_of(served, ids) -> str:
    return served.tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("source,fmt,end", [(QWEN25, "hermes", "<|im_end|>"), (QWEN3, "hermes", "<|im_end|>"),
                                            (LLAMA31, "llama3_json", "<|eot_id|>"),
                                            (QWEN3_CODER, "qwen3_coder", "<|im_end|>")])
def test_each_formats_opener_is_how_its_template_begins_a_call(source, fmt, end):
    template = ChatTemplate(source, {"bos_token": "<|begin_of_text|>", "eos_token": end})
    prompt = template.render(CHAT, tools=[WEATHER, CLOCK])
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    later = template.render([*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], tools=[WEATHER, CLOCK])
    opener = CALL_OPENERS[fmt]
    for name in (None, "get_weather"):
        assert later.startswith(prompt + opener.text(name))
    reply = later[len(prompt):].split(end)[0]
    assert TOOL_PARSERS[fmt](reply, [WEATHER]).tool_calls == [ToolCall("get_weather", '{"city": "Paris"}')]


def test_a_forced_calls_prompt_ends_with_the_opener_and_its_reply_is_read_after_it(server):
    served, url = server
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    calls = record_calls(served.loop)
    try:
        r = c.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER, CLOCK], tool_choice="required",
                                      max_tokens=8, temperature=0)
    finally:
        del served.loop.submit
    (ids, future), = calls
    assert text_of(served, ids) == served.template.render(CHAT, tools=[WEATHER, CLOCK]) + ANY
    assert r.usage.prompt_tokens == len(ids)
    sample = future.result()[0]
    sampled = sample.token_ids[:-1] if sample.finish_reason == "stop" else sample.token_ids
    # the tiny random model writes no well-formed call: its reply is the content, after the opener
    assert r.choices[0].message.content == ANY + text_of(served, sampled) and not r.choices[0].message.tool_calls

    with scripted(served, [AFTER_ANY, AFTER_NAMED]) as loop:
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = c.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER, CLOCK], tool_choice=choice)
            call = r.choices[0].message.tool_calls[0]
            assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
            assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert text_of(served, loop.prompts[1][0]).endswith("<|im_start|>assistant\n" + NAMED)


def test_in_a_session_the_opener_is_prompt_side_and_the_next_request_extends_the_trajectory(server):
    served, url = server
    session = served.sessions.open(Session("f1", served.tokenizer))
    c = openai.OpenAI(base_url=url + "/sessions/f1/v1", api_key="x", max_retries=0)
    messages = list(CHAT)
    try:
        with scripted(served, ["Which Paris?", AFTER_ANY, "It is sunny."]) as loop:
            r = c.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "France."}]
            r = c.chat.completions.create(model="m", messages=messages, tools=[WEATHER], tool_choice="required")
            call = r.choices[0].message.tool_calls[0]
            messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
            r = c.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
            assert r.choices[0].message.content == "It is sunny."
    finally:
        served.sessions.close("f1")
    t = session.current
    assert session.splits == 0 and len(session.trajectories) == 1 and t.calls == 3
    for ids, out in loop.prompts:  # each call's prompt is the trajectory so far, and what it sampled follows
        assert t.ids[:len(ids)] == ids and t.ids[len(ids):len(ids) + len(out)] == out
    forced = loop.prompts[1][0]
    opener = served.tokenizer.encode(ANY)
    assert forced[-len(opener):] == opener
    at = len(forced) - len(t.prompt_ids)  # the opener: appended to the trajectory, not sampled
    assert t.loss_mask[at - len(opener):at] == [0] * len(opener) and t.logprobs[at - len(opener):at] == \
        [0.0] * len(opener)
    assert t.loss_mask[at:at + len(loop.prompts[1][1])] == [1] * len(loop.prompts[1][1])
    assert sum(t.loss_mask) == sum(len(out) for _, out in loop.prompts)


def test_anthropic_any_and_tool_force_a_call_and_a_session_keeps_one_trajectory(server):
    served, url = server
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": SCHEMA},
             {"name": "get_time", "description": "The time", "input_schema": {"type": "object", "properties": {}}}]
    session = served.sessions.open(Session("a2", served.tokenizer))
    c = anthropic.Anthropic(base_url=url + "/sessions/a2", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    try:
        with scripted(served, [AFTER_NAMED, AFTER_ANY, "Sunny twice."]) as loop:
            r = c.messages.create(model="m", max_tokens=50, system="You help.", tools=tools, messages=messages,
                                  tool_choice={"type": "tool", "name": "get_weather"})
            use = r.content[0]
            assert (r.stop_reason, use.type, use.name, use.input) == ("tool_use", "tool_use", "get_weather",
                                                                      {"city": "Paris"})
            messages += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": "sunny"}, {"type": "text", "text": "Again?"}]}]
            r = c.messages.create(model="m", max_tokens=50, system="You help.", tools=tools, messages=messages,
                                  tool_choice={"type": "any"})
            use = r.content[0]
            assert (r.stop_reason, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
            messages += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": "sunny"}]}]
            r = c.messages.create(model="m", max_tokens=50, system="You help.", tools=tools, messages=messages)
            assert r.content[0].text == "Sunny twice."
    finally:
        served.sessions.close("a2")
    t = session.current
    assert session.splits == 0 and len(session.trajectories) == 1 and t.calls == 3
    assert text_of(served, t.prompt_ids).endswith("<|im_start|>assistant\n" + NAMED)  # (the first call's prompt)
    assert text_of(served, loop.prompts[1][0]).endswith("<|im_start|>assistant\n" + ANY)
    assert sum(t.loss_mask) == sum(len(out) for _, out in loop.prompts)


def test_a_responses_named_function_forces_the_call_and_its_output_extends_the_session(server):
    served, url = server
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": SCHEMA}]
    session = served.sessions.open(Session("r2", served.tokenizer))
    c = openai.OpenAI(base_url=url + "/sessions/r2/v1", api_key="x", max_retries=0)
    items: list = [{"role": "user", "content": "Weather in Paris?"}]
    try:
        with scripted(served, [AFTER_NAMED, "It is sunny."]) as loop:
            r = c.responses.create(model="m", instructions="You help.", input=items, tools=tools,
                                   tool_choice={"type": "function", "name": "get_weather"})
            call = r.output[0]
            assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", '{"city": "Paris"}')
            assert r.tool_choice.name == "get_weather"
            items += [o.model_dump(exclude_none=True) for o in r.output]
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"})
            r = c.responses.create(model="m", instructions="You help.", input=items, tools=tools)
            assert r.output_text == "It is sunny."
    finally:
        served.sessions.close("r2")
    assert session.splits == 0 and session.current.calls == 2
    assert text_of(served, loop.prompts[0][0]).endswith(NAMED)


def test_choices_that_cannot_be_forced_are_400s_and_the_server_stays_up(server):
    served, url = server
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

    def chat(**kw):
        return c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, **kw)

    with pytest.raises(openai.BadRequestError, match="tool_choice names 'get_time', which is not one of"):
        chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}})
    with pytest.raises(openai.BadRequestError, match="the request has no tools to call"):
        chat(tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="not served"):
        chat(tools=[WEATHER], tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}})
    with pytest.raises(openai.BadRequestError, match="tool_choice 'file_search': not served"):
        c.responses.create(model="tiny", input="hi", tools=[{"type": "function", "name": "f", "parameters": {}}],
                           tool_choice={"type": "file_search"})
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    ask = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(anthropic.BadRequestError, match="tool_choice 'tool': not served"):
        claude.messages.create(**ask, tool_choice={"type": "tool"},
                               tools=[{"name": "f", "input_schema": {"type": "object"}}])
    with pytest.raises(anthropic.BadRequestError, match="no tools to call"):
        claude.messages.create(**ask, tool_choice={"type": "any"})
    real = served.template  # a generation prompt that opens reasoning: the call would be written inside it
    served.template = ChatTemplate(QWEN25.replace("{{- '<|im_start|>assistant\\n' }}",
                                                  "{{- '<|im_start|>assistant\\n<think>\\n' }}"), real.special_tokens)
    try:
        with pytest.raises(openai.BadRequestError, match="opens reasoning in the generation prompt"):
            chat(tools=[WEATHER], tool_choice="required")
        assert chat(tools=[WEATHER]).choices[0].message is not None
    finally:
        served.template = real
    register_tool_parser("plain")(lambda text, tools=None: ParsedMessage(text))  # a format with no opener
    served.tool_parser = "plain"
    try:
        with pytest.raises(openai.BadRequestError, match="the tool-call format 'plain' declares no call opener"):
            chat(tools=[WEATHER], tool_choice="required")
        assert chat(tools=[WEATHER]).choices[0].message is not None  # (auto: served with any format)
    finally:
        served.tool_parser = "auto"
        del TOOL_PARSERS["plain"]
    assert chat().choices[0].message.content is not None
