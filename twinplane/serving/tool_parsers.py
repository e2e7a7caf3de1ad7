"""Tool calls out of sampled text, one parser per format a model family was trained to write.

A parser is a pure function `parse(text, tools=None) -> ParsedMessage`. It never raises on model output: a call
that does not parse leaves the whole text as content and no tool calls (no half-parsed message); else the content
is the text around the calls, stripped, its pieces joined by a line break. `arguments` is
the JSON text of the arguments exactly as the model wrote it, never re-serialised: a client that sends the call
back unchanged has it rendered as the same text, hence the same tokens (the XML format of qwen3_coder is the
exception: it has no JSON to keep, so its arguments are built as one `json.dumps` object).

A leading `<think>...</think>` is reasoning, also when the generation prompt already opened `<think>` (the text
then has `</think>` and no `<think>` before it); reasoning without its `</think>` (the sample was cut short) is all
reasoning.

A format may declare its `CallOpener`: the text its template writes at the start of a call, which the server ends
the prompt with to force one (`tool_choice` `required` or a named function); a format without one is not forced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from twinplane.errors import InputError


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as sampled


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class CallOpener:
    """How the template's rendering of an assistant message that is only calls begins: `any` up to the first
    tool's name, `named` up to its arguments (`{name}` stands for the tool's name). The model, prompted with one,
    writes the rest of the call, and the text prompt + opener + reply is that rendering."""
    any: str
    named: str

    def text(self, name: str | None) -> str:
        """The opener of a call of any tool (None) or of the tool `name`."""
        return self.any if name is None else self.named.replace("{name}", name)


ToolParser = Callable[..., ParsedMessage]
TOOL_PARSERS: dict[str, ToolParser] = {}
CALL_OPENERS: dict[str, CallOpener] = {}


def register_tool_parser(name: str, opener: CallOpener | None = None) -> Callable[[ToolParser], ToolParser]:
    def register(fn: ToolParser) -> ToolParser:
        TOOL_PARSERS[name] = fn
        if opener is not None:
            CALL_OPENERS[name] = opener
        return fn
    return register


def parser_name(parser: ToolParser) -> str:
    return next((n for n, fn in TOOL_PARSERS.items() if fn is parser), getattr(parser, "__name__", "?"))


def tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise InputError(f"unknown tool-call format {name!r} (known: {', '.join(TOOL_PARSERS)}, or auto)")
    return TOOL_PARSERS[name]


def detect_tool_parser(template_source: str) -> str | None:
    """The format a chat template writes tool calls in, from its markers; None when it shows none. XML calls are
    checked first: Qwen3-Coder's template also wraps them in `<tool_call>`."""
    if "<function=" in template_source and "<parameter=" in template_source:
        return "qwen3_coder"
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|python_tag|>" in template_source or '"parameters"' in template_source:
        return "llama3_json"
    return None


def resolve_tool_parser(name_or_auto: str, template_source: str, template_name: str = "the chat template"
                        ) -> ToolParser:
    """`auto`: the format detected in the template, failing closed when none is; else the named parser."""
    if name_or_auto != "auto":
        return tool_parser(name_or_auto)
    found = detect_tool_parser(template_source)
    if found is None:
        raise InputError(f"{template_name}: no known tool-call format in the chat template; name one "
                         f"({', '.join(TOOL_PARSERS)}) or serve without tools")
    return TOOL_PARSERS[found]


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, rest) of a sample; the newlines the templates put inside and after the tags are dropped."""
    stripped = text.lstrip()
    if stripped.startswith("<think>"):
        inner, closed, rest = stripped[len("<think>"):].partition("</think>")
        return inner.strip("\n"), rest.lstrip("\n") if closed else ""
    end = text.find("</think>")
    if end >= 0 and "<think>" not in text[:end]:
        return text[:end].strip("\n"), text[end + len("</think>"):].lstrip("\n")
    return None, text


def _message(content: str, reasoning: str | None, calls: list[ToolCall] | None = None) -> ParsedMessage:
    """A reply without calls keeps its text exactly (rendered back, it is the text sampled: a session extends
    it); around calls, the templates' own line breaks are dropped (`_outside`)."""
    return ParsedMessage(content.strip() or None if calls else content, reasoning, calls or [])


def _outside(pieces: list[str]) -> str:
    """The text around the calls, one line break between its pieces (one piece, no calls: as it is)."""
    if len(pieces) == 1:
        return pieces[0]
    return "\n".join(p.strip() for p in pieces if p.strip())


_WS = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


def json_object_members(text: str, start: int = 0) -> tuple[dict[str, tuple[object, str]], int] | None:
    """The top-level members of the JSON object at `start` (after whitespace), each as (value, its exact source
    text), and where the object ends; None when there is no well-formed object there."""
    try:
        i = _WS.match(text, start).end()
        if text[i:i + 1] != "{":
            return None
        i, members = _WS.match(text, i + 1).end(), {}
        if text[i:i + 1] == "}":
            return members, i + 1
        while True:
            key, i = _DECODER.raw_decode(text, i)
            i = _WS.match(text, i).end()
            if not isinstance(key, str) or text[i:i + 1] != ":":
                return None
            value_start = _WS.match(text, i + 1).end()
            value, i = _DECODER.raw_decode(text, value_start)
            members[key] = (value, text[value_start:i])
            i = _WS.match(text, i).end()
            if text[i:i + 1] == "}":
                return members, i + 1
            if text[i:i + 1] != ",":
                return None
            i = _WS.match(text, i + 1).end()
    except ValueError:  # (json.JSONDecodeError)
        return None


def _json_call(members: dict[str, tuple[object, str]], argument_keys: tuple[str, ...]) -> ToolCall | None:
    name = members.get("name", (None, ""))[0]
    key = next((k for k in argument_keys if k in members), None)
    if not isinstance(name, str) or not name:
        return None
    if key is None:
        return ToolCall(name, "{}")
    value, source = members[key]
    return ToolCall(name, source) if isinstance(value, dict) else None


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@register_tool_parser("hermes", CallOpener('<tool_call>\n{"name": "', '<tool_call>\n{"name": "{name}", "arguments": '))
def parse_hermes(text: str, tools: list[dict] | None = None) -> ParsedMessage:
    """Qwen2.5, Qwen3, Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number."""
    reasoning, rest = split_reasoning(text)
    calls, pieces, at = [], [], 0
    for m in _HERMES.finditer(rest):
        found = json_object_members(m.group(1))
        call = _json_call(found[0], ("arguments", "parameters")) if found else None
        if call is None or m.group(1)[found[1]:].strip():
            return _message(rest, reasoning)
        calls.append(call)
        pieces.append(rest[at:m.start()])
        at = m.end()
    if "<tool_call>" in rest[at:]:  # an unclosed call: the sample was cut short
        return _message(rest, reasoning)
    return _message(_outside([*pieces, rest[at:]]), reasoning, calls)


_CODER_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_CODER_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _schema_types(tools: list[dict] | None, name: str) -> dict[str, object]:
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def _typed(value: str, kind: object) -> object:
    """A parameter's text as its schema's type says (the template printed scalars with Python's `str`, objects and
    arrays as JSON); the text itself when it does not convert."""
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if value.strip() in ("null", "None") and "null" in kinds:
        return None
    if "boolean" in kinds and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if "integer" in kinds and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    if "number" in kinds:
        try:
            number = float(value)
            return int(number) if number.is_integer() and re.fullmatch(r"\s*-?\d+\s*", value) else number
        except ValueError:
            pass
    if kinds & {"object", "array"}:
        try:
            return json.loads(value)
        except ValueError:
            pass
    return value


@register_tool_parser("qwen3_coder", CallOpener("<tool_call>\n<function=", "<tool_call>\n<function={name}>\n"))
def parse_qwen3_coder(text: str, tools: list[dict] | None = None) -> ParsedMessage:
    """Qwen3-Coder: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`.
    Values are typed by the tool's JSON schema where `tools` gives one, else kept as strings."""
    reasoning, rest = split_reasoning(text)
    calls, pieces, at = [], [], 0
    for m in _CODER_CALL.finditer(rest):
        name, body = m.group(1).strip(), m.group(2)
        types, args = _schema_types(tools, name), {}
        for p in _CODER_PARAM.finditer(body):
            args[p.group(1).strip()] = _typed(p.group(2), types.get(p.group(1).strip()))
        if not name or _CODER_PARAM.sub("", body).strip():  # text between parameters: not this format
            return _message(rest, reasoning)
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        pieces.append(rest[at:m.start()])
        at = m.end()
    if "<tool_call>" in rest[at:] or "<function=" in rest[at:]:
        return _message(rest, reasoning)
    return _message(_outside([*pieces, rest[at:]]), reasoning, calls)


@register_tool_parser("llama3_json", CallOpener('{"name": "', '{"name": "{name}", "parameters": '))
def parse_llama3_json(text: str, tools: list[dict] | None = None) -> ParsedMessage:
    """Llama 3.1/3.2: `<|python_tag|>` (optional) then `{"name": ..., "parameters": {...}}`, several separated by
    `;`. A reply that does not start with a call is content."""
    reasoning, rest = split_reasoning(text)
    body = rest.strip()
    body = body[len("<|python_tag|>"):] if body.startswith("<|python_tag|>") else body
    if not body.lstrip().startswith("{"):
        return _message(rest, reasoning)
    calls, at = [], 0
    while True:
        found = json_object_members(body, at)
        call = _json_call(found[0], ("parameters", "arguments")) if found else None
        if call is None:
            return _message(rest, reasoning)
        calls.append(call)
        at = _WS.match(body, found[1]).end()
        if at == len(body):
            return _message("", reasoning, calls)
        if body[at] != ";":
            return _message(rest, reasoning)
        at = _WS.match(body, at + 1).end()
        if at == len(body):  # a trailing separator
            return _message("", reasoning, calls)
