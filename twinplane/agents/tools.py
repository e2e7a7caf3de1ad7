"""Tools for chat agents as plain typed Python functions: the OpenAI function schema comes from the signature and
the Google-style docstring, and a model's tool call is checked against the signature, run, and answered with the
`tool` message to send back.

    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first addend
            b: the second addend
        \"\"\"
        return a + b

    tools = Tools(add)
    r = client.chat.completions.create(..., tools=tools.schemas)
    messages += [tools.call(c) for c in r.choices[0].message.tool_calls or []]   # or `await tools.acall(c)`

Types: str, int, float, bool, list / list[T], dict / dict[str, T], Literal[...] and Enum subclasses (an `enum`),
`X | None` (nullable and not required) and parameters with defaults (not required). The schema is transformers'
`get_json_schema`'s but for three things: a nullable type is written as JSON Schema writes it (`"type": ["integer",
"null"]`, not `"nullable": true`) and is never required (transformers requires one without a default), and a
function's description is the docstring's first paragraph only, with no return type (OpenAI's form has no place
for it). A bad call never raises: the model gets `"error: ..."` as the tool's answer, one line, and can try again.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable

from twinplane.errors import first_line

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns?|Yields?|Raises|Examples?|Notes?|Attributes):\s*$")
_ARG = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def tool_schema(fn: Callable) -> dict:
    """`fn`'s OpenAI tool schema: {"type": "function", "function": {"name", "description", "parameters"}}. A
    parameter without a type hint or of a type outside the supported ones, and *args / **kwargs, are a TypeError."""
    return _Tool(fn).schema


class Tools:
    """A set of tools: `.schemas` for the request's `tools=`, `.call(tool_call)` / `await .acall(tool_call)` for the
    `{"role": "tool", "tool_call_id", "content"}` message that answers one of the model's calls."""

    def __init__(self, *fns: Callable):
        self.tools: dict[str, _Tool] = {}
        for fn in fns:
            tool = _Tool(fn)
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        self.schemas = [t.schema for t in self.tools.values()]

    def call(self, tool_call) -> dict:
        """Run one tool call (the SDK's object or its dict form); an async tool runs on a loop of its own, so call
        this outside a running event loop (inside one: `acall`)."""
        tool, kwargs, call_id, error = self._prepare(tool_call)
        if error is None:
            if inspect.iscoroutinefunction(tool.fn) and _loop_running():
                raise RuntimeError(f"tool {tool.name} is async and an event loop is running: use `await acall(...)`")
            try:
                result = tool.fn(**kwargs)
                if inspect.isawaitable(result):
                    result = asyncio.run(_awaited(result))
                return _message(call_id, _text(result))
            except Exception as e:  # the tool's own failure: the model sees it
                error = first_line(e, typed=True)
        return _message(call_id, f"error: {error}")

    async def acall(self, tool_call) -> dict:
        """`call` from async code: an async tool is awaited, a plain one runs on a thread (the loop stays free)."""
        tool, kwargs, call_id, error = self._prepare(tool_call)
        if error is None:
            try:
                if inspect.iscoroutinefunction(tool.fn):
                    result = await tool.fn(**kwargs)
                else:
                    result = await asyncio.to_thread(tool.fn, **kwargs)
                    if inspect.isawaitable(result):
                        result = await result
                return _message(call_id, _text(result))
            except Exception as e:
                error = first_line(e, typed=True)
        return _message(call_id, f"error: {error}")

    def _prepare(self, tool_call) -> tuple[_Tool | None, dict, str | None, str | None]:
        """(tool, its checked arguments, the call's id, None) or (..., the error the model should see)."""
        call_id, name, arguments = _unpack(tool_call)
        tool = self.tools.get(name)
        if tool is None:
            return None, {}, call_id, f"unknown tool {name!r} (known: {', '.join(self.tools)})"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return tool, {}, call_id, f"{name}: the arguments are not valid JSON ({e.msg} at character {e.pos})"
        try:
            return tool, tool.check(arguments), call_id, None
        except ValueError as e:
            return tool, {}, call_id, f"{name}: {e}"


class _Tool:
    """One function: its schema, and how a call's JSON arguments become its keyword arguments."""

    def __init__(self, fn: Callable):
        if not callable(fn):
            raise TypeError(f"a tool must be a function, not {type(fn).__name__}")
        self.fn, self.name = fn, getattr(fn, "__name__", type(fn).__name__)
        try:
            hints = typing.get_type_hints(fn)
        except Exception as e:  # (an annotation that names nothing importable)
            raise TypeError(f"tool {self.name}: cannot resolve its type hints ({first_line(e)})") from None
        description, docs = _parse_docstring(inspect.getdoc(fn) or "")
        self.params: dict[str, tuple[object, bool]] = {}  # name -> (type, required)
        self.nones: list[str] = []  # nullable parameters without a default: None when the call leaves them out
        properties, required = {}, []
        for p in inspect.signature(fn).parameters.values():
            where = f"tool {self.name}, parameter {p.name!r}"
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"{where}: *args and **kwargs cannot be described to the model")
            if p.kind is p.POSITIONAL_ONLY:
                raise TypeError(f"{where}: positional-only parameters cannot be passed by name")
            if p.name not in hints:
                raise TypeError(f"{where}: has no type hint")
            hint = hints[p.name]
            prop, nullable = _schema(hint, where)
            if docs.get(p.name):
                prop["description"] = docs[p.name]
            properties[p.name] = prop
            needed = p.default is p.empty and not nullable
            if needed:
                required.append(p.name)
            elif p.default is p.empty:
                self.nones.append(p.name)
            self.params[p.name] = (hint, needed)
        parameters = {"type": "object", "properties": properties} | ({"required": required} if required else {})
        self.schema = {"type": "function", "function": {"name": self.name, "description": description,
                                                          "parameters": parameters}}

    def check(self, arguments) -> dict:
        """The call's arguments as keyword arguments (enum values become their Enum members); a one-line
        ValueError naming what is wrong."""
        if not isinstance(arguments, dict):
            raise ValueError(f"the arguments must be a JSON object, not {_json_kind(arguments)}")
        unknown = [k for k in arguments if k not in self.params]
        if unknown:
            raise ValueError(f"unknown argument {unknown[0]!r} (parameters: {', '.join(self.params)})")
        missing = [k for k, (_, needed) in self.params.items() if needed and k not in arguments]
        if missing:
            raise ValueError(f"missing required argument {missing[0]!r}")
        return {k: None for k in self.nones} | {k: _convert(v, self.params[k][0], repr(k))
                                                 for k, v in arguments.items()}


def _schema(hint, where: str) -> tuple[dict, bool]:
    """(the JSON schema of a type hint, whether it is nullable); a TypeError for what has none."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == len(args) or len(rest) != 1:
            raise TypeError(f"{where}: the union {_name(hint)} is not supported (only `X | None`)")
        inner, _ = _schema(rest[0], where)
        kinds = inner["type"] if isinstance(inner["type"], list) else [inner["type"]]
        out = {**inner, "type": [*kinds, "null"]}
        if "enum" in inner:
            out["enum"] = [*inner["enum"], None]
        return out, True
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}, False
    if hint is list or origin is list:
        if not args:
            return {"type": "array"}, False
        return {"type": "array", "items": _schema(args[0], where)[0]}, False
    if hint is dict or origin is dict:
        if not args:
            return {"type": "object"}, False
        if args[0] is not str:
            raise TypeError(f"{where}: {_name(hint)} has keys other than str (JSON's are strings)")
        return {"type": "object", "additionalProperties": _schema(args[1], where)[0]}, False
    if origin is typing.Literal:
        return _enum(list(args), where), False
    if _is_class(hint) and issubclass(hint, enum.Enum):
        return _enum([m.value for m in hint], where), False
    raise TypeError(f"{where}: type {_name(hint)} is not supported (str, int, float, bool, list, dict, Literal, "
                    f"Enum, X | None)")


def _enum(values: list, where: str) -> dict:
    kinds = []
    for v in values:
        kind = _SCALARS.get(type(v))
        if kind is None:
            raise TypeError(f"{where}: enum value {v!r} is not a str, int, float or bool")
        if kind not in kinds:
            kinds.append(kind)
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _convert(value, hint, where: str):
    """`value` (parsed JSON) checked against `hint`; Enum values become members. A ValueError when it does not fit."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        return _convert(value, next(a for a in args if a is not type(None)), where)
    if origin is typing.Literal:
        if not any(value == a and type(value) is type(a) for a in args):
            raise ValueError(f"argument {where} must be one of {', '.join(json.dumps(a) for a in args)}, "
                             f"got {_shown(value)}")
        return value
    if _is_class(hint) and issubclass(hint, enum.Enum):
        for m in hint:
            if value == m.value and type(value) is type(m.value):
                return m
        raise ValueError(f"argument {where} must be one of {', '.join(json.dumps(m.value) for m in hint)}, "
                         f"got {_shown(value)}")
    ok = {str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
          list: lambda v: isinstance(v, list), dict: lambda v: isinstance(v, dict)}
    base = origin or hint
    if not ok[base](value):
        raise ValueError(f"argument {where} must be {_SCHEMA_WORDS[base]}, got {_shown(value)}")
    if base is float:
        return float(value)
    if base is list and args:
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if base is dict and args:
        return {k: _convert(v, args[1], f"{where}[{k!r}]") for k, v in value.items()}
    return value


_SCHEMA_WORDS = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
                 dict: "an object"}


def _is_class(hint) -> bool:
    return typing.get_origin(hint) is None and isinstance(hint, type)  # (list[int] passes for a class on 3.10)


def _json_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {str: "a string", int: "an integer", float: "a number", list: "an array", dict: "an object"}.get(
        type(value), type(value).__name__)


def _shown(value) -> str:
    if value is None:
        return "null"
    text = json.dumps(value, ensure_ascii=False)
    return f"{_json_kind(value)} {text if len(text) <= 40 else text[:37] + '...'}"


def _name(hint) -> str:
    return getattr(hint, "__name__", None) if _is_class(hint) else str(hint).replace("typing.", "")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(the first paragraph, {parameter: description}) of a Google-style docstring; continuation lines of an
    argument's description are joined with spaces."""
    lines = doc.splitlines()
    head = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        head.append(line.strip())
    docs: dict[str, str] = {}
    start = next((i for i, ln in enumerate(lines) if re.match(r"^(Args|Arguments|Parameters):\s*$", ln.strip())), None)
    if start is not None:
        base = len(lines[start]) - len(lines[start].lstrip())
        entry_indent, name = None, None
        for line in lines[start + 1:]:
            if not line.strip():
                continue
            indent = len(line) - len(line.lstrip())
            if indent <= base:
                break  # the next section
            m = _ARG.match(line.strip())
            if m and (entry_indent is None or indent <= entry_indent):
                entry_indent, name = indent, m.group(1).lstrip("*")
                docs[name] = m.group(3).strip()
            elif name is not None:
                docs[name] = f"{docs[name]} {line.strip()}".strip()
    return "\n".join(head), docs


async def _awaited(awaitable):
    return await awaitable


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _unpack(tool_call) -> tuple[str | None, str, object]:
    """(id, name, arguments) of an OpenAI tool call: the SDK's object or its dict form."""
    if isinstance(tool_call, dict):
        fn = tool_call.get("function") or {}
        return tool_call.get("id"), str(fn.get("name", "")), fn.get("arguments", "{}")
    fn = tool_call.function
    return tool_call.id, str(fn.name), fn.arguments


def _message(call_id: str | None, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _text(result) -> str:
    """A tool's result as the text the model reads: a str as it is, anything else as JSON."""
    if isinstance(result, str):
        return result
    return json.dumps(result, ensure_ascii=False, default=_jsonable)


def _jsonable(value):
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)
