"""Tool calls parsed back out of assistant turns that the real templates rendered (the text a model trained on
them writes), plus hand-written samples: several calls, reasoning, malformed calls kept as content."""

import json

import pytest
from template_texts import LLAMA31, QWEN3, QWEN3_CODER, QWEN25
from test_templates import TOOLS, call

from twinplane.errors import InputError
from twinplane.serving.templates import ChatTemplate
from twinplane.serving.tool_parsers import (
    TOOL_PARSERS,
    ParsedMessage,
    ToolCall,
    detect_tool_parser,
    json_object_members,
    resolve_tool_parser,
    split_reasoning,
    tool_parser,
)

USER = [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"}]
ARGS = [{"city": "São Paulo", "days": 3}, {"city": "Oslo", "days": 1, "units": {"temp": "C"}, "hourly": True}]


def sampled(template: str, assistant: dict, end: str) -> str:
    """What the model writes for `assistant`: the template's rendering of the turn after the generation prompt."""
    t = ChatTemplate(template)
    prompt = t.render(USER, TOOLS, add_generation_prompt=True)
    whole = t.render([*USER, assistant], TOOLS, add_generation_prompt=False)
    assert whole.startswith(prompt)
    turn = whole[len(prompt):]
    assert turn.rstrip("\n").endswith(end)
    return turn.rstrip("\n")[: -len(end)]


@pytest.mark.parametrize("template, name, end", [(QWEN25, "hermes", "<|im_end|>"), (QWEN3, "hermes", "<|im_end|>"),
                                                 (QWEN3_CODER, "qwen3_coder", "<|im_end|>"),
                                                 (LLAMA31, "llama3_json", "<|eot_id|>")],
                         ids=["qwen2.5", "qwen3", "qwen3_coder", "llama3.1"])
def test_round_trip_through_the_template(template, name, end):
    assert detect_tool_parser(template) == name
    content = None if name == "llama3_json" else "Looking up both."
    msg = {"role": "assistant", "content": content,
           "tool_calls": [call("get_weather", ARGS[0]), call("get_weather", ARGS[1], "c2")]}
    text = sampled(template, msg, end)
    parsed = TOOL_PARSERS[name](text, TOOLS)
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == ARGS
    assert parsed.content == content
    if name != "qwen3_coder":  # the arguments' text is the rendered text itself, not a re-serialisation
        for c in parsed.tool_calls:
            assert c.arguments in text
    # and a client that sends the calls back as strings gets the same text from a template that prints strings
    if template is QWEN3:
        back = {**msg, "tool_calls": [call(c.name, c.arguments) for c in parsed.tool_calls]}
        assert sampled(QWEN3, back, end) == text


def test_qwen3_reasoning_before_calls():
    msg = {"role": "assistant", "content": "<think>\nCompare two cities.\n</think>\n\n",
           "tool_calls": [call("get_weather", ARGS[0])]}
    text = sampled(QWEN3, msg, "<|im_end|>")
    assert text.startswith("<think>\nCompare two cities.\n</think>\n\n<tool_call>")
    assert resolve_tool_parser("auto", QWEN3)(text) == ParsedMessage(
        None, "Compare two cities.", [ToolCall("get_weather", '{"city": "São Paulo", "days": 3}')])


def test_arguments_are_kept_exactly_as_sampled():
    text = '<tool_call>\n{"name": "f", "arguments": {"b":1,  "a": [1.50, "x\\u00e9"]}}\n</tool_call>'
    assert tool_parser("hermes")(text).tool_calls == [ToolCall("f", '{"b":1,  "a": [1.50, "x\\u00e9"]}')]
    assert tool_parser("hermes")('<tool_call>{"name": "g"}</tool_call>').tool_calls == [ToolCall("g", "{}")]
    members, end = json_object_members(' {"k" : {"x": [1, {"y": 2}]} , "n": null} tail')
    assert members == {"k": ({"x": [1, {"y": 2}]}, '{"x": [1, {"y": 2}]}'), "n": (None, "null")}
    assert end == len(' {"k" : {"x": [1, {"y": 2}]} , "n": null}')


def test_reasoning_forms():
    assert split_reasoning("<think>\nA\n</think>\n\nB") == ("A", "B")
    assert split_reasoning("A</think>\n\nB") == ("A", "B")  # the prompt opened <think>
    assert split_reasoning("<think>\nstill thinking") == ("still thinking", "")  # cut short
    assert split_reasoning("no tags") == (None, "no tags")
    assert split_reasoning("x <think>y</think> z") == (None, "x <think>y</think> z")  # not leading
    parsed = tool_parser("hermes")("plan</think>\n\nDone.")
    assert parsed == ParsedMessage("Done.", "plan", [])
    assert tool_parser("llama3_json")("<think>r</think>\n" + '{"name": "f", "parameters": {}}').reasoning == "r"


@pytest.mark.parametrize("name, text", [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),  # unbalanced JSON
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g"'),  # cut short
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "a=1"}\n</tool_call>'),  # arguments not an object
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}} trailing\n</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n"),  # cut short
    ("qwen3_coder", "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}'),
    ("llama3_json", '{"name": "f", "parameters": {}} and then some words'),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")'),
])
def test_malformed_calls_stay_content(name, text):
    parsed = TOOL_PARSERS[name](text, TOOLS)
    assert parsed.tool_calls == [] and parsed.content == text  # (exactly as sampled)


def test_several_calls_and_plain_replies():
    hermes = tool_parser("hermes")('A\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\nB\n'
                                   '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    assert hermes == ParsedMessage("A\nB", None, [ToolCall("f", '{"x": 1}'), ToolCall("g", "{}")])
    llama = tool_parser("llama3_json")('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", '
                                       '"parameters": {"y": "z"}};')
    assert llama == ParsedMessage(None, None, [ToolCall("f", '{"x": 1}'), ToolCall("g", '{"y": "z"}')])
    for name in TOOL_PARSERS:
        assert TOOL_PARSERS[name]("Just an answer. {braces} ok", TOOLS) == ParsedMessage("Just an answer. {braces} ok")
        assert TOOL_PARSERS[name]("", TOOLS) == ParsedMessage("")  # (a reply without calls is its text, even empty)


def test_qwen3_coder_values_follow_the_schema():
    schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
        "s": {"type": "string"}, "l": {"type": "array"}, "bad": {"type": "integer"}}}}}]
    text = ("<tool_call>\n<function=f>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in [
        ("n", "42"), ("x", "2.5"), ("b", "True"), ("o", '{"k": [1]}'), ("s", "007"), ("l", "[1, 2]"),
        ("bad", "many"), ("free", "line one\nline two")]) + "</function>\n</tool_call>")
    (c,) = tool_parser("qwen3_coder")(text, schema).tool_calls
    assert json.loads(c.arguments) == {"n": 42, "x": 2.5, "b": True, "o": {"k": [1]}, "s": "007", "l": [1, 2],
                                       "bad": "many", "free": "line one\nline two"}
    (untyped,) = tool_parser("qwen3_coder")(text).tool_calls  # no schema: strings
    assert json.loads(untyped.arguments)["n"] == "42"


def test_choosing_a_parser():
    assert set(TOOL_PARSERS) == {"hermes", "qwen3_coder", "llama3_json"}
    assert detect_tool_parser("{{ messages }}") is None
    assert resolve_tool_parser("llama3_json", QWEN25) is TOOL_PARSERS["llama3_json"]  # a name overrides detection
    with pytest.raises(InputError, match=r"^/m: no known tool-call format in the chat template; name one "
                                         r"\(hermes, qwen3_coder, llama3_json\)"):
        resolve_tool_parser("auto", "{{ messages }}", "/m")
    with pytest.raises(InputError, match=r"unknown tool-call format 'mistral' \(known: hermes"):
        resolve_tool_parser("mistral", QWEN25)
