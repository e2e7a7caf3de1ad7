"""A model's chat template as the server uses it: messages and tools in, prompt text out, rendered exactly as
transformers' `apply_chat_template(..., tools=tools, tokenize=False)` renders it (see `twinplane.data.formatting`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from twinplane.data.formatting import _compile_chat_template, read_model_template, render_chat
from twinplane.data.records import DataError


class ChatTemplate:
    """A compiled chat template with its special tokens.

    `source` is the template text (the parsers are chosen from it); `tool_source`, when the model folder names a
    separate "tool_use" template, is the one rendered when tools are given, as transformers does. `origin` names
    where the template came from, for messages.
    """

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, tool_source: str | None = None,
                 origin: str = "the chat template"):
        if not source:
            raise DataError(f"{origin}: the chat template is empty")
        self.source, self.tool_source, self.origin = source, tool_source, origin
        self.special_tokens = dict(special_tokens or {})
        self._compiled = _compile_chat_template(source)
        self._tool_compiled = _compile_chat_template(tool_source) if tool_source else self._compiled

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ChatTemplate:
        """The template of a HF model or tokenizer folder (`chat_template.jinja`, or `chat_template` in
        tokenizer_config.json) and its special tokens; a one-line `DataError` when the folder has none."""
        path = Path(path)
        source, tokens = read_model_template(path)
        if not source:
            raise DataError(f"{path.absolute()}: no chat template (no chat_template.jinja and no chat_template in "
                            "tokenizer_config.json)")
        tool_source, _ = read_model_template(path, tools=True)
        try:
            return cls(source, tokens, tool_source if tool_source != source else None, origin=str(path.absolute()))
        except DataError as e:
            raise DataError(f"{path.absolute()}: {e}") from None

    @property
    def tools_source(self) -> str:
        """The text of the template that renders requests with tools."""
        return self.tool_source or self.source

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
               add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text for `messages` (OpenAI-style dicts, tool calls and tool results included) and `tools`
        (OpenAI-style function schemas). `extra` are further template variables such as `enable_thinking`."""
        compiled = self._tool_compiled if tools is not None else self._compiled
        return render_chat(compiled, messages, tools, add_generation_prompt, self.special_tokens, **extra)
