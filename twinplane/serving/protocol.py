"""The OpenAI API's request bodies (the fields twinplane honours; others are accepted and ignored, as OpenAI-compatible
servers do) and what the engine makes of them: sampling parameters, stop strings, the text shown to a client."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from twinplane.tokenizer import Tokenizer


class APIError(Exception):
    """An error answered as OpenAI's JSON `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop or [] if s]


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def cut_at_stop(tok: Tokenizer, ids: list[int], stops: list[str]) -> int | None:
    """How many of `ids` to keep when their text contains a stop string: up to the token that completes the
    first one (None: none does). Stop strings are matched in text, as OpenAI's are, whatever the tokenization."""
    if not stops:
        return None

    def has_stop(k: int) -> bool:
        text = tok.decode(ids[:k], skip_special_tokens=False)
        return any(s in text for s in stops)

    if not has_stop(len(ids)):
        return None
    lo, hi = 1, len(ids)  # the smallest k whose text holds a stop (monotone in k)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if has_stop(mid) else (mid + 1, hi)
    return lo


def shown_text(tok: Tokenizer, ids: list[int], stop_ids: frozenset[int], stops: list[str]) -> tuple[str, str]:
    """(the text a client is shown, the text of the tokens it is not): a final stop token is not shown (the
    template or the client's protocol marks the end), nor anything from a stop string on."""
    hidden_ids = ids[-1:] if ids and ids[-1] in stop_ids else []
    text = tok.decode(ids[:len(ids) - len(hidden_ids)], skip_special_tokens=False)
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text if cut < 0 else text[:cut]), tok.decode(hidden_ids, skip_special_tokens=False)


def message_text(content) -> str | None:
    """A message's content as text: a string, or the text parts of a list of parts (images are refused)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise APIError(400, "message content parts must be {'type': 'text', 'text': ...} (this model reads "
                               "text only)", "messages")
            parts.append(p["text"])
        return "".join(parts)
    raise APIError(400, f"message content must be a string or a list of text parts, got {type(content).__name__}",
                   "messages")
