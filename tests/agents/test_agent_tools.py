"""Tools from typed functions: their schemas equal transformers' `get_json_schema` (up to how a nullable type is
written), bad functions are one-line TypeErrors, and a model's calls (good, malformed, mistyped, unknown, raising)
come back as tool messages, never as exceptions; end to end, the example agent's tool call runs and its answer
extends the session."""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import importlib.util
import json
import sys
from pathlib import Path
from typing import Literal, Optional

import pytest

from twinplane.agents.tools import Tools, tool_schema

ROOT = Path(__file__).parents[2]


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


def get_weather(city: str, unit: Unit = Unit.CELSIUS, days: int = 1) -> str:
    """Today's weather in a city.

    Args:
        city: the city's name, e.g. "Paris"
        unit: the temperature's unit
        days: how many days
            ahead, 1 for today only
    """
    return f"sunny in {city}, 20 degrees {unit.value}, {days} day(s)"


def scalars(a: int, b: float, c: str, d: bool) -> dict:
    """Every scalar type.

    Args:
        a: an integer
        b: a number
        c (str): a string
        d: a flag
    """
    return {"a": a, "b": b, "c": c, "d": d}


def containers(xs: list[int], grid: list[list[str]], meta: dict, weights: dict[str, float], anything: list):
    """Arrays and objects.

    Args:
        xs: numbers
        grid: rows of cells
        meta: free-form
        weights: name to weight
        anything: a list of whatever
    """


def choices(mode: Literal["fast", "slow"], level: Literal[1, 2, 3], unit: Unit) -> None:
    """Enums three ways.

    Args:
        mode: how
        level: how much
        unit: which unit
    """


def optionals(query: str, limit: int | None = None, lang: Optional[str] = None,  # noqa: UP045 (both spellings)
              tags: list[str] | None = None, mode: Literal["a", "b"] | None = None, k: int = 5) -> list:
    """Nullable and defaulted parameters.

    Args:
        query: what to look for
        limit: at most this many
        lang: a language code
        tags: filters
        mode: a mode
        k: top k

    Returns:
        the hits
    """
    return [query, limit, lang, tags, mode, k]


async def lookup(key: str) -> dict:
    """Look a key up, asynchronously.

    Args:
        key: the key
    """
    await asyncio.sleep(0)
    return {"key": key, "found": True}


def no_arguments() -> str:
    """The time of day."""
    return "noon"


def as_transformers_writes_it(schema: dict) -> dict:
    """Our schema with nullable types written the transformers way: `"nullable": true` instead of a "null" in
    `type` (and no None in `enum`)."""
    out = json.loads(json.dumps(schema))
    for prop in out["function"]["parameters"]["properties"].values():
        if isinstance(prop["type"], list) and "null" in prop["type"]:
            kinds = [k for k in prop["type"] if k != "null"]
            prop["type"] = kinds[0] if len(kinds) == 1 else kinds
            prop["nullable"] = True
            if "enum" in prop:
                prop["enum"] = [v for v in prop["enum"] if v is not None]
    return out


@pytest.mark.parametrize("fn", [get_weather, scalars, containers, choices, optionals, lookup, no_arguments])
def test_schemas_equal_transformers_get_json_schema(fn):
    transformers = pytest.importorskip("transformers.utils")
    want = transformers.get_json_schema(fn)
    want["function"].pop("return", None)  # (transformers adds the return type; OpenAI's form has no place for it)
    assert as_transformers_writes_it(tool_schema(fn)) == want


def test_nullable_types_are_json_schema_types_and_never_required():
    props = tool_schema(optionals)["function"]["parameters"]
    assert props["required"] == ["query"]
    assert props["properties"]["limit"] == {"type": ["integer", "null"], "description": "at most this many"}
    assert props["properties"]["tags"]["type"] == ["array", "null"]
    assert props["properties"]["mode"] == {"type": ["string", "null"], "enum": ["a", "b", None],
                                           "description": "a mode"}

    def must_say(x: int | None) -> str:  # (transformers requires it: no default)
        return str(x)

    assert "required" not in tool_schema(must_say)["function"]["parameters"]
    assert Tools(must_say).call({"id": "c", "function": {"name": "must_say", "arguments": "{}"}})["content"] == "None"


def test_the_description_is_the_docstring_first_paragraph():
    def f(x: int) -> int:
        """Double a number,
        exactly.

        Implementation notes the model need not read.

        Args:
            x: the number
        """
        return 2 * x

    def bare(x: int) -> int:
        return x

    assert tool_schema(f)["function"]["description"] == "Double a number,\nexactly."
    assert tool_schema(bare)["function"] == {"name": "bare", "description": "", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}


def untyped(a, b: int):
    return a


def star_args(*numbers: int):
    return sum(numbers)


def star_kwargs(a: int, **options: str):
    return a


def pair(p: tuple[int, int]):
    return p


def int_or_str(v: int | str):
    return v


def int_keys(d: dict[int, str]):
    return d


def objects(o: object):
    return o


def positional(a: int, /):
    return a


@pytest.mark.parametrize(("fn", "message"), [
    (untyped, r"^tool untyped, parameter 'a': has no type hint$"),
    (star_args, r"^tool star_args, parameter 'numbers': \*args and \*\*kwargs"),
    (star_kwargs, r"^tool star_kwargs, parameter 'options': \*args and \*\*kwargs"),
    (pair, r"^tool pair, parameter 'p': type tuple\[int, int\] is not supported"),
    (int_or_str, r"^tool int_or_str, parameter 'v': the union int \| str is not supported"),
    (int_keys, r"^tool int_keys, parameter 'd': dict\[int, str\] has keys other than str"),
    (objects, r"^tool objects, parameter 'o': type object is not supported"),
    (positional, r"^tool positional, parameter 'a': positional-only parameters"),
])
def test_functions_that_cannot_be_described_are_one_line_type_errors(fn, message):
    with pytest.raises(TypeError, match=message) as e:
        Tools(fn)
    assert "\n" not in str(e.value)


def test_two_tools_with_one_name_are_refused():
    with pytest.raises(ValueError, match="two tools are named 'lookup'"):
        Tools(lookup, lookup)


def call(name: str, arguments, id="call_1") -> dict:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_good_calls_run_and_answer_with_text_or_json():
    ChatCompletionMessage = pytest.importorskip("openai.types.chat").ChatCompletionMessage

    tools = Tools(get_weather, scalars, optionals, no_arguments)
    assert [s["function"]["name"] for s in tools.schemas] == ["get_weather", "scalars", "optionals", "no_arguments"]
    sdk = ChatCompletionMessage.model_validate({"role": "assistant", "tool_calls": [
        call("get_weather", '{"city": "Paris", "unit": "fahrenheit"}', id="call_7")]}).tool_calls[0]
    assert tools.call(sdk) == {"role": "tool", "tool_call_id": "call_7",
                               "content": "sunny in Paris, 20 degrees fahrenheit, 1 day(s)"}  # (the Enum member)
    out = tools.call(call("scalars", '{"a": 1, "b": 2, "c": "x", "d": false}'))["content"]
    assert out == '{"a": 1, "b": 2.0, "c": "x", "d": false}'  # (an integer is a number: passed as a float)
    out = tools.call(call("optionals", {"query": "q", "limit": None, "tags": ["a"]}))["content"]  # (a dict is fine)
    assert json.loads(out) == ["q", None, None, ["a"], None, 5]
    assert tools.call(call("no_arguments", ""))["content"] == "noon"


@pytest.mark.parametrize(("name", "arguments", "error"), [
    ("scalars", '{"a": 1, "b": 2', "error: scalars: the arguments are not valid JSON (Expecting ',' delimiter at "
                                   "character 15)"),
    ("scalars", "[1, 2]", "error: scalars: the arguments must be a JSON object, not an array"),
    ("scalars", '{"a": 1, "b": 2, "c": "x"}', "error: scalars: missing required argument 'd'"),
    ("scalars", '{"a": 1, "b": 2, "c": "x", "d": true, "e": 0}',
     "error: scalars: unknown argument 'e' (parameters: a, b, c, d)"),
    ("scalars", '{"a": "1", "b": 2, "c": "x", "d": true}',
     "error: scalars: argument 'a' must be an integer, got a string \"1\""),
    ("scalars", '{"a": true, "b": 2, "c": "x", "d": true}',
     "error: scalars: argument 'a' must be an integer, got a boolean true"),
    ("scalars", '{"a": 1.5, "b": 2, "c": "x", "d": true}',
     "error: scalars: argument 'a' must be an integer, got a number 1.5"),
    ("scalars", '{"a": 1, "b": 2, "c": null, "d": true}', "error: scalars: argument 'c' must be a string, got null"),
    ("optionals", '{"query": "q", "tags": ["a", 2]}',
     "error: optionals: argument 'tags'[1] must be a string, got an integer 2"),
    ("optionals", '{"query": "q", "mode": "c"}', "error: optionals: argument 'mode' must be one of \"a\", \"b\", "
                                                 "got a string \"c\""),
    ("get_weather", '{"city": "Paris", "unit": "kelvin"}',
     "error: get_weather: argument 'unit' must be one of \"celsius\", \"fahrenheit\", got a string \"kelvin\""),
    ("get_time", "{}", "error: unknown tool 'get_time' (known: get_weather, scalars, optionals)"),
])
def test_bad_calls_are_one_line_errors_for_the_model(name, arguments, error):
    tools = Tools(get_weather, scalars, optionals)
    assert tools.call(call(name, arguments, id="call_3")) == {"role": "tool", "tool_call_id": "call_3",
                                                              "content": error}


def test_a_tool_that_raises_answers_with_the_exceptions_first_line():
    def divide(a: float, b: float) -> float:
        if b == 0:
            raise ValueError("b must not be 0\nthe second line is not shown")
        return a / b

    tools = Tools(divide)
    assert tools.call(call("divide", '{"a": 1, "b": 0}'))["content"] == "error: ValueError: b must not be 0"
    assert tools.call(call("divide", '{"a": 1, "b": 4}'))["content"] == "0.25"
    assert asyncio.run(tools.acall(call("divide", '{"a": 1, "b": 0}')))["content"] == \
        "error: ValueError: b must not be 0"


def test_async_tools_are_awaited_and_sync_ones_run_off_the_loop():
    import threading

    threads = []

    def where(x: int) -> int:
        threads.append(threading.current_thread())
        return x

    tools = Tools(lookup, where)
    assert tools.call(call("lookup", '{"key": "k"}'))["content"] == '{"key": "k", "found": true}'  # (its own loop)

    async def agent():
        got = await asyncio.gather(tools.acall(call("lookup", '{"key": "k"}', id="a")),
                                   tools.acall(call("where", '{"x": 3}', id="b")),
                                   tools.acall(call("where", '{"x": "3"}', id="c")))
        with pytest.raises(RuntimeError, match="use `await acall"):
            tools.call(call("lookup", '{"key": "k"}'))
        return got

    a, b, c = asyncio.run(agent())
    assert (a["tool_call_id"], a["content"]) == ("a", '{"key": "k", "found": true}')
    assert (b["tool_call_id"], b["content"]) == ("b", "3")
    assert c["content"] == "error: where: argument 'x' must be an integer, got a string \"3\""
    assert threads and threads[0] is not threading.main_thread()


# ---- end to end: the example agent against the server, with the model's replies scripted


class Scripted:
    """Stands in for the engine: answers the server's calls with the given texts, in turn, and keeps their
    prompts."""

    def __init__(self, tokenizer, texts):
        self.tok, self.texts, self.prompts, self.max_model_len = tokenizer, list(texts), [], 2048

    def submit(self, ids, sp, seed, on_tokens=None, key=None):
        from twinplane.rollout.sequence import Sample

        self.prompts.append(list(ids))
        out = self.tok.encode(self.texts.pop(0)) + [self.tok.eos_token_id]
        f = concurrent.futures.Future()
        f.set_result([Sample(0, list(ids), out, [-0.5] * len(out), "stop", 0)])
        return f


def test_the_example_agent_runs_the_models_tool_call_and_its_answer_extends_the_session(tmp_path):
    pytest.importorskip("openai")
    sys.path.insert(0, str(ROOT / "tests" / "serving"))
    from chat_model import chat_model_dir

    from twinplane.serving.openai_api import Served
    from twinplane.serving.server import BackgroundServer, build_app
    from twinplane.serving.sessions import Session, SessionStore
    from twinplane.serving.templates import ChatTemplate
    from twinplane.tokenizer import load_tokenizer

    spec = importlib.util.spec_from_file_location("calculator_tools", ROOT / "examples/agents/calculator_tools.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    folder = chat_model_dir(tmp_path / "model")
    tok = load_tokenizer(folder)
    said = '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 85}}\n</tool_call>'
    loop = Scripted(tok, [said, "The sum is 092."])
    served = Served(loop, tok, "policy", ChatTemplate.from_model_dir(folder), sessions=SessionStore())
    server = BackgroundServer(build_app(served))
    url = server.start()
    try:
        session = served.sessions.open(Session("ep", tok, budget=1024, max_turns=4, seed=0))
        out = asyncio.run(example.run(f"{url}/sessions/ep/v1", {"prompt": "07+85=", "answer": "092"}))
    finally:
        server.stop()
    assert out == {"reward": 1.0, "metrics": {"tool_calls": 1}}
    assert session.splits == 0 and session.current.calls == 2 and loop.texts == []
    second = tok.decode(loop.prompts[1], skip_special_tokens=False)
    assert second.startswith(tok.decode(loop.prompts[0], skip_special_tokens=False))
    assert "<tool_response>\n92\n</tool_response>" in second  # (the tool ran: 7 + 85)
    assert example.TOOLS.schemas == [tool_schema(example.add)]
