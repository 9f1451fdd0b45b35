"""OpenAI's Responses API (`/v1/responses`) through the real `openai` SDK against a random-weight
model: it answers what the chat endpoint answers for the same conversation (greedy, token for
token), streamed as Responses' typed events that the SDK's stream helper assembles; function
tools, structured text formats, conversations carried in `input` or continued from a stored
response (read, listed and deleted through the SDK); background responses, polled, cancelled, and
finished after the server is killed mid-answer; what cannot be served is a 400 naming the field; a
stream the client drops frees its sequence."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import eventually, is_alive, metric_total, start_server, write_tiny_lm_model

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
CITY = {"type": "json_schema", "name": "city", "strict": True,
        "schema": {"type": "object", "properties": {"name": {"enum": ["Paris", "Oslo"]},
                                                    "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["name", "rank"], "additionalProperties": False}}


@pytest.fixture
def sdk(tiny_lm_client: openai.OpenAI) -> Iterator[openai.OpenAI]:
    yield tiny_lm_client


def _chat_text(sdk: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, int, str]:
    answer = sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)
    return answer.choices[0].message.content or "", answer.usage.prompt_tokens, answer.choices[0].finish_reason


def test_a_response_is_the_chat_answer_to_the_same_conversation(sdk):
    response = sdk.responses.create(model="tiny", instructions="Answer briefly.", input="Where is Oslo?",
                                    max_output_tokens=12, temperature=0, metadata={"ticket": "42"})
    text, prompt_tokens, finish = _chat_text(sdk, [{"role": "system", "content": "Answer briefly."},
                                                   {"role": "user", "content": "Where is Oslo?"}], 12)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    assert response.output_text == text and text
    assert finish == "length" and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.usage.input_tokens == prompt_tokens and response.usage.output_tokens == 12
    assert response.usage.total_tokens == prompt_tokens + 12
    assert response.metadata == {"ticket": "42"} and response.max_output_tokens == 12


def test_a_stream_is_responses_events_that_add_up_to_the_whole_answer(sdk):
    whole = sdk.responses.create(model="tiny", input="Where is Oslo?", max_output_tokens=10, temperature=0)
    events = list(sdk.responses.create(model="tiny", input="Where is Oslo?", max_output_tokens=10, temperature=0,
                                       stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert deltas >= 2, "the text came as it was generated, not whole at the end"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == text and final.usage.output_tokens == 10
    assert events[-2].item.id == final.output[0].id == events[2].item.id


def test_log_probabilities_are_the_chat_endpoints_unary_and_streamed(sdk):
    ask = dict(model="tiny", input="Where is Oslo?", max_output_tokens=5, temperature=0, top_logprobs=2,
               include=["message.output_text.logprobs"])
    response = sdk.responses.create(**ask)
    chat = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Where is Oslo?"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    [part] = response.output[0].content
    expected = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                for e in chat.choices[0].logprobs.content]
    assert [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in part.logprobs] == expected
    assert len(expected) == 5 and response.top_logprobs == 2
    events = list(sdk.responses.create(stream=True, **ask))
    streamed = [e for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(token, logprob) for token, logprob, _ in expected]
    assert len(events[-1].response.output[0].content[0].logprobs) == 5


def test_a_structured_text_format_completes_and_the_stream_helper_assembles_it(sdk):
    with sdk.responses.stream(model="tiny", input="A city", text={"format": CITY}, max_output_tokens=60,
                              temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.status == "completed"
    value = json.loads(final.output_text)
    assert value["name"] in ("Paris", "Oslo") and 1 <= value["rank"] <= 9
    assert final.text.format.type == "json_schema" and final.text.format.name == "city"


def test_a_named_function_is_called_whole_and_streamed(sdk):
    response = sdk.responses.create(model="tiny", input="Weather in Oslo?", tools=[WEATHER], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    assert response.status == "completed"
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    assert arguments["city"] in ("Paris", "Oslo", "Lima") and arguments["unit"] in ("C", "F")
    with sdk.responses.stream(model="tiny", input="Weather in Oslo?", tools=[WEATHER], temperature=0,
                              tool_choice={"type": "function", "name": "get_weather"},
                              max_output_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments == final.output[0].arguments == call.arguments
    assert final.output[0].name == "get_weather"


def test_required_tools_and_a_conversation_carried_in_input(sdk):
    response = sdk.responses.create(model="tiny", input="Weather?", tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=100, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(item.name == "get_weather" for item in calls)
    call = calls[0]
    followed = sdk.responses.create(
        model="tiny", tools=[WEATHER], tool_choice="none", max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "12 C and rain"}])
    chat = sdk.chat.completions.create(
        model="tiny", max_tokens=8, temperature=0, tools=[{"type": "function", "function": {
            k: v for k, v in WEATHER.items() if k != "type"}}], tool_choice="none",
        messages=[{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                   "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "12 C and rain"}])
    assert followed.output_text == chat.choices[0].message.content
    assert followed.usage.input_tokens == chat.usage.prompt_tokens
    listed = sdk.responses.input_items.list(followed.id, order="asc").data
    assert [(item.type, item.id.split("_")[0]) for item in listed] == [
        ("message", "msg"), ("function_call", "fc"), ("function_call_output", "fco")], "ids prefixed by their type"


@pytest.mark.parametrize("fields, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "Tell me " * 100, "max_output_tokens": 900}, "max_output_tokens"),  # refused by the model itself
    ({"input": "Tell me " * 600}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "12 C"}]}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True, "store": False}, "store"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"], "tools": [WEATHER], "tool_choice": "required"}, "include"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strng"}}}},
     "text.format"),  # refused by the model's worker, where schemas are compiled
])
def test_what_cannot_be_served_is_a_400_naming_the_field(sdk, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model="tiny", **{"input": "Hi", **fields})
    assert refused.value.body["param"] == param, refused.value.body


UNFOLLOWABLE = {"type": "json_schema", "name": "code", "schema": {"type": "string", "pattern": "^(ab )+a{1000000}$"}}
"""Compiles, and is followed for a few tokens: llguidance builds the counted part's lexer when
the text reaches it, and gives up there."""


def test_an_error_mid_stream_is_an_error_event_naming_the_field_and_fails_a_background_response(sdk):
    events = []
    for event in sdk.responses.create(model="tiny", input="Hi", max_output_tokens=40, stream=True,
                                      text={"format": UNFOLLOWABLE}):
        events.append(event)
    assert any(event.type == "response.output_text.delta" for event in events)  # streamed before it failed
    error = events[-1]
    assert error.type == "error" and error.param == "text.format" and "unusable json schema" in error.message
    assert [event.sequence_number for event in events] == list(range(len(events)))
    for stream in (False, True):
        queued = sdk.responses.create(model="tiny", input="Hi", max_output_tokens=40, background=True,
                                      stream=stream, text={"format": UNFOLLOWABLE})
        if stream:
            with queued as events:
                queued = next(iter(events)).response
        failed = _polled(sdk, queued.id)
        assert failed.status == "failed" and "unusable json schema" in failed.error.message, failed.error


def test_a_stored_response_continues_its_conversation_and_can_be_read_and_deleted(sdk):
    first = sdk.responses.create(model="tiny", input="Where is Oslo?", max_output_tokens=6, temperature=0)
    assert first.store is True
    assert sdk.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = sdk.responses.create(model="tiny", previous_response_id=first.id, input="And Lima?",
                                  max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id
    text, prompt_tokens, _ = _chat_text(sdk, [{"role": "user", "content": "Where is Oslo?"},
                                              {"role": "assistant", "content": first.output_text},
                                              {"role": "user", "content": "And Lima?"}], 6)
    assert second.output_text == text and second.usage.input_tokens == prompt_tokens
    items = sdk.responses.input_items.list(second.id, order="asc")
    assert [(item.role, item.status, [part.type for part in item.content], item.content[0].text)
            for item in items.data] == [("user", "completed", ["input_text"], "Where is Oslo?"),
                                        ("assistant", first.output[0].status, ["output_text"], first.output_text),
                                        ("user", "completed", ["input_text"], "And Lima?")]
    assert all(part.annotations == [] for item in items.data if item.role == "assistant" for part in item.content)
    newest = sdk.responses.input_items.list(second.id, limit=1)
    assert [item.id for item in newest.data] == [items.data[-1].id] and newest.has_more
    assert sdk.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        sdk.responses.create(model="tiny", previous_response_id=first.id, input="Hi", max_output_tokens=2)
    assert gone.value.body["param"] == "previous_response_id"
    assert sdk.responses.retrieve(second.id).output_text == second.output_text  # its own copy of the history


def test_a_streamed_response_is_stored_before_it_is_done_and_store_false_keeps_nothing(sdk):
    events = list(sdk.responses.create(model="tiny", input="Where is Oslo?", max_output_tokens=6, temperature=0,
                                       stream=True))
    final = events[-1].response
    assert final.store is True and sdk.responses.retrieve(final.id).output_text == final.output_text
    unstored = sdk.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unstored.id)


def test_unknown_responses_and_models(sdk, tiny_lm_server):
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve("resp_123")
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete("resp_123")
    response = httpx.post(f"{tiny_lm_server.url}/v1/responses", json={"model": "nope", "input": "Hi"})
    assert response.status_code == 404 and "nope" in response.json()["error"]["message"]
    response = httpx.post(f"{tiny_lm_server.url}/v1/responses", content=b"{not json")
    assert response.status_code == 400 and "error" in response.json()


def test_a_dropped_stream_frees_its_sequence(sdk, tiny_lm_server):
    cancelled = metric_total(tiny_lm_server, "sluice_requests_total", model="tiny", outcome="cancelled")
    with httpx.stream("POST", f"{tiny_lm_server.url}/v1/responses", timeout=60, json={
            "model": "tiny", "input": "Tell me a long story", "max_output_tokens": 900, "stream": True,
            "temperature": 0}) as stream:  # greedy: a sampled random model may end its text at once
        for line in stream.iter_lines():
            if line.startswith("data: ") and "output_text.delta" in line:
                eventually(lambda: metric_total(tiny_lm_server, "vllm:num_requests_running", model_name="tiny") == 1,
                           "the stream's sequence to be reported running", timeout_s=10)
                break
    eventually(lambda: metric_total(tiny_lm_server, "vllm:num_requests_running", model_name="tiny") == 0,
               "the dropped stream's sequence to leave the engine")
    assert metric_total(tiny_lm_server, "sluice_requests_total", model="tiny", outcome="cancelled") == cancelled + 1


def _polled(sdk: openai.OpenAI, response_id: str, timeout_s: float = 60) -> openai.types.responses.Response:
    deadline = time.monotonic() + timeout_s
    while (response := sdk.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.05)
    return response


def test_a_background_response_is_queued_then_polled_to_the_foreground_answer(sdk, tiny_lm_server):
    ask = dict(model="tiny", instructions="Answer briefly.", input="Where is Oslo?", max_output_tokens=12,
               temperature=0)
    foreground = sdk.responses.create(**ask)
    ended = metric_total(tiny_lm_server, "sluice_background_responses_total", status="incomplete")
    queued = sdk.responses.create(**ask, background=True, metadata={"job": "7"})
    assert queued.status == "queued" and queued.background is True and queued.store is True
    assert queued.output == [] and queued.usage is None
    done = _polled(sdk, queued.id)
    assert done.id == queued.id and done.background is True and done.error is None
    assert done.status == foreground.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text == foreground.output_text and done.usage.output_tokens == 12
    assert done.metadata == {"job": "7"} and done.instructions == "Answer briefly."
    assert metric_total(tiny_lm_server, "sluice_background_responses_total", status="incomplete") == ended + 1
    assert [item.content[0].text for item in sdk.responses.input_items.list(done.id).data] == ["Where is Oslo?"]
    follow = sdk.responses.create(model="tiny", previous_response_id=done.id, input="And Lima?",
                                  max_output_tokens=4, temperature=0)
    assert follow.status == "incomplete" and follow.previous_response_id == done.id
    assert sdk.responses.cancel(done.id).model_dump() == done.model_dump(), "ended: answered as it is"
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.cancel(foreground.id)
    assert refused.value.body["param"] == "response_id"
    streamed = httpx.get(f"{tiny_lm_server.url}/v1/responses/{done.id}", params={"stream": "true"})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"


def test_a_streamed_background_response_goes_on_without_its_client_and_its_stream_resumes(sdk, tiny_lm_server):
    ask = dict(model="tiny", input="Where is Oslo?", max_output_tokens=40, temperature=0)
    foreground = sdk.responses.create(**ask)
    with httpx.stream("POST", f"{tiny_lm_server.url}/v1/responses", json={**ask, "background": True, "stream": True},
                      headers={"Cache-Control": "no-cache"}, timeout=60) as stream:
        first = []
        for line in stream.iter_lines():
            if line.startswith("data: "):
                first.append(json.loads(line.removeprefix("data: ")))
                if first[-1]["type"] == "response.output_text.delta":
                    break  # the client goes away mid-answer
    response_id = first[0]["response"]["id"]
    assert [e["type"] for e in first[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert first[0]["response"]["status"] == "queued" and first[0]["response"]["background"] is True
    done = _polled(sdk, response_id)
    assert done.status == "incomplete" and done.output_text == foreground.output_text, "it went on alone"

    events = list(sdk.responses.retrieve(response_id, stream=True))  # the whole stream again, through the SDK
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events][:3] == ["response.created", "response.queued", "response.in_progress"]
    assert events[-1].type == "response.incomplete" and events[-1].response.model_dump() == done.model_dump()
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == foreground.output_text
    assert [e.model_dump() for e in events[:len(first)]] == [
        e.model_dump() for e in sdk.responses.retrieve(response_id, stream=True, starting_after=-1)][:len(first)]
    rest = list(sdk.responses.retrieve(response_id, stream=True, starting_after=len(first) - 1))
    assert [e.model_dump() for e in rest] == [e.model_dump() for e in events[len(first):]]
    unstreamed = sdk.responses.create(**ask, background=True)
    _polled(sdk, unstreamed.id)
    with pytest.raises(openai.BadRequestError) as refused:
        list(sdk.responses.retrieve(unstreamed.id, stream=True))
    assert refused.value.body["param"] == "stream"


def test_a_cancelled_background_response_frees_its_sequence_and_stays_cancelled(sdk, tiny_lm_server):
    def running() -> float:
        return metric_total(tiny_lm_server, "vllm:num_requests_running", model_name="tiny")

    queued = sdk.responses.create(model="tiny", input="Tell me a long story", max_output_tokens=900, temperature=0,
                                  background=True)  # greedy: it runs its 900 tokens (no early end of text)
    eventually(lambda: running() == 1, "the background response's sequence to run", timeout_s=10)
    assert sdk.responses.retrieve(queued.id).status == "in_progress"
    with pytest.raises(openai.BadRequestError) as unfinished:
        sdk.responses.create(model="tiny", previous_response_id=queued.id, input="Hi", max_output_tokens=2)
    assert unfinished.value.body["param"] == "previous_response_id"
    cancelled = sdk.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.id == queued.id
    eventually(lambda: running() == 0, "the cancelled response's sequence to leave the engine")
    assert metric_total(tiny_lm_server, "sluice_background_responses_total", status="cancelled") >= 1
    assert metric_total(tiny_lm_server, "sluice_background_responses_running") == 0
    assert sdk.responses.cancel(queued.id).status == "cancelled"
    time.sleep(0.3)
    assert sdk.responses.retrieve(queued.id).status == "cancelled"


def test_a_background_response_survives_kill_9_of_its_server(tmp_path: Path):
    repo = write_tiny_lm_model(tmp_path / "models", "tiny")
    data_dir = str(tmp_path / "data")
    ask = dict(model="tiny", input="Tell me a story", max_output_tokens=300, temperature=0)
    server = start_server(repo, tmp_path, "--data-dir", data_dir)
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60) as sdk:
            with sdk.responses.create(**ask, background=True, stream=True) as opened:
                queued = next(iter(opened)).response  # streamed: the client goes away after the first event
            eventually(lambda: metric_total(server, "vllm:num_requests_running", model_name="tiny") == 1,
                       "the background response to be generating", timeout_s=10)
            time.sleep(0.3)  # some of its answer's events are stored before the kill
        workers = server.worker_pids()
        server.process.kill()  # SIGKILL: no drain, nothing written
        server.process.wait()
        eventually(lambda: not any(is_alive(pid) for pid in workers), "the killed server's workers to exit")
        server = start_server(repo, tmp_path, "--data-dir", data_dir)
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60,
                           default_headers={"Cache-Control": "no-cache"}) as sdk:
            done = _polled(sdk, queued.id, timeout_s=120)
            foreground = sdk.responses.create(**ask)
            with sdk.responses.stream(response_id=queued.id) as followed:  # both starts' events, accumulated
                events = list(followed)
        assert metric_total(server, "sluice_background_responses_taken_over_total") == 1
    finally:
        server.stop()
    assert done.status == "incomplete" and done.usage.output_tokens == 300
    assert done.output_text == foreground.output_text
    assert [e.type for e in events].count("response.in_progress") == 2, "the takeover started the answer again"
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1], "the earlier start's item (stored as it was announced), then the takeover's after it"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta" and e.output_index == added[1]) \
        == done.output_text
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == done.output_text


def test_a_conversation_and_its_items_are_kept_listed_and_deleted(sdk):
    conversation = sdk.conversations.create(
        items=[{"type": "message", "role": "user", "content": "Where is Oslo?"},
               {"role": "assistant", "content": [{"type": "output_text", "text": "In Norway."}]}],
        metadata={"topic": "maps"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "maps"}
    assert sdk.conversations.retrieve(conversation.id).model_dump() == conversation.model_dump()
    assert sdk.conversations.update(conversation.id, metadata={"topic": "cities"}).metadata == {"topic": "cities"}
    added = sdk.conversations.items.create(conversation.id, items=[
        {"type": "message", "role": "user", "content": "And Lima?"},
        {"type": "function_call", "call_id": "c1", "name": "find", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Peru"}])
    assert [item.type for item in added.data] == ["message", "function_call", "function_call_output"]
    oldest_first = sdk.conversations.items.list(conversation.id, order="asc")
    assert [(item.type, getattr(item, "role", None)) for item in oldest_first.data] == [
        ("message", "user"), ("message", "assistant"), ("message", "user"), ("function_call", None),
        ("function_call_output", None)]
    assert oldest_first.data[0].content[0].type == "input_text" and oldest_first.data[0].status == "completed"
    assert oldest_first.data[1].content[0].type == "output_text"
    newest = sdk.conversations.items.list(conversation.id, limit=2)  # newest first by default
    assert [item.id for item in newest.data] == [oldest_first.data[4].id, oldest_first.data[3].id]
    assert newest.has_more
    rest = sdk.conversations.items.list(conversation.id, limit=10, after=newest.data[-1].id)
    assert [item.id for item in rest.data] == [item.id for item in oldest_first.data[2::-1]] and not rest.has_more
    third = oldest_first.data[2]
    assert sdk.conversations.items.retrieve(third.id, conversation_id=conversation.id).model_dump() == \
        third.model_dump()
    assert sdk.conversations.items.delete(third.id, conversation_id=conversation.id).id == conversation.id
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.items.retrieve(third.id, conversation_id=conversation.id)
    assert len(sdk.conversations.items.list(conversation.id).data) == 4
    deleted = sdk.conversations.delete(conversation.id)
    assert deleted.deleted and deleted.id == conversation.id
    for gone in (lambda: sdk.conversations.retrieve(conversation.id),
                 lambda: sdk.conversations.items.list(conversation.id),
                 lambda: sdk.conversations.delete(conversation.id)):
        with pytest.raises(openai.NotFoundError):
            gone()


def test_a_response_in_a_conversation_answers_after_its_items_and_adds_to_them(sdk):
    conversation = sdk.conversations.create(items=[{"role": "user", "content": "Where is Oslo?"}])
    first = sdk.responses.create(model="tiny", conversation=conversation.id, input="And Lima?",
                                 max_output_tokens=6, temperature=0, store=False)
    asked = [{"role": "user", "content": "Where is Oslo?"}, {"role": "user", "content": "And Lima?"}]
    text, prompt_tokens, _ = _chat_text(sdk, asked, 6)
    assert first.output_text == text and first.usage.input_tokens == prompt_tokens
    assert first.conversation.id == conversation.id
    items = sdk.conversations.items.list(conversation.id, order="asc").data
    assert [(item.role, item.content[0].text) for item in items] == [
        ("user", "Where is Oslo?"), ("user", "And Lima?"), ("assistant", first.output_text)]
    assert items[2].id == first.output[0].id
    # streamed, naming it as an object: the answer follows all three, and joins them
    events = list(sdk.responses.create(model="tiny", conversation={"id": conversation.id}, input="Thanks",
                                       max_output_tokens=6, temperature=0, stream=True))
    second = events[-1].response
    text, _, _ = _chat_text(sdk, [*asked, {"role": "assistant", "content": first.output_text},
                                  {"role": "user", "content": "Thanks"}], 6)
    assert second.output_text == text and second.conversation.id == conversation.id
    assert [item.content[0].text for item in sdk.conversations.items.list(conversation.id, limit=2).data] == [
        second.output_text, "Thanks"]
    # in the background: run later, then joined the same way
    queued = sdk.responses.create(model="tiny", conversation=conversation.id, input="Bye", max_output_tokens=4,
                                  temperature=0, background=True)
    assert queued.conversation.id == conversation.id
    eventually(lambda: sdk.responses.retrieve(queued.id).status == "incomplete", "the background response")
    done = sdk.responses.retrieve(queued.id)  # (cut at max_output_tokens: an answer all the same)
    assert [item.content[0].text for item in sdk.conversations.items.list(conversation.id, limit=2).data] == [
        done.output_text, "Bye"]
    # what each answered after: the conversation as it was, then its input, in the foreground or not
    before_second = ["Where is Oslo?", "And Lima?", first.output_text, "Thanks"]
    for response, listed in ((second, before_second), (done, [*before_second, second.output_text, "Bye"])):
        items = sdk.responses.input_items.list(response.id, order="asc").data
        assert [item.content[0].text for item in items] == listed


def test_a_response_without_input_answers_its_conversations_items(sdk):
    conversation = sdk.conversations.create()
    sdk.conversations.items.create(conversation.id, items=[{"role": "user", "content": "Where is Oslo?"}])
    answer = sdk.responses.create(model="tiny", conversation=conversation.id, max_output_tokens=6, temperature=0)
    text, prompt_tokens, _ = _chat_text(sdk, [{"role": "user", "content": "Where is Oslo?"}], 6)
    assert answer.output_text == text and answer.usage.input_tokens == prompt_tokens
    assert [item.role for item in sdk.conversations.items.list(conversation.id, order="asc").data] == [
        "user", "assistant"], "only its answer joins the conversation"
    assert [item.content[0].text for item in sdk.responses.input_items.list(answer.id).data] == ["Where is Oslo?"]
    again = sdk.responses.create(model="tiny", previous_response_id=answer.id, max_output_tokens=6, temperature=0)
    assert again.usage.input_tokens > prompt_tokens + answer.usage.output_tokens, "it answered after both turns"
    for nothing in ({"conversation": sdk.conversations.create().id}, {}):  # nothing to answer: a 400 naming input
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(model="tiny", max_output_tokens=2, **nothing)
        assert refused.value.body["param"] == "input"


def test_an_item_whose_id_is_already_there_is_refused_as_openai_refuses_it(sdk):
    conversation = sdk.conversations.create(items=[{"id": "msg_a", "role": "user", "content": "Where is Oslo?"}])
    answer = sdk.responses.create(model="tiny", conversation=conversation.id, input="And Lima?", max_output_tokens=4,
                                  temperature=0)
    passed_back = answer.output[0].model_dump(exclude_none=True)
    again = [
        lambda: sdk.conversations.create(items=[{"id": "msg_b", "role": "user", "content": "x"}] * 2),
        lambda: sdk.conversations.items.create(conversation.id, items=[{"id": "msg_a", "role": "user",
                                                                         "content": "x"}]),
        lambda: sdk.responses.create(model="tiny", conversation=conversation.id, max_output_tokens=2,
                                     input=[passed_back, {"role": "user", "content": "Thanks"}]),
        lambda: sdk.responses.create(model="tiny", previous_response_id=answer.id, max_output_tokens=2,
                                     input=[passed_back, {"role": "user", "content": "Thanks"}]),
    ]
    for call in again:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.body["message"].startswith("Duplicate item found with id ")
        assert refused.value.body["param"] in ("items", "input")
    listed = sdk.conversations.items.list(conversation.id, order="asc").data
    assert [item.id for item in listed] == ["msg_a", listed[1].id, answer.output[0].id], "nothing added twice"
    followed = sdk.responses.create(model="tiny", previous_response_id=answer.id, max_output_tokens=2,
                                    input=[{"role": "user", "content": "Thanks"}])
    assert followed.status in ("completed", "incomplete"), "without the repeated item it is answered"


def test_conversations_refuse_what_they_cannot_keep(sdk, tiny_lm_server):
    conversation = sdk.conversations.create()
    refusals = [
        (lambda: sdk.responses.create(model="tiny", conversation="conv_nope", input="Hi", max_output_tokens=2),
         openai.NotFoundError, "conversation"),
        (lambda: sdk.responses.create(model="tiny", conversation=conversation.id, previous_response_id="resp_1",
                                      input="Hi", max_output_tokens=2), openai.BadRequestError, "conversation"),
        (lambda: sdk.responses.create(model="tiny", conversation={"name": "x"}, input="Hi", max_output_tokens=2),
         openai.BadRequestError, "conversation"),
        (lambda: sdk.conversations.items.create(conversation.id, items=[{"type": "image", "url": "x"}]),
         openai.BadRequestError, "items"),
        (lambda: sdk.conversations.items.create(conversation.id, items=[{"role": "robot", "content": "x"}]),
         openai.BadRequestError, "items"),
        (lambda: sdk.conversations.create(items=[{"type": ["message"], "role": "user", "content": "x"}]),
         openai.BadRequestError, "items"),  # a type that is not a string: was a 500
        (lambda: sdk.responses.create(model="tiny", conversation=conversation.id, input=[{"type": {"x": 1}}],
                                      max_output_tokens=2), openai.BadRequestError, "input"),
        (lambda: sdk.conversations.create(items=[{"role": "user", "content": "x"}] * 21),
         openai.BadRequestError, "items"),
        (lambda: sdk.conversations.create(metadata={"k" * 65: "v"}), openai.BadRequestError, "metadata"),
        (lambda: sdk.conversations.items.create("conv_nope", items=[{"role": "user", "content": "x"}]),
         openai.NotFoundError, None),
    ]
    for call, error, param in refusals:
        with pytest.raises(error) as refused:
            call()
        assert refused.value.body["param"] == param, refused.value.body
    assert sdk.conversations.items.list(conversation.id).data == []  # nothing half-added
    said = sdk.conversations.create(items=[{"role": "assistant", "content": "y"}])
    (part,) = sdk.conversations.items.list(said.id).data[0].content
    assert (part.type, part.text, part.annotations, part.logprobs) == ("output_text", "y", [], [])
    bad = httpx.post(f"{tiny_lm_server.url}/v1/conversations", content=b"{not json")
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
