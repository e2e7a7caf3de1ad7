"""The OpenAI-compatible server, through the official `openai` client against a real uvicorn server: answers equal
the engine's own `generate` on the rendered prompt, concurrent requests share engine steps, errors are OpenAI's
JSON and leave the server up, sessions record exactly the tokens each call saw and sampled."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from chat_model import chat_model_dir, record_calls, serving

openai = pytest.importorskip("openai")

from twinplane.rollout.sampling import SamplingParams  # noqa: E402
from twinplane.rollout.sequence import Sample  # noqa: E402
from twinplane.serving.sessions import Session  # noqa: E402

CHAT = [{"role": "system", "content": "You add."}, {"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(chat_model_dir(tmp_path_factory.mktemp("m")), name="tiny", max_model_len=600,
                 api_key="sekret") as both:
        yield both


def client(url, key="sekret", **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, **kw)


def engine_greedy(served, ids, max_new):
    served.loop.idle()
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    return served.loop.engine.generate([ids], sp)[0]


def test_completions_and_chat_equal_the_engine_on_the_rendered_prompt(server):
    served, url = server
    c = client(url)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.completions.create(model="tiny", prompt="Hello", max_tokens=9, temperature=0, logprobs=3)
    want = engine_greedy(served, served.tokenizer.encode("Hello"), 9)
    ch = r.choices[0]
    assert ch.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-6)
    assert [len(t) for t in ch.logprobs.top_logprobs] == [3] * len(want.token_ids)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == len(want.token_ids)
    assert ch.text == served.tokenizer.decode(want.token_ids[:-1] if want.finish_reason == "stop" else want.token_ids,
                                              skip_special_tokens=False)
    text = served.template.render(CHAT, add_generation_prompt=True)
    want = engine_greedy(served, served.tokenizer.encode(text), 20)
    r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0, logprobs=True,
                                  top_logprobs=2)
    assert r.usage.prompt_tokens == len(served.tokenizer.encode(text))
    assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(want.logprobs, abs=1e-6)
    streamed = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_a_streamed_reply_that_ends_on_the_stop_token_does_not_show_it(server):
    c = client(server[1])
    for seed in range(40):  # (sampled replies: the first that ends on the stop token within the budget)
        r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, seed=seed, temperature=1.0)
        if r.choices[0].finish_reason == "stop":
            break
    assert r.choices[0].finish_reason == "stop" and "<|im_end|>" not in r.choices[0].message.content
    chunks = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, seed=seed, temperature=1.0,
                                       stream=True)
    assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == r.choices[0].message.content


def test_seeded_samples_repeat_and_n_gives_distinct_streams(server):
    _, url = server
    c = client(url)
    a = c.completions.create(model="tiny", prompt="abc", max_tokens=12, n=3, seed=7, temperature=1.0)
    b = c.completions.create(model="tiny", prompt="abc", max_tokens=12, n=3, seed=7, temperature=1.0)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert len({x.text for x in a.choices}) > 1


def test_concurrent_requests_share_engine_steps_and_answer_as_alone(server):
    served, url = server
    prompts = [f"q{i}:" for i in range(16)]
    alone = [engine_greedy(served, served.tokenizer.encode(p), 10) for p in prompts]
    served.loop.engine.pop_stats()

    async def all_at_once():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        return await asyncio.gather(*[c.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0,
                                                           logprobs=0) for p in prompts])

    got = asyncio.run(all_at_once())
    stats = served.loop.engine.pop_stats()
    assert [r.choices[0].logprobs.token_logprobs for r in got] == \
        [pytest.approx(s.logprobs, abs=1e-5) for s in alone]
    assert stats.running_sum / stats.steps > 4  # batched: many sequences per engine step, not one at a time


def test_bad_requests_get_openai_errors_and_the_server_stays_up(server):
    _, url = server
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").models.list()
    c = client(url)
    with pytest.raises(openai.NotFoundError, match="model 'nope' not found"):
        c.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context of 600 tokens"):
        c.completions.create(model="tiny", prompt="x" * 590, max_tokens=20)
    with pytest.raises(openai.BadRequestError, match="tool_choice names 'g', which is not one of the request's"):
        c.chat.completions.create(model="tiny", messages=CHAT, tool_choice={"type": "function", "function": {
            "name": "g"}}, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer sekret"}, content=b"{not json")
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type"}
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer sekret"},
                   json={"model": "tiny", "messages": [], "temperature": 9})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "temperature: Input should be less than or equal to 2"
    with pytest.raises(openai.NotFoundError, match="session 'ghost' not found"):
        openai.OpenAI(base_url=url + "/sessions/ghost/v1", api_key="sekret").chat.completions.create(
            model="tiny", messages=CHAT)
    assert c.completions.create(model="tiny", prompt="still up", max_tokens=3).choices[0].text is not None


def test_a_session_extends_its_exact_tokens_and_splits_on_divergence(server):
    served, url = server
    session = served.sessions.open(Session("ep1", served.tokenizer, budget=200))
    c = openai.OpenAI(base_url=url + "/sessions/ep1/v1", api_key="sekret", max_retries=0)
    messages = list(CHAT)
    engine = served.loop.engine
    calls = record_calls(served.loop)
    try:
        for turn in range(4):
            r = c.chat.completions.create(model="anything", messages=messages, max_tokens=12)
            reply = r.choices[0].message.content
            messages += [{"role": "assistant", "content": reply},
                         {"role": "tool" if turn % 2 else "user", "content": f"result {turn}"}]
        assert session.splits == 0 and len(session.trajectories) == 1
        t = session.current
        for ids, fut in calls:  # each call's prompt = the trajectory so far; its output follows
            s: Sample = fut.result()[0]
            assert t.ids[:len(ids)] == ids and t.ids[len(ids):len(ids) + len(s.token_ids)] == s.token_ids
            assert t.logprobs[len(ids) - len(t.prompt_ids):][:len(s.token_ids)] == s.logprobs
        assert sum(t.loss_mask) == sum(len(f.result()[0].token_ids) for _, f in calls)
        assert t.calls == 4 and len(t.token_ids) <= 200
        # the client re-writes the model's earlier reply: a new trajectory, not drifted tokens
        messages[2] = {"role": "assistant", "content": messages[2]["content"] + " (edited)"}
        c.chat.completions.create(model="anything", messages=messages, max_tokens=5)
        assert session.splits == 1 and len(session.trajectories) == 2
        assert [len(s.token_ids) > 0 for s in session.samples(0)] == [True, True]
    finally:
        del served.loop.submit
        served.sessions.close("ep1")
    assert engine.weight_version == 0


class ScriptedLoop:
    """Stands in for the engine: answers every request with the given text (to test the API's tool parsing)."""

    def __init__(self, served, text):
        self.max_model_len, self.served, self.text = 600, served, text

    def submit(self, ids, sp, seed, on_tokens=None, key=None):
        import concurrent.futures

        out = self.served.tokenizer.encode(self.text) + [self.served.tokenizer.eos_token_id]
        f = concurrent.futures.Future()
        f.set_result([Sample(0, list(ids), out, [-0.5] * len(out), "stop", 0)])
        return f


def test_tool_calls_come_back_parsed_with_the_arguments_as_sampled_and_resent_ones_must_match(server):
    served, url = server
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}
    said = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    real, served.loop = served.loop, ScriptedLoop(served, said)

    def episode(sid, edit=None):  # a call, then a call with the tool's result after the reply as the client sends it
        session = served.sessions.open(Session(sid, served.tokenizer))
        c = openai.OpenAI(base_url=url + f"/sessions/{sid}/v1", api_key="sekret", max_retries=0)
        r = c.chat.completions.create(model="m", messages=CHAT, tools=[weather])
        call = r.choices[0].message.tool_calls[0].model_dump()
        if edit is not None:
            call["function"]["arguments"] = edit(call["function"]["arguments"])
        back = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
        c.chat.completions.create(model="m", messages=back, tools=[weather])
        served.sessions.close(sid)
        return r, session

    try:
        r, session = episode("ep2")
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
        assert session.splits == 0 and session.current.calls == 2
        compact = episode("ep3", lambda a: json.dumps(json.loads(a), separators=(",", ":")))[1]
        assert compact.splits == 0  # (this template renders arguments as JSON of its own: the same text)
        changed = episode("ep4", lambda a: a.replace("Paris", "Lyon"))[1]
        assert changed.splits == 1 and [t.calls for t in changed.trajectories] == [1, 1]
    finally:
        served.loop = real


def test_serve_refuses_a_bad_folder_or_flag_with_one_line(tmp_path, capsys):
    from twinplane.cli import main

    assert main(["serve", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().endswith("not a model folder (no config.json)")
    assert main(["serve", str(tmp_path), "--port", "70000"]) == 2
    assert "--port must be in 0..65535" in capsys.readouterr().err


def test_a_client_opens_reads_and_closes_its_own_session(server):
    served, url = server
    auth = {"Authorization": "Bearer sekret"}
    opened = httpx.post(url + "/v1/sessions", headers=auth).json()
    c = openai.OpenAI(base_url=opened["base_url"], api_key="sekret", max_retries=0)
    first = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0)
    more = [*CHAT, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And 3+4?"}]
    c.chat.completions.create(model="tiny", messages=more, max_tokens=6, temperature=0)
    record = httpx.get(f"{url}/v1/sessions/{opened['id']}", headers=auth).json()
    t = record["trajectories"][0]
    assert record["calls"] == 2 and record["splits"] == 0 and len(record["trajectories"]) == 1
    n = first.usage.completion_tokens  # the first reply (sampled), then the next turn's markup and text (not)
    assert len(t["token_ids"]) == len(t["loss_mask"]) == len(t["logprobs"])
    assert t["loss_mask"][:n] == [1] * n and t["loss_mask"][n] == 0 and t["logprobs"][n] == 0.0
    assert t["prompt_ids"] == served.tokenizer.encode(served.template.render(CHAT, add_generation_prompt=True))
    assert httpx.delete(f"{url}/v1/sessions/{opened['id']}", headers=auth).json()["deleted"] is True
    assert httpx.get(f"{url}/v1/sessions/{opened['id']}", headers=auth).status_code == 404
