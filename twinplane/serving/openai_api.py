"""The OpenAI-compatible HTTP API over the own engine (FastAPI): `/v1/models`, `/v1/completions`,
`/v1/chat/completions`, and the same routes under `/sessions/<id>/v1` for an agent episode whose tokens are
recorded (twinplane.serving.sessions).

Every request becomes one engine request of `n` samples, batched with all others in flight (`EngineLoop`). Chat
prompts are rendered by the model's chat template with the request's `tools`; the reply's tool calls are parsed
by the template's format (`tool_parsers`) and returned with their arguments exactly as sampled; `tool_choice` may
force a call (the prompt then ends with the opening of one, see `tool_choice.py`). Inside a session the run's
sampling is used whatever the request asks (the trainer scores the policy the run samples), with the session's
token budget as the cap. Errors are OpenAI's JSON with 400 (bad body, prompt over the context), 401 (key), 404
(model, session); the server stays up. Anthropic's `/messages` (anthropic_api) and OpenAI's
`/responses` (responses_api) take the chat path too (`chat_prompt`, `chat_reply`); `server.build_app` registers all.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
import uuid
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from twinplane.data.records import DataError
from twinplane.rollout.sampling import SamplingParams
from twinplane.rollout.sequence import Sample
from twinplane.serving.engine_loop import EngineLoop, NotServing
from twinplane.serving.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    cut_at_stop,
    message_text,
    shown_text,
)
from twinplane.serving.sessions import Session, SessionError, SessionStore
from twinplane.serving.templates import ChatTemplate
from twinplane.serving.tool_choice import call_opener, forced_call
from twinplane.serving.tool_parsers import resolve_tool_parser
from twinplane.tokenizer import Tokenizer


@dataclass
class Served:
    """What the routes serve: the engine loop, the model's tokenizer and chat template, and the sessions."""
    loop: EngineLoop
    tokenizer: Tokenizer
    model_name: str
    template: ChatTemplate | None = None  # None: no chat route (a base model)
    tool_parser: str = "auto"
    api_key: str | None = None
    sessions: SessionStore | None = None
    session_sampling: SamplingParams | None = None  # sessions sample as the run does (temperature, top-p, top-k)
    seed: int = 0

    def __post_init__(self):
        self.rng = random.Random(self.seed)  # requests without a seed get one from here
        self.stop_ids = frozenset(t for t in [self.tokenizer.eos_token_id] if t is not None)


def register(app: FastAPI, served: Served) -> None:
    """OpenAI's routes under /v1 and /sessions/<id>/v1; its error shape for `APIError` and bad bodies, and the key
    check (the app is `server.build_app`'s)."""

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg", "invalid request body"))
        return JSONResponse(APIError(400, msg, where or None).body(), status_code=400)

    if served.api_key is not None:  # (an HTTP middleware costs every call a good part of its time: only if needed)
        @app.middleware("http")
        async def check_key(request: Request, call_next):
            if given_key(request) != served.api_key:
                e = APIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                             kind="authentication_error")
                return JSONResponse(e.body(), status_code=401)
            return await call_next(request)

    def models():
        return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": 0,
                                            "owned_by": "twinplane"}]}

    async def completions(body: CompletionRequest, sid: str | None = None):
        return await _completions(served, body, session_of(served, sid))

    async def chat(body: ChatRequest, sid: str | None = None):
        return await _chat(served, body, session_of(served, sid))

    for prefix in ("/v1", "/sessions/{sid}/v1"):
        app.get(prefix + "/models")(models)
        app.post(prefix + "/completions")(completions)
        app.post(prefix + "/chat/completions")(chat)

    # Sessions a client opens itself (`twinplane serve`: an agent evaluated with its tokens recorded); a training
    # run opens its episodes' own and serves none of these.
    def own_sessions() -> SessionStore:
        if served.sessions is None or served.session_sampling is not None:
            raise APIError(404, "this server does not open sessions on request", kind="not_found_error")
        return served.sessions

    async def open_session(request: Request):
        sid = uuid.uuid4().hex[:16]
        own_sessions().open(Session(sid, served.tokenizer))
        return {"id": sid, "object": "session", "base_url": f"{str(request.base_url).rstrip('/')}/sessions/{sid}/v1"}

    async def read_session(sid: str):
        own_sessions()
        s = session_of(served, sid)
        return {"id": sid, "object": "session", "calls": s.calls, "splits": s.splits, "trajectories": [
            {"prompt_ids": t.prompt_ids, "token_ids": t.token_ids, "logprobs": t.logprobs, "loss_mask": t.loss_mask,
             "finish_reason": t.finish_reason, "calls": t.calls} for t in s.trajectories]}

    async def close_session(sid: str):
        if own_sessions().close(sid) is None:
            raise APIError(404, f"session {sid!r} not found", kind="not_found_error")
        return {"id": sid, "object": "session", "deleted": True}

    app.post("/v1/sessions")(open_session)
    app.get("/v1/sessions/{sid}")(read_session)
    app.delete("/v1/sessions/{sid}")(close_session)


def given_key(request: Request) -> str:
    return request.headers.get("authorization", "").removeprefix("Bearer ").strip() or \
        request.headers.get("x-api-key", "")


def session_of(served: Served, sid: str | None) -> Session | None:
    if sid is None:
        return None
    s = served.sessions.get(sid) if served.sessions is not None else None
    if s is None:
        raise APIError(404, f"session {sid!r} not found", kind="not_found_error")
    return s


# --- the routes' work -------------------------------------------------------------------------------------------
def _check_model(served: Served, body, session: Session | None) -> None:
    if session is None and body.model != served.model_name:
        raise APIError(404, f"model {body.model!r} not found (this server serves {served.model_name!r})", "model",
                       "not_found_error")


def _sampling(served: Served, body, max_tokens: int, session: Session | None, top: int = 0) -> SamplingParams | None:
    """The request's sampling (a session's: the run's), None when a session's budget is spent."""
    if session is not None and body.n != 1:
        raise APIError(400, "a session samples one completion per call (n=1)", "n")
    if max_tokens < 1:
        return None
    base = served.session_sampling if session is not None and served.session_sampling is not None else \
        SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=getattr(body, "top_k", None) or 0)
    stops = [served.tokenizer.encode(s) for s in body.stops]  # (ends the engine's work early; text decides)
    return replace(base, n=body.n, max_new_tokens=max_tokens, seed=None, min_new_tokens=0,
                   stop_sequences=[s for s in stops if s], top_logprobs=top)


async def _generate(served: Served, session: Session | None, prompt_ids: list[int], sp: SamplingParams | None,
                    body, on_tokens=None) -> list[Sample]:
    if sp is None:  # a session's budget is spent: nothing to generate, the trajectory is cut
        return [Sample(0, prompt_ids, [], [], "length", served.loop.engine.weight_version)]
    seed = session.call_seed() if session is not None else None
    if seed is None:
        seed = body.seed if body.seed is not None else served.rng.getrandbits(62)
    try:
        future = served.loop.submit(prompt_ids, sp, seed, on_tokens,  # (a session's calls: one engine)
                                    key=session.id if session is not None else None)
    except NotServing as e:
        raise APIError(503, str(e), kind="service_unavailable") from None
    except ValueError as e:
        raise APIError(400, str(e), "messages" if isinstance(body, ChatRequest) else "prompt") from None
    samples = await asyncio.wrap_future(future)
    out = []
    for s in samples:  # a stop string ends the sample at the token that completes it
        keep = cut_at_stop(served.tokenizer, s.token_ids, body.stops)
        if keep is not None and keep < len(s.token_ids):
            s = replace(s, token_ids=s.token_ids[:keep], logprobs=s.logprobs[:keep], finish_reason="stop",
                        versions=s.versions[:keep] if s.versions else None, loss_mask=None,
                        top_logprobs=s.top_logprobs[:keep] if s.top_logprobs else None)
        elif keep is not None:
            s = replace(s, finish_reason="stop")
        out.append(s)
    return out


def _texts(served: Served, s: Sample, stops: list[str]) -> tuple[str, str]:
    """(shown, full): what the client sees, and the exact text of the sample's tokens."""
    shown, _ = shown_text(served.tokenizer, s.token_ids, served.stop_ids, stops)
    return shown, served.tokenizer.decode(s.token_ids, skip_special_tokens=False)


def _record(session: Session | None, s: Sample, shown: str, full: str) -> None:
    if session is not None:
        session.record(s, full, full[len(shown):] if full.startswith(shown) else "")


def _usage(prompt_ids: list[int], samples: list[Sample]) -> dict:
    done = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": done, "total_tokens": len(prompt_ids) + done}


def _token_text(served: Served, t: int) -> str:
    return served.tokenizer.decode([t], skip_special_tokens=False)


async def _completions(served: Served, body: CompletionRequest, session: Session | None):
    _check_model(served, body, session)
    if body.echo:
        raise APIError(400, "echo is not supported", "echo")
    if body.stream:
        raise APIError(400, "stream is supported on /chat/completions only", "stream")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request (send several requests: they are batched)", "prompt")
        prompt = prompt[0]
    async with locked(session):
        ids, left = _prompt(served, session, text=prompt if isinstance(prompt, str) else None,
                            ids=None if isinstance(prompt, str) else prompt)
        sp = _sampling(served, body, min(body.max_tokens or 16, 1 << 30 if left is None else left), session,
                       body.logprobs or 0)
        samples = await _generate(served, session, ids, sp, body)
        choices = []
        for i, s in enumerate(samples):
            shown, full = _texts(served, s, body.stops)
            _record(session, s, shown, full)
            lp = None
            if body.logprobs is not None:
                tokens = [_token_text(served, t) for t in s.token_ids]
                lp = {"tokens": tokens, "token_logprobs": s.logprobs,
                      "top_logprobs": [{_token_text(served, t): v for t, v in pairs} for pairs in s.top_logprobs]
                      if s.top_logprobs else None,
                      "text_offset": list(itertools.accumulate((len(x) for x in tokens), initial=0))[:-1]}
            choices.append({"index": i, "text": shown, "finish_reason": s.finish_reason, "logprobs": lp})
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": body.model, "choices": choices, "usage": _usage(ids, samples)}


def _prompt(served: Served, session: Session | None, text: str | None = None, ids: list[int] | None = None,
            rendered: bool = False):
    if ids is not None and any(not 0 <= t < served.tokenizer.vocab_size for t in ids):
        raise APIError(400, f"prompt token ids must be in 0..{served.tokenizer.vocab_size - 1}", "prompt")
    try:
        if session is not None:
            return session.prompt(text=text, ids=ids, rendered=rendered)
        return (served.tokenizer.encode(text) if text is not None else list(ids)), None
    except (SessionError, ValueError) as e:
        raise APIError(400, str(e), "prompt") from None


def locked(session: Session | None):
    """The session's lock (an agent's calls of one session one at a time), or nothing to hold."""
    return session.lock if session is not None else contextlib.nullcontext()


def _chat_messages(served: Served, body: ChatRequest) -> list[dict]:
    """The messages as the template reads them: text content, tool-call arguments as the template expects."""
    strings_ok = "arguments is string" in served.template.tools_source  # (else the template dumps a mapping as JSON)
    out = []
    for m in body.messages:
        if not isinstance(m.get("role"), str):
            raise APIError(400, "every message needs a role", "messages")
        m = dict(m) | {"content": message_text(m.get("content"))}
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                f = dict(c.get("function", c))
                if isinstance(f.get("arguments"), str) and not strings_ok:
                    try:
                        f["arguments"] = json.loads(f["arguments"])
                    except json.JSONDecodeError:
                        raise APIError(400, f"tool call arguments are not JSON: {f['arguments'][:80]!r}",
                                       "messages") from None
                calls.append({**c, "function": f})
            m["tool_calls"] = calls
        out.append(m)
    return out


def chat_text(served: Served, body: ChatRequest, session: Session | None):
    """(prompt text, the reply's tool-call parser or None) of a chat request: the template's rendering, ended with
    the opener of a call when `tool_choice` forces one (`tool_choice`; the parser reads the reply after it)."""
    _check_model(served, body, session)
    if served.template is None:
        raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
    tools = body.tools if body.tool_choice != "none" else None
    forced_call(body.tool_choice, tools)  # (a choice that is not served, or forces a call without tools: 400)
    parse, opener = None, ""
    if tools:
        try:
            parser = resolve_tool_parser(served.tool_parser, served.template.tools_source, served.template.origin)
        except ValueError as e:
            raise APIError(400, str(e), "tools") from None
        opener = call_opener(body.tool_choice, tools, parser)
        parse = lambda text: parser(opener + text, tools)  # noqa: E731
    try:
        text = served.template.render(_chat_messages(served, body), tools=body.tools, add_generation_prompt=True)
    except DataError as e:
        raise APIError(400, str(e), "messages") from None
    if opener and text.rstrip().endswith("<think>"):
        raise APIError(400, "tool_choice: this chat template opens reasoning in the generation prompt, so a forced "
                       "call would be written inside it (use auto)", "tool_choice")
    return text + opener, parse


def chat_prompt(served: Served, body: ChatRequest, session: Session | None):
    """(prompt ids, sampling or None when a session's budget is spent, the tool-call parser or None) of a chat
    request: `chat_text` matched against the session. The caller holds the session's lock."""
    text, parse = chat_text(served, body, session)
    top = (body.top_logprobs or 0) if body.logprobs else 0
    ids, left = _prompt(served, session, text=text, rendered=True)
    want = body.max_completion_tokens or body.max_tokens or served.loop.max_model_len - len(ids)
    sp = _sampling(served, body, max(1, want) if left is None else min(want, left), session, top)
    if sp is None and body.stream:
        raise APIError(400, f"session {session.id}: its token budget is spent", "messages")
    return ids, sp, parse


async def chat_reply(served: Served, body: ChatRequest, session: Session | None):
    """A chat request answered whole: (prompt ids, samples, their choices: parsed and recorded in the session)."""
    async with locked(session):
        ids, sp, parse = chat_prompt(served, body, session)
        samples = await _generate(served, session, ids, sp, body)
        return ids, samples, [_chat_choice(served, body, session, i, s, parse) for i, s in enumerate(samples)]


async def _chat(served: Served, body: ChatRequest, session: Session | None):
    if body.stream:
        async with locked(session):
            ids, sp, parse = chat_prompt(served, body, session)
        return StreamingResponse(_chat_stream(served, body, session, ids, sp, parse), media_type="text/event-stream")
    ids, samples, choices = await chat_reply(served, body, session)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": body.model, "choices": choices, "usage": _usage(ids, samples)}


def _chat_choice(served: Served, body: ChatRequest, session: Session | None, i: int, s: Sample, parse) -> dict:
    shown, full = _texts(served, s, body.stops)
    _record(session, s, shown, full)
    message: dict = {"role": "assistant", "content": shown}
    finish = s.finish_reason
    if parse is not None:
        parsed = parse(shown)
        message["content"] = parsed.content
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in parsed.tool_calls]
            finish = "tool_calls"
    lp = None
    if body.logprobs:
        def entry(t: int, v: float) -> dict:
            text = _token_text(served, t)
            return {"token": text, "logprob": v, "bytes": list(text.encode())}

        lp = {"content": [entry(t, v) | {"top_logprobs": [entry(a, b) for a, b in pairs]}
                          for t, v, pairs in zip(s.token_ids, s.logprobs, s.top_logprobs or [[]] * len(s.token_ids),
                                                 strict=True)]}
    return {"index": i, "message": message, "finish_reason": finish, "logprobs": lp}


def streamed(served: Served, session: Session | None, ids: list[int], sp: SamplingParams, body, text: bool):
    """The generation as a task, and an async iterator of (sample index, new text) while it runs (nothing unless
    `text`): text that a stop string would cut, or a character not yet whole, waits."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def on_tokens(j: int, new: list[int], _lps) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (j, new))

    task = asyncio.ensure_future(_generate(served, session, ids, sp, body, on_tokens if text else None))

    async def deltas():
        sent: dict[int, str] = {}
        got: dict[int, list[int]] = {}
        while not task.done() or not queue.empty():
            try:
                j, new = await asyncio.wait_for(queue.get(), timeout=0.05)
            except asyncio.TimeoutError:
                continue
            got[j] = got.get(j, []) + new
            shown, _ = shown_text(served.tokenizer, got[j], served.stop_ids, body.stops)
            shown, before = shown.rstrip("\ufffd"), sent.get(j, "")
            if len(shown) > len(before) and shown.startswith(before):
                sent[j] = shown
                yield j, shown[len(before):]

    return task, deltas()


async def _chat_stream(served: Served, body: ChatRequest, session: Session | None, ids: list[int],
                       sp: SamplingParams, parse):
    """Server-sent events: the text as it is generated (with tools, the whole parsed message at the end, once its
    calls can be parsed), then the finish reasons, the usage when asked for, and [DONE]."""
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": body.model,
               "choices": choices} | ({"usage": usage} if usage is not None else {})
        return f"data: {json.dumps(out)}\n\n"

    task, deltas = streamed(served, session, ids, sp, body, parse is None)
    sent = {j: "" for j in range(sp.n)}
    yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                 for j in range(sp.n)])
    async for j, new in deltas:
        sent[j] += new
        yield chunk([{"index": j, "delta": {"content": new}, "finish_reason": None}])
    try:
        samples = task.result()
    except APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
        return
    for i, s in enumerate(samples):
        choice = _chat_choice(served, body, session, i, s, parse)
        msg = choice["message"]
        delta = {k: v for k, v in msg.items() if k != "role"} if parse else \
            {"content": (msg["content"] or "")[len(sent[i]):]}
        yield chunk([{"index": i, "delta": delta, "finish_reason": choice["finish_reason"]}])
    if (body.stream_options or {}).get("include_usage"):
        yield chunk([], _usage(ids, samples))
    yield "data: [DONE]\n\n"
