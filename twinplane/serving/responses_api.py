"""OpenAI's Responses API (`POST /v1/responses`, and under `/sessions/<id>/v1`), non-streaming, on the engine and
sessions of the chat route: the input items become chat messages (`instructions` the system message,
`function_call` items the assistant's `tool_calls`, `function_call_output` items `tool` messages) and take the
chat route's path (`openai_api.chat_reply`); the parsed reply comes back as output items.

Not served: `previous_response_id` and stored responses (a session keeps the tokens; the client sends the history),
built-in tools, images and files. `tool_choice` `required` or a named function forces a call as the chat route does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from twinplane.serving.openai_api import Served, chat_reply, session_of
from twinplane.serving.protocol import APIError, ChatRequest
from twinplane.serving.sessions import Session


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    previous_response_id: str | None = None
    stream: bool = False


def register(app: FastAPI, served: Served) -> None:
    async def responses(body: ResponsesRequest, sid: str | None = None):
        return await _respond(served, body, session_of(served, sid))

    for prefix in ("/v1", "/sessions/{sid}/v1"):
        app.post(prefix + "/responses")(responses)


def _text(content, what: str) -> str:
    """The text of a string or of text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    parts = []
    for p in content if isinstance(content, list) else [None]:
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") or \
                not isinstance(p.get("text"), str):
            raise APIError(400, f"{what} must be a string or text parts (this model reads text only)", "input")
        parts.append(p["text"])
    return "".join(parts)


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """The input items as OpenAI-style chat messages; function calls join the assistant message before them."""
    out = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    reasoning = None  # (a reasoning item belongs to the assistant turn after it)
    for it in items:
        kind = it.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(it.get("role"), it.get("role"))
            if role not in ("user", "system", "assistant"):
                raise APIError(400, f"input: role must be user, system, developer or assistant, got {role!r}",
                               "input")
            out.append({"role": role, "content": _text(it.get("content"), "message content")})
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("arguments"), str):
                raise APIError(400, "input: a function_call item needs a name and its arguments (JSON text)", "input")
            call = {"id": it.get("call_id"), "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": it.get("call_id"),
                        "content": _text(it.get("output"), "function_call_output output")})
        elif kind == "reasoning":
            reasoning = "\n".join(s.get("text", "") for s in it.get("summary") or [] if isinstance(s, dict))
            continue
        else:
            raise APIError(400, f"input: {kind!r} items are not served (message, function_call, "
                           "function_call_output and reasoning are)", "input")
        if reasoning is not None and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], reasoning = reasoning, None
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    """The Responses API's `tool_choice` as the chat route's: a named function is `{"type": "function", "name": N}`."""
    if not isinstance(choice, dict):
        return choice  # (auto, none, required; another string fails the chat request's check)
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f"tool_choice {choice.get('type')!r}: not served (auto, none, required or "
                   '{"type": "function", "name": ...} are)', "tool_choice")


def chat_request(req: ResponsesRequest) -> ChatRequest:
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not served: responses are not stored (send the whole "
                       "conversation in input; a session keeps its tokens)", "previous_response_id")
    if req.stream:
        raise APIError(400, "stream is not served on /responses (use /chat/completions or /messages)", "stream")
    tools = []
    for t in req.tools or []:
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise APIError(400, f"tools: only function tools are served, got {t.get('type')!r}", "tools")
        tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                       "parameters": t.get("parameters") or {}}})
    try:
        return ChatRequest(model=req.model, messages=chat_messages(req), tools=tools or None,
                           tool_choice=chat_tool_choice(req.tool_choice), max_tokens=req.max_output_tokens,
                           temperature=req.temperature, top_p=req.top_p)
    except ValidationError as e:
        first = e.errors()[0]
        raise APIError(400, f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None


def output_items(message: dict) -> list[dict]:
    """A parsed chat message as output items: reasoning, the message's text, function calls (arguments as
    sampled)."""
    items = [{"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}",
              "summary": [{"type": "summary_text", "text": message["reasoning_content"]}]}] \
        if message.get("reasoning_content") is not None else []
    if message.get("content") or not message.get("tool_calls"):
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": []}]})
    for c in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": c["id"],
                      "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"})
    return items


async def _respond(served: Served, req: ResponsesRequest, session: Session | None) -> dict:
    body = chat_request(req)
    ids, samples, choices = await chat_reply(served, body, session)
    out, done = output_items(choices[0]["message"]), len(samples[0].token_ids)
    cut = samples[0].finish_reason == "length"
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "model": req.model, "instructions": req.instructions, "output": out,
            "output_text": "".join(p["text"] for it in out if it["type"] == "message" for p in it["content"]),
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": True,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": None,
            "usage": {"input_tokens": len(ids), "output_tokens": done, "total_tokens": len(ids) + done,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}
