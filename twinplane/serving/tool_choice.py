"""`tool_choice` on the chat path: `auto` and `none`, and a forced call (`required`, or a named function) without
constrained decoding. A forced call's prompt ends with the opening of a call as the template writes it (the
tool-call format's `CallOpener`: for Hermes/Qwen `<tool_call>\\n{"name": "`, or up to the arguments of the named
tool), so the model goes on with the call; its reply is parsed with the opener in front.

In a session the opener is prompt-side, like a tool result: tokens the model did not sample, with loss mask 0. The
call the client sends back renders as the prompt, the opener and the reply, so the next request extends the
trajectory as after a call the model opened itself.
"""

from __future__ import annotations

import json

from twinplane.serving.protocol import APIError
from twinplane.serving.tool_parsers import CALL_OPENERS, ToolParser, parser_name

_SERVED = 'auto, none, required or {"type": "function", "function": {"name": ...}}'


def _label(choice: str | dict) -> str:
    return json.dumps(choice)[:100]


def tool_names(tools: list[dict] | None) -> list[str]:
    """The names of OpenAI-style function tools (`{"type": "function", "function": {"name": ...}}`)."""
    return [n for t in tools or [] if isinstance(n := (t.get("function") or t).get("name"), str)]


def forced_call(choice: str | dict | None, tools: list[dict] | None) -> tuple[bool, str | None]:
    """(whether `choice` forces a call, the tool it names: None for any) of an OpenAI chat `tool_choice`; a 400 for
    a choice that is not served or names no tool of the request."""
    if choice in (None, "auto", "none"):
        return False, None
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if choice != "required" and not (isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise APIError(400, f"tool_choice {_label(choice)}: not served ({_SERVED} are)", "tool_choice")
    name, names = None if choice == "required" else function["name"], tool_names(tools)
    if not names:
        raise APIError(400, f"tool_choice {_label(choice)}: the request has no tools to call", "tool_choice")
    if name is not None and name not in names:
        raise APIError(400, f"tool_choice names {name!r}, which is not one of the request's tools "
                       f"({', '.join(names)})", "tool_choice")
    return True, name


def call_opener(choice: str | dict | None, tools: list[dict], parser: ToolParser) -> str:
    """The text the prompt ends with for `choice`: '' when no call is forced, else the opener of a call in
    `parser`'s format; a 400 for a format that declares none."""
    forced, name = forced_call(choice, tools)
    if not forced:
        return ""
    opener = CALL_OPENERS.get(parser_name(parser))
    if opener is None:
        raise APIError(400, f"tool_choice {_label(choice)}: the tool-call format {parser_name(parser)!r} declares "
                       "no call opener to force a call with (auto and none are served)", "tool_choice")
    return opener.text(name)
