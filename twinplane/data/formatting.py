"""Prompt text from a `Record`: the model's own chat template, or a plain text template for base models.

Chat templates are Jinja programs shipped with model folders. They are rendered the way transformers'
`apply_chat_template(..., add_generation_prompt=True, tokenize=False)` renders them: a sandboxed environment
with `trim_blocks`/`lstrip_blocks`, the `raise_exception`/`strftime_now` globals, a `tojson` filter that does not
escape HTML, the special tokens (`bos_token`, `eos_token`, ...) in the context, `tools` (OpenAI-style function
schemas, or None) and `documents` set to None. Messages are passed as given, as transformers passes them: keys whose
value is None are dropped, and reasoning under `reasoning` or `thinking` is also offered as `reasoning_content`.
The tests check the text is identical to transformers' for ChatML-, Llama-3- and Qwen-style templates.
Nothing is ever `eval`ed: templates run in Jinja's sandbox, and plain templates only substitute named fields.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from twinplane.config import plain_template_problem
from twinplane.data.records import DataError, Record

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok  # AddedToken serialised as a dict, or a string


MAX_RENDERED_CHARS = 1 << 24  # a prompt is far shorter; a template that builds more is refused


def _compile_chat_template(source: str):
    """Compile with the environment transformers gives templates, so templates of real models behave the same."""
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError("chat templates need jinja2 (pip install jinja2), or use data.template=plain") from None

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for masks; here it renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """transformers' sandbox, which already caps `range`, with bounds on what could still exhaust memory in a
        downloaded template: repetition (`'x' * 10**12`) and powers (`9 ** 10**9`)."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            sized, count = (left, right) if isinstance(left, str | list | tuple) else (right, left)
            if operator == "*" and isinstance(sized, str | list | tuple) and isinstance(count, int):
                if len(sized) * count > MAX_RENDERED_CHARS:
                    raise jinja2.exceptions.SecurityError(f"a repetition of {len(sized)} x {count} is too large")
            if operator == "**" and isinstance(right, int) and abs(right) > 4096:
                raise jinja2.exceptions.SecurityError(f"an exponent of {right} is too large")
            return super().call_binop(context, operator, left, right)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise DataError(f"chat template syntax error at template line {e.lineno}: {e.message}") from None


class PromptFormatter:
    """Turns a `Record` into the prompt text to tokenise (the text the policy continues).

    mode="chat": messages are [system] + user(prompt + instruction_suffix), rendered with the chat template and
    the generation prompt. The system message is the record's own `system` if it has one, else `system_prompt`,
    else none (the template may add its default). A record whose prompt is already a message list is used as
    is, except that the system prompt is prepended when the list has no system message, and the suffix is
    appended to the last user message.

    mode="plain": `plain_template.format(...)` with exactly these fields, all strings:
        {prompt}      the record's prompt with `instruction_suffix` appended verbatim
        {raw_prompt}  the record's prompt alone
        {suffix}      `instruction_suffix`, or "" when unset
        {system}      the record's system prompt, else `system_prompt`, else ""
    Write `{{` and `}}` for literal braces. Message-list prompts are rejected in plain mode.

    `instruction_suffix` is appended verbatim in both modes, so start it with the separator you want,
    e.g. "\\nGive the final answer after ####.".
    """

    def __init__(self, mode: str, chat_template: str | None = None, system_prompt: str | None = None,
                 instruction_suffix: str | None = None, plain_template: str = "{prompt}",
                 special_tokens: dict[str, str] | None = None):
        if mode not in ("chat", "plain"):
            raise DataError(f"prompt format mode must be 'chat' or 'plain', got {mode!r}")
        self.mode, self.system_prompt = mode, system_prompt
        self.instruction_suffix = instruction_suffix or ""
        self.plain_template, self.special_tokens = plain_template, dict(special_tokens or {})
        self._template = None
        if mode == "chat":
            if not chat_template:
                raise DataError("no chat template was found (no chat_template in tokenizer_config.json and no "
                                "chat_template.jinja): use data.template=plain (prompts as data.plain_template)")
            self._template = _compile_chat_template(chat_template)
        elif (problem := plain_template_problem(plain_template)) is not None:
            raise DataError(f"plain_template {problem}")

    @classmethod
    def from_model_dir(cls, path: str | Path, mode: str = "chat", **kw) -> PromptFormatter:
        """Read the chat template and special tokens from a HF model or tokenizer folder; `kw` overrides them.

        Like transformers, `chat_template.jinja` takes priority over `chat_template` in `tokenizer_config.json`,
        which may be a string or a list of named templates (the one named "default" is used).
        """
        path = Path(path)
        template, tokens = read_model_template(path)
        kw["special_tokens"] = {**tokens, **(kw.get("special_tokens") or {})}
        if kw.get("chat_template") is None and mode == "chat":
            kw["chat_template"] = template
        try:
            return cls(mode, **kw)
        except DataError as e:
            raise DataError(f"{path.absolute()}: {e}") from None

    def messages(self, record: Record) -> list[dict]:
        """The chat the template renders (also useful to log)."""
        system = record.system if record.system is not None else self.system_prompt
        if isinstance(record.prompt, str):
            head = [{"role": "system", "content": system}] if system is not None else []
            return [*head, {"role": "user", "content": record.prompt + self.instruction_suffix}]
        msgs = [dict(m) for m in record.prompt]
        if system is not None and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": system})
        last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
        if last_user is not None:
            msgs[last_user]["content"] += self.instruction_suffix
        return msgs

    def format(self, record: Record) -> str:
        if self.mode == "plain":
            if not isinstance(record.prompt, str):
                raise DataError("data.template=plain needs string prompts, but this record's prompt is a message "
                                "list; use data.template=chat")
            system = record.system if record.system is not None else self.system_prompt
            return self.plain_template.format(prompt=record.prompt + self.instruction_suffix,
                                              raw_prompt=record.prompt, suffix=self.instruction_suffix,
                                              system=system or "")
        return render_chat(self._template, self.messages(record), special_tokens=self.special_tokens)


REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


def _as_transformers_passes(message):
    """A message as transformers hands it to templates: None-valued keys dropped (OpenAI clients send
    `content: null` beside `tool_calls`, which templates handle as a missing key), reasoning under every name."""
    if not isinstance(message, dict):
        return message
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_KEYS if k in message), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_chat(template, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                add_generation_prompt: bool = True, special_tokens: dict[str, str] | None = None, **extra) -> str:
    """The text transformers' `apply_chat_template(messages, tools=tools, tokenize=False, ...)` renders.

    `template`: a template's source or `_compile_chat_template`'s result. `tools`: OpenAI-style function schemas
    (`{"type": "function", "function": {"name", "description", "parameters"}}`), passed as they are. Tool calls in
    assistant messages are passed as they are too: a template that prints `arguments | tojson` prints a JSON string
    argument as a quoted string, exactly as transformers does. `extra`: further template variables
    (`enable_thinking=False`, `date_string=...`), which override the special tokens as in transformers.
    """
    import jinja2

    compiled = _compile_cached(template) if isinstance(template, str) else template
    context = {**(special_tokens or {}), **extra}
    try:
        return compiled.render(messages=[_as_transformers_passes(m) for m in messages],
                               tools=list(tools) if tools is not None else None, documents=None,
                               add_generation_prompt=add_generation_prompt, **context)
    except jinja2.exceptions.TemplateError as e:
        raise DataError(f"chat template error: {_one_line(str(e))}") from None
    except (MemoryError, OverflowError, ValueError, TypeError) as e:  # "{:>99999999999}", `'a' + 1`, ...
        raise DataError(f"chat template error: {type(e).__name__}: {_one_line(str(e))}") from None


@lru_cache(maxsize=8)
def _compile_cached(source: str):
    return _compile_chat_template(source)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({_one_line(str(e))})") from None
    return data if isinstance(data, dict) else {}


def read_model_template(path: Path, tools: bool = False) -> tuple[str | None, dict[str, str]]:
    """The chat template (None when there is none) and special tokens of a HF model folder. Like transformers,
    `chat_template.jinja` takes priority over `chat_template` in tokenizer_config.json, and of named templates
    (`additional_chat_templates/NAME.jinja`, or named in tokenizer_config.json) the one named "tool_use" is used
    with `tools` when there is one."""
    if not path.is_dir():
        raise DataError(f"{path}: no such model folder")
    config = _read_json(path / "tokenizer_config.json")
    tokens = {k: v for k, v in _read_json(path / "special_tokens_map.json").items() if k in SPECIAL_TOKEN_KEYS}
    tokens.update({k: config[k] for k in SPECIAL_TOKEN_KEYS if config.get(k) is not None})
    tokens = {k: _token_text(v) for k, v in tokens.items() if _token_text(v) is not None}
    tool_file, jinja_file = path / "additional_chat_templates" / "tool_use.jinja", path / "chat_template.jinja"
    if tools and tool_file.is_file():
        return tool_file.read_text(encoding="utf-8"), tokens
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), tokens
    return _default_template(path, config.get("chat_template"), tools), tokens


def _default_template(path: Path, value, tools: bool = False) -> str | None:
    """`chat_template` from tokenizer_config.json: a string, or named templates of which "default" is used (or
    "tool_use", with `tools`)."""
    if value is None or isinstance(value, str):
        return value
    named = value if isinstance(value, dict) else {t.get("name"): t.get("template") for t in value}
    if tools and "tool_use" in named:
        return named["tool_use"]
    if "default" not in named:
        raise DataError(f"{path}/tokenizer_config.json: no chat template named 'default' "
                        f"(named: {', '.join(map(str, named))}); pass chat_template explicitly")
    return named["default"]


def filter_by_length(token_id_lists: Sequence[Sequence[int]], max_len: int) -> tuple[list[int], int]:
    """Indices of the prompts with at most `max_len` tokens, and how many were dropped.

    Long prompts are dropped and counted, never truncated: a truncated question can have a different answer,
    and the verifier would then reward the wrong thing.
    """
    if max_len <= 0:
        raise ValueError(f"max prompt length must be positive, got {max_len}")
    kept = [i for i, ids in enumerate(token_id_lists) if len(ids) <= max_len]
    return kept, len(token_id_lists) - len(kept)
