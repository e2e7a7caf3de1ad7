"""Prompts with tools render exactly as transformers' `apply_chat_template(..., tools=...)` renders them, for the
real Qwen2.5 and Qwen3 templates and Llama-3.1- and Qwen3-Coder-style ones, through multi-turn tool conversations."""

import json
from pathlib import Path

import pytest
from template_texts import LLAMA31, QWEN3, QWEN3_CODER, QWEN25

from twinplane.data.records import DataError
from twinplane.serving.templates import ChatTemplate

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city — \"quoted\" <b>&</b>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                   "units": {"type": "object"}, "hourly": {"type": "boolean"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time",
                                          "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, CLOCK]


def call(name, arguments, id_="c1"):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


# Calls with object arguments (as transformers' docs write them) and one with a JSON string (as OpenAI clients send).
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": "<think>\nTwo lookups.\n</think>\n\nChecking.",
     "tool_calls": [call("get_weather", {"city": "Paris", "days": 2}), call("get_time", {}, "c2")]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
    {"role": "assistant", "content": "<think>\nDone.\n</think>\n\n21 degrees at noon."},
    {"role": "user", "content": "And Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [call("get_weather", "{\"city\": \"Oslo\"}", "c3")]},
    {"role": "tool", "tool_call_id": "c3", "content": "{\"temp\": 3}"},
    {"role": "assistant", "content": "<think>\nCold.\n</think>\n\n3 degrees."},
]
LLAMA_CHAT = [m for m in CHAT if "<think>" not in (m.get("content") or "") or m.get("tool_calls")][:5]


def model_dir(path: Path, template: str, eos: str, bos: str | None = None, named: dict | None = None) -> Path:
    """A tiny tokenizer folder with `template`, saved by transformers the way model folders are."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, eos: 1, **({bos: 2} if bos else {})}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, unk_token="<unk>")
    fast.chat_template = named or template
    fast.save_pretrained(str(path))
    return path


def reference(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


CASES = {"qwen2.5": (QWEN25, "<|im_end|>", None, CHAT), "qwen3": (QWEN3, "<|im_end|>", None, CHAT),
         "llama3.1": (LLAMA31, "<|eot_id|>", "<|begin_of_text|>", [m for m in CHAT if m["role"] != "assistant"
                                                                      or "<think>" not in (m["content"] or "")]),
         "qwen3_coder": (QWEN3_CODER, "<|im_end|>", None, [m for m in CHAT if m.get("tool_calls") is None
                                                           or isinstance(m["tool_calls"][0]["function"]["arguments"],
                                                                         dict)])}


@pytest.mark.parametrize("name", CASES)
def test_every_prefix_renders_as_transformers_does(tmp_path, name):
    template, eos, bos, chat = CASES[name]
    folder = model_dir(tmp_path / name, template, eos, bos)
    ours, ref = ChatTemplate.from_model_dir(folder), reference(folder)
    assert ours.source == template and ours.special_tokens["eos_token"] == eos
    extra = {"date_string": "26 Jul 2024"} if name == "llama3.1" else {}
    compared = 0
    for j in range(2, len(chat) + 1):
        for tools in (TOOLS, None):
            for gen in (True, False):
                want = ref.apply_chat_template(chat[:j], tools=tools, tokenize=False, add_generation_prompt=gen,
                                               **extra)
                assert ours.render(chat[:j], tools, add_generation_prompt=gen, **extra) == want, (j, tools, gen)
                compared += 1
    assert compared >= 16


def test_qwen25_text_by_hand():
    """The text written out, so a shared mistake with transformers would still show."""
    t = ChatTemplate(QWEN25, {"eos_token": "<|im_end|>"})
    text = t.render(CHAT[:5], [CLOCK])
    assert text == (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(CLOCK) + "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
        "\"arguments\": <args-json-object>}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and the time?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo lookups.\n</think>\n\nChecking.\n"
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n12:00\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_string_arguments_are_passed_as_given():
    """Qwen3 prints a JSON string argument as it is; Qwen2.5 applies tojson to it, as it does under transformers."""
    turn = [CHAT[6], CHAT[7]]
    qwen3 = ChatTemplate(QWEN3).render(turn, TOOLS, add_generation_prompt=False)
    qwen25 = ChatTemplate(QWEN25).render(turn, TOOLS, add_generation_prompt=False)
    assert qwen3.endswith('<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                          '"arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n')
    assert qwen25.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
                           '"{\\"city\\": \\"Oslo\\"}"}\n</tool_call><|im_end|>\n')


def test_qwen3_keeps_reasoning_only_after_the_last_query():
    t = ChatTemplate(QWEN3)
    first = t.render(CHAT[:6], TOOLS)
    assert "<think>\nTwo lookups.\n</think>\n\nChecking." in first and "<think>\nDone.\n</think>" in first
    later = t.render(CHAT, TOOLS)
    assert "Two lookups." not in later and "Done." not in later and "<think>\nCold.\n</think>\n\n3 degrees." in later
    assert t.render(CHAT[:2], None, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reasoning_fields_and_null_content_as_transformers(tmp_path):
    folder = model_dir(tmp_path / "q3", QWEN3, "<|im_end|>")
    chat = [CHAT[1], {"role": "assistant", "content": "Hi.", "reasoning": "Greeting."},
            {"role": "assistant", "content": None, "thinking": "More.", "tool_calls": [call("get_time", {})]}]
    for gen in (True, False):
        want = reference(folder).apply_chat_template(chat, tools=TOOLS, tokenize=False, add_generation_prompt=gen)
        assert ChatTemplate.from_model_dir(folder).render(chat, TOOLS, gen) == want
    assert "<think>\nMore.\n</think>" in want


def test_tool_use_template_is_chosen_with_tools(tmp_path):
    named = {"default": "{{ 'plain:' + messages[0].content }}", "tool_use": "{{ 'tools:' + tools|length|string }}"}
    folder = model_dir(tmp_path / "named", "", "<|im_end|>", named=named)
    ours, ref = ChatTemplate.from_model_dir(folder), reference(folder)
    for tools in (None, TOOLS):
        want = ref.apply_chat_template([CHAT[1]], tools=tools, tokenize=False)
        assert ours.render([CHAT[1]], tools, add_generation_prompt=False) == want
    assert ours.source == named["default"] and ours.tools_source == named["tool_use"]


def test_errors_are_one_line(tmp_path):
    with pytest.raises(DataError, match=r"no such model folder"):
        ChatTemplate.from_model_dir(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no chat template \(no chat_template.jinja"):
        ChatTemplate.from_model_dir(tmp_path / "empty")
    with pytest.raises(DataError, match="chat template syntax error at template line 1"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(DataError, match=r"^chat template error: no tools here$"):
        ChatTemplate("{% if tools %}{{ raise_exception('no tools\n here') }}{% endif %}").render([CHAT[1]], TOOLS)
    with pytest.raises(DataError, match=r"^chat template error: "):  # Qwen3-Coder-style templates need objects
        ChatTemplate(QWEN3_CODER).render(CHAT[6:8], TOOLS)
