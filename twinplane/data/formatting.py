"""Prompt text from a `Record`: the model's own chat template, or a plain text template for base models.

Chat templates are Jinja programs shipped with model folders. They are rendered the way transformers'
`apply_chat_template(..., add_generation_prompt=True, tokenize=False)` renders them: a sandboxed environment
with `trim_blocks`/`lstrip_blocks`, the `raise_exception`/`strftime_now` globals, a `tojson` filter that does not
escape HTML, the special tokens (`bos_token`, `eos_token`, ...) in the context, and `tools`/`documents` set to
None. The tests check the text is identical to transformers' for ChatML- and Llama-3-style templates.
Nothing is ever `eval`ed: templates run in Jinja's sandbox, and plain templates only substitute named fields.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
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
        if not path.is_dir():
            raise DataError(f"{path}: no such model folder")
        config = _read_json(path / "tokenizer_config.json")
        tokens = {k: v for k, v in _read_json(path / "special_tokens_map.json").items() if k in SPECIAL_TOKEN_KEYS}
        tokens.update({k: config[k] for k in SPECIAL_TOKEN_KEYS if config.get(k) is not None})
        tokens = {k: _token_text(v) for k, v in tokens.items() if _token_text(v) is not None}
        kw["special_tokens"] = {**tokens, **(kw.get("special_tokens") or {})}
        if kw.get("chat_template") is None and mode == "chat":
            jinja_file = path / "chat_template.jinja"
            kw["chat_template"] = (jinja_file.read_text(encoding="utf-8") if jinja_file.is_file()
                                   else _default_template(path, config.get("chat_template")))
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
        import jinja2

        try:
            return self._template.render(messages=self.messages(record), tools=None, documents=None,
                                         add_generation_prompt=True, **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(f"chat template error: {_one_line(str(e))}") from None
        except (MemoryError, OverflowError, ValueError) as e:  # e.g. a format width such as "{:>99999999999}"
            raise DataError(f"chat template error: {type(e).__name__}: {_one_line(str(e))}") from None


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


def _default_template(path: Path, value) -> str | None:
    """`chat_template` from tokenizer_config.json: a string, or named templates of which "default" is used."""
    if value is None or isinstance(value, str):
        return value
    named = value if isinstance(value, dict) else {t.get("name"): t.get("template") for t in value}
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
