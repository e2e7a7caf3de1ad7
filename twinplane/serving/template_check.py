"""Is a chat template append-only over a tool conversation? The server's contract with an agent: the prompt it
rendered for an assistant turn, followed by what the model wrote, is the start of every later request's prompt.
Then a session extends its own tokens and the policy trains on exactly what it saw. A template that rewrites
history (Qwen3 drops the `<think>` reasoning of turns before the last user message) breaks that at a known turn.

What the model wrote for turn k is taken from the template itself: the text its rendering of messages[:k+1] has
after its prompt for turn k. The token check is informational: the server tokenizes each appended piece on its
own by design, so a text that tokenizes differently whole is expected, not an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from twinplane.data.records import DataError
from twinplane.serving.templates import ChatTemplate
from twinplane.serving.tool_parsers import TOOL_PARSERS, detect_tool_parser
from twinplane.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


def _call(id_: str, city: str) -> dict:
    return {"id": id_, "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


# system, user, assistant (reasoning + call), tool, assistant, user, assistant (reasoning + call), tool, assistant
SCRIPT = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "Is it warm in Paris?"},
    {"role": "assistant", "content": "<think>\nLook it up.\n</think>\n\n", "tool_calls": [_call("c1", "Paris")]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 24}"},
    {"role": "assistant", "content": "<think>\n24 is warm.\n</think>\n\nYes, 24 degrees."},
    {"role": "user", "content": "And in Oslo?"},
    {"role": "assistant", "content": "<think>\nAnother lookup.\n</think>\n\n", "tool_calls": [_call("c2", "Oslo")]},
    {"role": "tool", "tool_call_id": "c2", "content": "{\"temp\": 9}"},
    {"role": "assistant", "content": "<think>\n9 is cold.\n</think>\n\nNo, 9 degrees."},
]


@dataclass
class TurnCheck:
    turn: int  # the assistant message's index in the script
    ok: bool
    request: int | None = None  # the later request (its message count) whose prompt breaks the turn; None: the
    # template's own rendering of the turn does not extend its prompt
    message: int | None = None  # the message in which the texts part
    offset: int | None = None  # the character where they part
    expected: str = ""
    rendered: str = ""
    reason: str = ""
    tokens_join: bool = True  # encode(prompt) + encode(output) == encode(prompt + output)


@dataclass
class TemplateReport:
    origin: str
    turns: list[TurnCheck]
    tool_parser: str | None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.turns)

    def to_dict(self) -> dict:
        return {"template": self.origin, "append_only": self.ok, "tool_parser": self.tool_parser,
                "turns": [vars(t) for t in self.turns], "notes": self.notes}

    def format(self) -> str:
        lines = [f"template  {self.origin}",
                 f"verdict   {'append-only' if self.ok else 'NOT append-only'} over a {len(SCRIPT)}-message tool "
                 f"conversation ({len(self.turns)} assistant turns)",
                 f"tools     calls parsed as {self.tool_parser} (the tool parser `auto` picks)" if self.tool_parser
                 else "tools     no known tool-call format: serving with tools needs a tool parser named by hand"]
        last = max((t.turn for t in self.turns), default=None)
        for t in self.turns:
            if t.ok:
                lines.append(f"turn {t.turn:<4} ok: " + ("the last turn, nothing later to compare" if t.turn == last
                                                         else "a prefix of every later prompt"))
                continue
            where = f"in the prompt for {t.request} messages" if t.request is not None else "in its own rendering"
            lines += [f"turn {t.turn:<4} BREAKS {where}, inside message {t.message} at character {t.offset}: "
                      f"{t.reason}",
                      f"          expected {t.expected!r}", f"          rendered {t.rendered!r}"]
        split = [t.turn for t in self.turns if not t.tokens_join]
        lines.append("tokens    " + ("every prompt + output tokenizes the same whole and in pieces" if not split else
                                     f"turns {', '.join(map(str, split))} tokenize differently whole than in pieces "
                                     "(informational: the server tokenizes appended text on its own)"))
        lines += [f"note      {n}" for n in self.notes]
        return "\n".join(lines)


def check_template(template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict] | None = None,
                   tools: list[dict] | None = None) -> TemplateReport:
    """Check every assistant turn of `messages` (default: `SCRIPT` with `TOOLS`) against every later request."""
    messages, tools = messages or SCRIPT, tools or TOOLS
    asks = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    prompts = {k: template.render(messages[:k], tools, add_generation_prompt=True) for k in asks}
    bounds = [_length(template, messages[:i], tools) for i in range(len(messages) + 1)]
    turns = []
    for k in asks:
        prompt, whole = prompts[k], template.render(messages[:k + 1], tools, add_generation_prompt=False)
        if not whole.startswith(prompt):
            turns.append(_broken(k, None, prompt, whole, bounds, "the turn does not start with the generation "
                                 "prompt (the template renders the assistant's opening differently)"))
            continue
        expected = whole
        later = [j for j in asks if j > k]
        broken = next((j for j in later if not prompts[j].startswith(expected)), None)
        check = TurnCheck(k, True) if broken is None else _broken(k, broken, expected, prompts[broken], bounds, "")
        check.tokens_join = tokens_join(tokenizer, prompt, expected[len(prompt):])
        turns.append(check)
    parser = detect_tool_parser(template.tools_source)
    outputs = {k: template.render(messages[:k + 1], tools, False)[len(prompts[k]):] for k in asks}
    notes = _parser_notes(parser, messages, tools, outputs) + _string_arguments_note(template, tools)
    return TemplateReport(template.origin, turns, parser, notes)


def tokens_join(tokenizer: Tokenizer, prefix: str, suffix: str) -> bool:
    """Whether `prefix` and `suffix` tokenized apart give the tokens of their concatenation."""
    return tokenizer.encode(prefix) + tokenizer.encode(suffix) == tokenizer.encode(prefix + suffix)


def _length(template: ChatTemplate, messages: list[dict], tools: list[dict]) -> int:
    """Where the rendering of `messages` ends (0 when the template cannot render so few)."""
    try:
        return len(template.render(messages, tools, add_generation_prompt=False)) if messages else 0
    except DataError:
        return 0


def _broken(turn: int, request: int | None, expected: str, rendered: str, bounds: list[int], reason: str) -> TurnCheck:
    at = next((i for i, (a, b) in enumerate(zip(expected, rendered, strict=False)) if a != b),
              min(len(expected), len(rendered)))
    message = max((i for i, b in enumerate(bounds[:turn + 1]) if b <= at), default=0)
    gone, came = expected[at:at + 60], rendered[at:at + 60]
    if not reason:
        near = slice(max(0, at - len("<think>")), at + 60)  # (the texts may part inside the tag)
        if "<think>" in expected[near] and "<think>" not in rendered[near]:
            reason = "earlier reasoning (<think>) is stripped once a later user message arrives"
        elif len(rendered) < len(expected) and expected.startswith(rendered):
            reason = "the later prompt is shorter than the turn (the template drops its end)"
        else:
            reason = f"message {message} renders differently once later messages exist"
    return TurnCheck(turn, False, request, message, at, expected[max(0, at - 20):at] + gone,
                     rendered[max(0, at - 20):at] + came, reason)


def _parser_notes(parser: str | None, messages: list[dict], tools: list[dict], outputs: dict[int, str]
                  ) -> list[str]:
    """Whether the detected parser reads back the calls the template writes (names and argument values)."""
    if parser is None:
        return []
    for k, text in outputs.items():
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in messages[k].get("tool_calls") or []]
        got = [(c.name, json.loads(c.arguments)) for c in TOOL_PARSERS[parser](text, tools).tool_calls]
        if got != want:
            return [f"the {parser} parser reads {len(got)} call(s) from turn {k} as the template writes it, not "
                    f"{len(want)}: name the tool parser by hand"]
    return []


def _string_arguments_note(template: ChatTemplate, tools: list[dict]) -> list[str]:
    """How the template prints tool-call arguments sent back as a JSON string, as OpenAI clients send them."""
    as_object = [SCRIPT[1], SCRIPT[2]]
    as_string = [SCRIPT[1], {**SCRIPT[2], "tool_calls": [{**_call("c1", "Paris"), "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    try:
        same = template.render(as_object, tools, False) == template.render(as_string, tools, False)
    except DataError as e:
        return [f"tool-call arguments given as a JSON string fail to render ({e}): send them as objects"]
    return [] if same else ["tool-call arguments given as a JSON string render as a quoted string, not as the "
                            "object the model wrote: send them back as objects (parsed JSON)"]
