"""`/v1/responses` with `stream: true`, through the official `openai` client against a real server: the deltas of a
seeded request add up to the text of the same request unstreamed, the events come in the API's order with
consecutive sequence numbers, the SDK's own accumulator rebuilds the response, a function call streams its
arguments, a streamed session keeps one trajectory, and an engine that is not serving ends the stream with an
error event."""

from __future__ import annotations

import pytest
from chat_model import Scripted, chat_model_dir, serving

from twinplane.serving.sessions import Session

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(chat_model_dir(tmp_path_factory.mktemp("m")), name="tiny", max_model_len=1024,
                 api_key="sekret") as both:
        yield both


def client(url, base="/v1"):
    return openai.OpenAI(base_url=url + base, api_key="sekret", max_retries=0)


def test_the_deltas_of_a_seeded_request_add_up_to_its_unstreamed_text(server):
    _, url = server
    ask = {"model": "tiny", "instructions": "You add.", "input": "What is 2+3?", "max_output_tokens": 24,
           "temperature": 1.0, "extra_body": {"seed": 7}}
    whole = client(url).responses.create(**ask)
    events = list(client(url).responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-5:] == ["response.output_text.delta", "response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text and len(whole.output_text) >= 6
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done, last = events[-2].item, events[-1].response
    assert done.content[0].text == whole.output_text and last.output_text == whole.output_text
    assert last.output[0].id == done.id == events[2].item.id and last.usage.output_tokens == whole.usage.output_tokens
    assert (last.status, last.usage.input_tokens) == (whole.status, whole.usage.input_tokens)


def test_a_function_call_streams_its_arguments_and_the_sdk_rebuilds_the_response(server):
    served, url = server
    real, served.loop = served.loop, Scripted(served, [CALL, CALL, "It is sunny."])
    try:
        ask = {"model": "tiny", "input": "Weather in Paris?", "tools": TOOLS}
        events = list(client(url).responses.create(**ask, stream=True))
        kinds = [e.type for e in events]
        assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.function_call_arguments.delta", "response.function_call_arguments.done",
                         "response.output_item.done", "response.completed"]
        assert events[2].item.arguments == "" and events[3].delta == events[4].arguments == '{"city": "Paris"}'
        with client(url).responses.stream(**ask) as stream:  # (the SDK's accumulator checks the items' identities)
            final = stream.get_final_response()
        call = final.output[0]
        assert (call.type, call.name, call.arguments, final.status) == ("function_call", "get_weather",
                                                                       '{"city": "Paris"}', "completed")
        with client(url).responses.stream(model="tiny", input="Weather?") as stream:
            assert stream.get_final_response().output_text == "It is sunny."
    finally:
        served.loop = real


def test_a_streamed_session_keeps_one_trajectory(server):
    served, url = server
    session = served.sessions.open(Session("s1", served.tokenizer))
    c = client(url, "/sessions/s1/v1")
    items: list = [{"role": "user", "content": "What is 2+3?"}]
    sampled = 0
    try:
        for turn in range(2):
            events = list(c.responses.create(model="m", input=items, max_output_tokens=10, stream=True))
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert events[-1].response.output_text == text
            sampled += events[-1].response.usage.output_tokens
            items += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And {turn}?"}]
    finally:
        served.sessions.close("s1")
    assert session.splits == 0 and len(session.trajectories) == 1 and session.current.calls == 2
    assert sum(session.current.loss_mask) == sampled > 0


def test_stream_errors_before_and_after_it_starts_and_the_server_stays_up(server):
    served, url = server
    c = client(url)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        c.responses.create(model="tiny", input="hi", previous_response_id="resp_1", stream=True)
    with pytest.raises(openai.NotFoundError, match="model 'nope'"):
        c.responses.create(model="nope", input="hi", stream=True)
    served.loop.shut()  # (as a training run does between its rollouts)
    try:
        events = list(c.responses.create(model="tiny", input="hi", max_output_tokens=3, stream=True))
    finally:
        served.loop.open()
    assert [e.type for e in events][-1] == "error" and "not serving" in events[-1].message
    assert c.responses.create(model="tiny", input="hi", max_output_tokens=3).status == "incomplete"
