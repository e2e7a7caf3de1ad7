"""Anthropic's Messages API (`POST /v1/messages`, and under `/sessions/<id>/v1`) on the engine and sessions of the
OpenAI routes: a request becomes the OpenAI-style messages the chat template reads (system message, assistant
`tool_calls` with `arguments` = `json.dumps(input)`, `tool` messages for `tool_result` blocks) and takes the chat
route's path (`openai_api.chat_prompt`: rendering, session match, sampling, tool parsing); the parsed reply comes
back as content blocks. `POST /v1/messages/count_tokens` counts the prompt the same request would have. Errors
are Anthropic's JSON `{"type": "error", "error": {...}}`.

`tool_choice` `any` or a named `tool` forces a call as the chat route does (`tool_choice`: the prompt ends with
the opening of a call). Not served: images and documents, server tools.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from twinplane.serving.openai_api import (
    Served,
    _chat_choice,
    chat_prompt,
    chat_reply,
    chat_text,
    given_key,
    locked,
    session_of,
    streamed,
)
from twinplane.serving.protocol import APIError, ChatRequest, message_text
from twinplane.serving.sessions import Session

_KINDS = {"service_unavailable": "overloaded_error"}  # (the rest of APIError's kinds are Anthropic's names too)


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False


class CountTokensRequest(MessagesRequest):
    max_tokens: int | None = Field(None, ge=1)  # (count_tokens takes the request without it)


def error_response(e: APIError) -> JSONResponse:
    body = {"type": "error", "error": {"type": _KINDS.get(e.kind, e.kind), "message": e.message}}
    return JSONResponse(body, status_code=e.status)


def register(app: FastAPI, served: Served) -> None:
    if served.api_key is not None:  # (added after the OpenAI routes' check, so it runs first: the error in this shape)
        @app.middleware("http")
        async def check_key(request: Request, call_next):
            if request.url.path.endswith(("/messages", "/messages/count_tokens")) and \
                    given_key(request) != served.api_key:
                return error_response(APIError(401, "a valid API key is required (x-api-key: KEY)",
                                               kind="authentication_error"))
            return await call_next(request)

    async def messages(request: Request, sid: str | None = None):
        try:
            req = await _body(request, MessagesRequest)
            return await _messages(served, req, session_of(served, sid))
        except APIError as e:
            return error_response(e)

    async def count_tokens(request: Request, sid: str | None = None):
        try:
            req = await _body(request, CountTokensRequest)
            return await _count_tokens(served, req, session_of(served, sid))
        except APIError as e:
            return error_response(e)

    for prefix in ("/v1", "/sessions/{sid}/v1"):
        app.post(prefix + "/messages")(messages)
        app.post(prefix + "/messages/count_tokens")(count_tokens)


async def _body(request: Request, kind: type[MessagesRequest]) -> MessagesRequest:
    try:
        return kind.model_validate(await request.json())
    except ValueError as e:  # (a body that is not JSON; pydantic's ValidationError is one too)
        raise APIError(400, _first_error(e)) from None


def _first_error(e: ValueError) -> str:
    if not isinstance(e, ValidationError):
        return "the body is not valid JSON"
    first = e.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg", "invalid request body"))


def _text(blocks, what: str) -> str:
    """The text of a string or of text blocks (the template reads text only)."""
    if isinstance(blocks, list):
        blocks = [{"type": "text", "text": b.get("text")} if isinstance(b, dict) and b.get("type") == "text" else b
                  for b in blocks]  # (cache_control and citations dropped)
    try:
        return message_text(blocks) or ""
    except APIError:
        raise APIError(400, f"{what} must be a string or text blocks (this model reads text only)") from None


def chat_messages(req: MessagesRequest) -> list[dict]:
    """The conversation as OpenAI-style chat messages: tool_result blocks become `tool` messages in their place,
    tool_use blocks the assistant's `tool_calls`, thinking blocks its `reasoning_content`."""
    out = [{"role": "system", "content": _text(req.system, "system")}] if req.system else []
    for m in req.messages:
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise APIError(400, f"messages: role must be user or assistant, got {role!r}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, "messages: content must be a string or a list of content blocks")
        texts, calls, thinking = [], [], []
        for b in content:
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                texts.append(_text([b], "a text block"))
            elif kind == "tool_result" and role == "user":
                if texts:  # (text before a result stays before it)
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _text(b.get("content") or "", "tool_result content")})
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise APIError(400, "messages: a tool_use block needs a name and an input object")
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "thinking" and role == "assistant":
                thinking.append(b.get("thinking") or "")
            elif kind != "redacted_thinking":
                raise APIError(400, f"messages: {kind!r} blocks are not served in {role} messages (text, "
                               "tool_use, tool_result and thinking are)")
        if texts or calls or thinking or role == "assistant":
            msg = {"role": role, "content": "\n".join(texts) if texts or not calls else None}
            out.append(msg | ({"tool_calls": calls} if calls else {})
                       | ({"reasoning_content": "\n".join(thinking)} if thinking else {}))
    return out


def chat_tool_choice(choice: dict | None) -> str | dict:
    """Anthropic's `tool_choice` as the chat route's: `any` is `required`, `tool` a named function."""
    kind = (choice or {"type": "auto"}).get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f"tool_choice {kind!r}: not served (auto, none, any, or tool with a name are)")


def chat_request(req: MessagesRequest) -> ChatRequest:
    choice = chat_tool_choice(req.tool_choice)
    tools = []
    for t in req.tools or []:
        if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise APIError(400, "tools: each needs a name and an input_schema (server tools are not served)")
        tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                       "parameters": t["input_schema"]}})
    try:
        return ChatRequest(model=req.model, messages=chat_messages(req), tools=tools or None, tool_choice=choice,
                           max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p or 1.0,
                           top_k=req.top_k, stop=req.stop_sequences, stream=req.stream)
    except ValidationError as e:  # (messages with no content left)
        raise APIError(400, _first_error(e)) from None


def content_blocks(message: dict) -> list[dict]:
    """A parsed chat message as Anthropic's content blocks: thinking, text, tool_use (input: the sampled JSON)."""
    blocks = [{"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}] \
        if message.get("reasoning_content") is not None else []
    if message.get("content") or not message.get("tool_calls"):
        blocks.append({"type": "text", "text": message.get("content") or ""})
    for c in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": f"toolu_{c['id'].removeprefix('call_')}",
                       "name": c["function"]["name"], "input": json.loads(c["function"]["arguments"])})
    return blocks


def stop_of(served: Served, body: ChatRequest, choice: dict, token_ids: list[int]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a sample cut at a stop string holds it in its tokens' text."""
    if choice["finish_reason"] == "tool_calls":
        return "tool_use", None
    if choice["finish_reason"] == "length":
        return "max_tokens", None
    text = served.tokenizer.decode(token_ids, skip_special_tokens=False)
    found = [(text.find(s), s) for s in body.stops if s in text]
    return ("stop_sequence", min(found)[1]) if found else ("end_turn", None)


async def _messages(served: Served, req: MessagesRequest, session: Session | None):
    body = chat_request(req)
    if body.stream:
        async with locked(session):
            ids, sp, parse = chat_prompt(served, body, session)
        return StreamingResponse(_stream(served, body, session, ids, sp, parse), media_type="text/event-stream")
    ids, samples, choices = await chat_reply(served, body, session)
    reason, stop = stop_of(served, body, choices[0], samples[0].token_ids)
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": req.model,
            "content": content_blocks(choices[0]["message"]), "stop_reason": reason, "stop_sequence": stop,
            "usage": {"input_tokens": len(ids), "output_tokens": len(samples[0].token_ids)}}


async def _count_tokens(served: Served, req: CountTokensRequest, session: Session | None) -> dict:
    """The prompt's tokens as `/messages` would make them of the same request: its rendering (a forced call's
    opener included) and, in a session, the trajectory it extends."""
    body = chat_request(req)
    async with locked(session):
        text, _ = chat_text(served, body, session)
        n = session.prompt_length(text) if session is not None else len(served.tokenizer.encode(text))
    return {"input_tokens": n}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind} | data)}\n\n"


async def _stream(served: Served, body: ChatRequest, session: Session | None, ids: list[int], sp, parse):
    """Anthropic's events: text deltas as they are generated (with tools, the parsed blocks at the end, once the
    calls can be parsed), then the stop reason and the usage."""
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": body.model,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": len(ids), "output_tokens": 0}}
    yield _event("message_start", {"message": message})
    task, deltas = streamed(served, session, ids, sp, body, parse is None)
    sent = ""
    if parse is None:
        yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    async for _, new in deltas:
        sent += new
        yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": new}})
    try:
        s = task.result()[0]
    except APIError as e:
        yield _event("error", {"error": {"type": _KINDS.get(e.kind, e.kind), "message": e.message}})
        return
    choice = _chat_choice(served, body, session, 0, s, parse)
    if parse is None:
        rest = (choice["message"]["content"] or "")[len(sent):]
        if rest:
            yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": rest}})
        yield _event("content_block_stop", {"index": 0})
    else:
        for i, b in enumerate(content_blocks(choice["message"])):
            start, delta = _block_start_and_delta(b)
            yield _event("content_block_start", {"index": i, "content_block": start})
            yield _event("content_block_delta", {"index": i, "delta": delta})
            yield _event("content_block_stop", {"index": i})
    reason, stop = stop_of(served, body, choice, s.token_ids)
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop},
                                   "usage": {"output_tokens": len(s.token_ids)}})
    yield _event("message_stop", {})


def _block_start_and_delta(b: dict) -> tuple[dict, dict]:
    if b["type"] == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}, {"type": "thinking_delta",
                                                                       "thinking": b["thinking"]}
    if b["type"] == "text":
        return {"type": "text", "text": ""}, {"type": "text_delta", "text": b["text"]}
    return b | {"input": {}}, {"type": "input_json_delta", "partial_json": json.dumps(b["input"])}
