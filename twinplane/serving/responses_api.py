"""OpenAI's Responses API (`POST /v1/responses`, and under `/sessions/<id>/v1`) on the engine and sessions of the
chat route: the input items become chat messages (`instructions` the system message, `function_call` items the
assistant's `tool_calls`, `function_call_output` items `tool` messages) and take the chat route's path
(`openai_api.chat_reply`); the parsed reply comes back as output items, or with `stream` as the API's server-sent
events (the chat stream's machinery, `openai_api.streamed`).

Not served: `previous_response_id` and stored responses (a session keeps the tokens; the client sends the history),
built-in tools, images and files. `tool_choice` `required` or a named function forces a call as the chat route does.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from twinplane.rollout.sequence import Sample
from twinplane.serving.openai_api import Served, _chat_choice, chat_prompt, chat_reply, locked, session_of, streamed
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
    seed: int | None = None  # (not OpenAI's: a client sends it as an extra field, for a sample that repeats)
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
    tools = []
    for t in req.tools or []:
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise APIError(400, f"tools: only function tools are served, got {t.get('type')!r}", "tools")
        tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                       "parameters": t.get("parameters") or {}}})
    try:
        return ChatRequest(model=req.model, messages=chat_messages(req), tools=tools or None,
                           tool_choice=chat_tool_choice(req.tool_choice), max_tokens=req.max_output_tokens,
                           temperature=req.temperature, top_p=req.top_p, seed=req.seed, stream=req.stream)
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


def response_object(req: ResponsesRequest, rid: str, created: int, output: list[dict], status: str,
                    input_tokens: int, output_tokens: int) -> dict:
    """The Response object: `status` in_progress (a stream's first events), completed, or incomplete (cut by
    `max_output_tokens`)."""
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None, "error": None,
            "model": req.model, "instructions": req.instructions, "output": output,
            "output_text": "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"]),
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": True,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                      "total_tokens": input_tokens + output_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def _status(s: Sample) -> str:
    return "incomplete" if s.finish_reason == "length" else "completed"


async def _respond(served: Served, req: ResponsesRequest, session: Session | None):
    body = chat_request(req)
    if body.stream:
        async with locked(session):
            ids, sp, parse = chat_prompt(served, body, session)
        return StreamingResponse(_stream(served, req, body, session, ids, sp, parse), media_type="text/event-stream")
    ids, samples, choices = await chat_reply(served, body, session)
    return response_object(req, f"resp_{uuid.uuid4().hex}", int(time.time()), output_items(choices[0]["message"]),
                           _status(samples[0]), len(ids), len(samples[0].token_ids))


async def _stream(served: Served, req: ResponsesRequest, body: ChatRequest, session: Session | None,
                  ids: list[int], sp, parse):
    """The Responses API's events: the text as it is generated (with tools, the parsed items at the end, once the
    calls can be parsed), each item added, filled and done, then the whole response (completed or incomplete)."""
    rid, created, numbers = f"resp_{uuid.uuid4().hex}", int(time.time()), itertools.count()

    def event(kind: str, **data) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(numbers)} | data)}\n\n"

    start = response_object(req, rid, created, [], "in_progress", len(ids), 0)
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    task, deltas = streamed(served, session, ids, sp, body, parse is None)
    text_id, sent = f"msg_{uuid.uuid4().hex}", ""
    if parse is None:  # one message, streamed as it is generated
        yield event("response.output_item.added", output_index=0, item=_opened({"type": "message", "id": text_id}))
        yield event("response.content_part.added", item_id=text_id, output_index=0, content_index=0, part=_PART)
    async for _, new in deltas:
        sent += new
        yield event("response.output_text.delta", item_id=text_id, output_index=0, content_index=0, delta=new,
                    logprobs=[])
    try:
        s = task.result()[0]
    except APIError as e:
        yield event("error", code=e.kind, message=e.message, param=e.param)
        return
    out = output_items(_chat_choice(served, body, session, 0, s, parse)["message"])
    if parse is None:
        out[0]["id"] = text_id
        rest = out[0]["content"][0]["text"][len(sent):]
        if rest:
            yield event("response.output_text.delta", item_id=text_id, output_index=0, content_index=0, delta=rest,
                        logprobs=[])
        for e in _item_events(event, 0, out[0], opened=True):
            yield e
    else:
        for i, item in enumerate(out):
            for e in _item_events(event, i, item):
                yield e
    status = _status(s)
    yield event(f"response.{status}", response=response_object(req, rid, created, out, status, len(ids),
                                                               len(s.token_ids)))


_PART = {"type": "output_text", "text": "", "annotations": []}


def _opened(item: dict) -> dict:
    """An output item as its `output_item.added` event shows it: in progress, nothing in it yet."""
    empty = {"message": {"role": "assistant", "content": []}, "function_call": {"arguments": ""},
             "reasoning": {"summary": []}}[item["type"]]
    return item | empty | ({"status": "in_progress"} if item["type"] != "reasoning" else {})


def _item_events(event, i: int, item: dict, opened: bool = False):
    """The events of output item `i`, whole: added (unless `opened`: added and text streamed already), its text
    or arguments, done."""
    if not opened:
        yield event("response.output_item.added", output_index=i, item=_opened(item))
    if item["type"] == "message":
        text, where = item["content"][0]["text"], {"item_id": item["id"], "output_index": i, "content_index": 0}
        if not opened:
            yield event("response.content_part.added", **where, part=_PART)
            yield event("response.output_text.delta", **where, delta=text, logprobs=[])
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part=item["content"][0])
    elif item["type"] == "function_call":
        where = {"item_id": item["id"], "output_index": i}
        yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
        yield event("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"])
    yield event("response.output_item.done", output_index=i, item=item)
