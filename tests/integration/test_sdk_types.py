"""Every OpenAI-compatible answer of a real `sluice serve` validates against the `openai` SDK's own
pydantic types (`TheType.model_validate(body)`): the SDK itself parses leniently (`construct`), so
a field sluice omits or mistypes would only show when a user's code reads it. Unary bodies, each
streamed chunk or event, list pages and error envelopes are checked; where the SDK's type is
stricter than what OpenAI itself sends, a subclass of it loosens exactly that field, saying why."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import httpx
import numpy as np
import pytest
from openai.pagination import SyncCursorPage, SyncPage
from openai.types import (
    Batch,
    Completion,
    CreateEmbeddingResponse,
    ErrorObject,
    FileDeleted,
    FileObject,
    Model,
)
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import CompletionChoice, Logprobs
from openai.types.conversations import Conversation, ConversationDeletedResource, ConversationItem, ConversationItemList
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from sluice.gateway.tenants import hash_key, new_key
from tests.conftest import ServerProcess, start_server, write_emulated_model, write_tiny_lm_model

pytestmark = pytest.mark.slow

NO_CACHE = {"Cache-Control": "no-cache"}
STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
CONVERSATION_ITEM: TypeAdapter[Any] = TypeAdapter(ConversationItem)
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


# Where the SDK's type is stricter than what OpenAI itself sends, a subclass loosens exactly that field.


class EchoedLogprobs(Logprobs):
    # An echoed prompt's first token has no log-probability: OpenAI sends null for it (and vLLM,
    # and sluice); the SDK's `Logprobs` types the lists' entries as float and dict alone.
    token_logprobs: list[float | None] | None = None  # type: ignore[assignment]
    top_logprobs: list[dict[str, float] | None] | None = None  # type: ignore[assignment]


class EchoedChoice(CompletionChoice):
    logprobs: EchoedLogprobs | None = None  # type: ignore[assignment]


class EchoedCompletion(Completion):
    choices: list[EchoedChoice]  # type: ignore[assignment]


class StreamedChoice(CompletionChoice):
    # OpenAI streams `"finish_reason": null` until a choice ends; the SDK parses the legacy
    # completions' chunks as `Completion`, whose choices' finish_reason has no None.
    finish_reason: Literal["stop", "length", "content_filter"] | None  # type: ignore[assignment]


class StreamedCompletion(Completion):
    choices: list[StreamedChoice]  # type: ignore[assignment]


class EmptyResponseItemList(ResponseItemList):
    # An empty page (after its last item) has no first or last item to name: sluice says null, as
    # OpenAI's list pages do; the SDK types both ids as str alone, which nothing truthful fits.
    first_id: str | None  # type: ignore[assignment]
    last_id: str | None  # type: ignore[assignment]


class EmptyConversationItemList(ConversationItemList):
    first_id: str | None  # type: ignore[assignment]  # as EmptyResponseItemList
    last_id: str | None  # type: ignore[assignment]


def valid(model: type[BaseModel], body: Any) -> Any:
    """`model.model_validate(body)`, and strictly (JSON mode: a number sent as a string, which lax
    validation coerces, fails too), naming the body when it fails (pydantic's message shows only the field)."""
    try:
        model.model_validate_json(json.dumps(body), strict=True)
        return model.model_validate(body)
    except Exception as error:
        raise AssertionError(f"{model.__name__} rejects {json.dumps(body)[:2000]}:\n{error}") from None


def _members(union: Any) -> dict[str, type[BaseModel]]:
    """The members of a union of the SDK's types, by their `type` literal."""
    while get_origin(union) is Annotated:
        union = get_args(union)[0]
    return {get_args(member.model_fields["type"].annotation)[0]: member for member in get_args(union)}


def valid_as(adapter: TypeAdapter[Any], members: dict[str, type[BaseModel]], body: Any) -> Any:
    """`adapter.validate_python(body)`, and strictly as `valid`; when it fails, the failure of the
    member its `type` names (the union's own message lists every member's)."""
    try:
        adapter.validate_json(json.dumps(body), strict=True)
        return adapter.validate_python(body)
    except Exception:
        if body.get("type") not in members:
            raise AssertionError(f"no member of the union has type {body.get('type')!r}: {body}") from None
        valid(members[body["type"]], body)
        raise


def event_of(body: Any) -> Any:
    return valid_as(STREAM_EVENT, _members(ResponseStreamEvent), body)


def item_of(body: Any) -> Any:
    return valid_as(CONVERSATION_ITEM, _members(ConversationItem), body)


def valid_list(page: type[BaseModel], body: dict[str, Any]) -> list[Any]:
    """A list page, as the SDK's page type of it (`SyncPage[Model]`, `SyncCursorPage[FileObject]`),
    which validates its items; OpenAI's lists say `"object": "list"` (the cursor pages' type leaves it out)."""
    assert body["object"] == "list", body
    return list(valid(page, body).data)


def sse(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON payloads of a streamed answer's `data:` lines (not the closing `[DONE]`)."""
    assert response.status_code == 200, response.read()
    return [json.loads(line[len("data: "):]) for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def stream(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        return sse(response)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`tiny` (a random-weight Llama) and `emulated` (embeddings), with a data folder for files,
    batches and stored responses."""
    repo = write_tiny_lm_model(tmp_path_factory.mktemp("repo"), "tiny")
    write_emulated_model(repo, "emulated")
    log = tmp_path_factory.mktemp("log")
    started = start_server(repo, log, "--data-dir", str(log / "data"))
    yield started
    started.stop()


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{server.url}/v1", timeout=60, headers=NO_CACHE) as client:
        yield client


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


# -- models and embeddings ------------------------------------------------------------------------


def test_models_list_and_retrieve(http):
    models = valid_list(SyncPage[Model], ok(http.get("/models")))
    assert {m.id for m in models} == {"tiny", "emulated"}
    assert valid(Model, ok(http.get("/models/tiny"))).id == "tiny"


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_embeddings(http, encoding):
    body = ok(http.post("/embeddings", json={"model": "emulated", "input": ["a", "bc"], "encoding_format": encoding}))
    if encoding == "base64":
        # The SDK's `Embedding.embedding` is `List[float]` alone: OpenAI sends base64 as a string,
        # which the SDK decodes before it builds the type (`embeddings.create`), so decode it the same way.
        for entry in body["data"]:
            assert isinstance(entry["embedding"], str)
            entry["embedding"] = np.frombuffer(base64.b64decode(entry["embedding"]), dtype=np.float32).tolist()
    answer = valid(CreateEmbeddingResponse, body)
    assert [d.index for d in answer.data] == [0, 1] and answer.usage.prompt_tokens > 0
    assert [len(d.embedding) for d in answer.data] == [16, 16]


# -- completions and chat completions ---------------------------------------------------------------


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Where is Oslo?"}], "max_tokens": 6,
        "temperature": 0}
PROMPT = {"model": "tiny", "prompt": "Where is Oslo?", "max_tokens": 6, "temperature": 0}


def test_completions_unary_with_logprobs_echo_and_n(http):
    answer = valid(Completion, ok(http.post("/completions", json={**PROMPT, "logprobs": 2, "n": 2,
                                                                  "temperature": 0.9, "seed": 3})))
    assert len(answer.choices) == 2 and answer.usage.completion_tokens == 12
    assert all(len(c.logprobs.tokens) == 6 and len(c.logprobs.top_logprobs) == 6 for c in answer.choices)
    echoed = valid(EchoedCompletion, ok(http.post("/completions", json={**PROMPT, "echo": True, "logprobs": 1})))
    [choice] = echoed.choices
    assert choice.text.startswith("Where is Oslo?") and len(choice.logprobs.tokens) == 7 + 6
    assert choice.logprobs.token_logprobs[0] is None and None not in choice.logprobs.token_logprobs[1:]
    assert choice.logprobs.top_logprobs[0] is None and None not in choice.logprobs.top_logprobs[1:]


def test_completions_streamed_with_usage(http):
    chunks = stream(http, "/completions", {**PROMPT, "logprobs": 1, "n": 2, "temperature": 0.9,
                                           "stream_options": {"include_usage": True}})
    parsed = [valid(StreamedCompletion, chunk) for chunk in chunks]
    assert parsed[-1].choices == [] and parsed[-1].usage.completion_tokens == 12
    assert {c.index for p in parsed[:-1] for c in p.choices} == {0, 1}
    ended = [chunk for chunk in chunks if all(c["finish_reason"] for c in chunk["choices"])]
    assert len(ended) >= 2  # the chunks that end a choice, and the usage chunk, are Completions as they are
    for chunk in ended:
        valid(Completion, chunk)


def test_chat_unary_with_logprobs_and_n(http):
    answer = valid(ChatCompletion, ok(http.post("/chat/completions", json={
        **CHAT, "logprobs": True, "top_logprobs": 2, "n": 2, "temperature": 0.9, "seed": 3})))
    assert len(answer.choices) == 2 and answer.usage.completion_tokens == 12
    assert all(len(c.logprobs.content) == 6 for c in answer.choices)
    assert answer.choices[0].message.role == "assistant"


def test_chat_streamed_with_usage_and_logprobs(http):
    chunks = stream(http, "/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2, "n": 2,
                                                "temperature": 0.9, "stream_options": {"include_usage": True}})
    parsed = [valid(ChatCompletionChunk, chunk) for chunk in chunks]
    assert parsed[-1].choices == [] and parsed[-1].usage.completion_tokens == 12
    assert parsed[0].choices[0].delta.role == "assistant"
    choices = [c for p in parsed[:-1] for c in p.choices]
    assert sum(len(c.logprobs.content) for c in choices if c.logprobs) == 12 and {c.index for c in choices} == {0, 1}


def test_completions_of_several_prompts_and_a_json_schema_chat(http):
    several = valid(Completion, ok(http.post("/completions", json={**PROMPT, "prompt": ["Hi", "Bye"], "n": 2,
                                                                   "temperature": 0.9})))
    assert sorted(c.index for c in several.choices) == [0, 1, 2, 3]
    schema = {"type": "object", "properties": {"name": {"enum": ["Paris", "Oslo"]}}, "required": ["name"],
              "additionalProperties": False}
    answer = valid(ChatCompletion, ok(http.post("/chat/completions", json={
        **CHAT, "max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {
            "name": "city", "strict": True, "schema": schema}}})))
    assert json.loads(answer.choices[0].message.content)["name"] in ("Paris", "Oslo")


def test_chat_tool_calls_unary_and_streamed(http):
    body = {**CHAT, "max_tokens": 60, "tools": [{"type": "function", "function": WEATHER}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    answer = valid(ChatCompletion, ok(http.post("/chat/completions", json=body)))
    [call] = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    parsed = [valid(ChatCompletionChunk, chunk) for chunk in stream(http, "/chat/completions", body)]
    calls = [call for p in parsed for c in p.choices for call in c.delta.tool_calls or []]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert parsed[-1].choices[0].finish_reason == "tool_calls"


# -- responses and conversations --------------------------------------------------------------------


ASK = {"model": "tiny", "input": "Where is Oslo?", "max_output_tokens": 6, "temperature": 0}


def test_responses_unary_with_logprobs_and_input_items(http):
    response = valid(Response, ok(http.post("/responses", json={
        **ASK, "top_logprobs": 2, "include": ["message.output_text.logprobs"], "metadata": {"k": "v"}})))
    assert response.status == "incomplete" and response.usage.output_tokens == 6
    assert len(response.output[0].content[0].logprobs) == 6
    assert valid(Response, ok(http.get(f"/responses/{response.id}"))).id == response.id
    items = valid(ResponseItemList, ok(http.get(f"/responses/{response.id}/input_items")))
    assert items.data[0].type == "message"
    deleted = ok(http.delete(f"/responses/{response.id}"))  # the SDK's delete returns None: OpenAI's shape
    assert deleted == {"id": response.id, "object": "response", "deleted": True}


def test_responses_function_call_and_its_output(http):
    tool = {"type": "function", **WEATHER}
    called = valid(Response, ok(http.post("/responses", json={
        **ASK, "max_output_tokens": 60, "tools": [tool], "tool_choice": {"type": "function", "name": "get_weather"}})))
    [call] = called.output
    assert call.type == "function_call"
    followed = valid(Response, ok(http.post("/responses", json={
        **ASK, "tools": [tool], "tool_choice": "none", "previous_response_id": called.id,
        "input": [{"type": "function_call_output", "call_id": call.call_id, "output": "12 C"}]})))
    items = valid(ResponseItemList, ok(http.get(f"/responses/{followed.id}/input_items", params={"order": "asc"})))
    assert [item.type for item in items.data] == ["message", "function_call", "function_call_output"]


@pytest.mark.parametrize("extra", [
    {},
    {"top_logprobs": 2, "include": ["message.output_text.logprobs"]},
    {"max_output_tokens": 60, "tools": [{"type": "function", **WEATHER}],
     "tool_choice": {"type": "function", "name": "get_weather"}},
    {"max_output_tokens": 60, "text": {"format": {
        "type": "json_schema", "name": "city", "strict": True,
        "schema": {"type": "object", "properties": {"name": {"enum": ["Paris", "Oslo"]}},
                   "required": ["name"], "additionalProperties": False}}}},
], ids=["text", "logprobs", "function", "json_schema"])
def test_responses_streamed_events(http, extra):
    events = [event_of(event) for event in stream(http, "/responses", {**ASK, **extra})]
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_in_the_background_retrieved_and_cancelled(http):
    queued = valid(Response, ok(http.post("/responses", json={**ASK, "background": True})))
    assert queued.status in ("queued", "in_progress")
    deadline = time.monotonic() + 60
    while (done := valid(Response, ok(http.get(f"/responses/{queued.id}")))).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert done.status == "incomplete" and done.usage.output_tokens == 6
    long = valid(Response, ok(http.post("/responses", json={**ASK, "max_output_tokens": 900, "background": True})))
    cancelled = valid(Response, ok(http.post(f"/responses/{long.id}/cancel")))
    assert cancelled.status == "cancelled"
    streamed = [event_of(event) for event in stream(http, "/responses", {**ASK, "background": True})]
    assert streamed[0].type == "response.created" and streamed[0].response.status == "queued"
    with http.stream("GET", f"/responses/{streamed[0].response.id}", params={"stream": "true"}) as replay:
        events = [event_of(event) for event in sse(replay)]
    assert [e.type for e in events] == [e.type for e in streamed] and events[-1].type == "response.incomplete"


def test_conversations_and_their_items(http):
    conversation = valid(Conversation, ok(http.post("/conversations", json={
        "metadata": {"topic": "x"}, "items": [{"role": "user", "content": "Where is Oslo?"}]})))
    assert valid(Conversation, ok(http.get(f"/conversations/{conversation.id}"))).metadata == {"topic": "x"}
    valid(Conversation, ok(http.post(f"/conversations/{conversation.id}", json={"metadata": {"topic": "y"}})))
    response = valid(Response, ok(http.post("/responses", json={**ASK, "input": "And Lima?",
                                                                 "conversation": conversation.id})))
    assert response.conversation.id == conversation.id
    added = valid(ConversationItemList, ok(http.post(f"/conversations/{conversation.id}/items", json={
        "items": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks"}]}]})))
    listed = valid(ConversationItemList, ok(http.get(f"/conversations/{conversation.id}/items",
                                                     params={"order": "asc"})))
    assert [item.type for item in listed.data] == ["message"] * 4
    item = item_of(ok(http.get(f"/conversations/{conversation.id}/items/{added.data[0].id}")))
    assert item.id == added.data[0].id
    valid(Conversation, ok(http.delete(f"/conversations/{conversation.id}/items/{item.id}")))
    gone = valid(ConversationDeletedResource, ok(http.delete(f"/conversations/{conversation.id}")))
    assert gone.deleted and gone.id == conversation.id


def test_an_empty_page_of_items_names_no_first_or_last(http):
    response = valid(Response, ok(http.post("/responses", json=ASK)))
    [item] = valid(ResponseItemList, ok(http.get(f"/responses/{response.id}/input_items"))).data
    after = ok(http.get(f"/responses/{response.id}/input_items", params={"after": item.id}))
    assert after["data"] == [] and after["first_id"] is None and after["last_id"] is None
    valid(EmptyResponseItemList, after)
    conversation = valid(Conversation, ok(http.post("/conversations", json={})))
    empty = ok(http.get(f"/conversations/{conversation.id}/items"))
    assert empty["data"] == [] and empty["first_id"] is None and empty["last_id"] is None
    valid(EmptyConversationItemList, empty)


# -- prompt caching ------------------------------------------------------------------------------------


def test_the_prompt_tokens_a_request_writes_to_the_prefix_cache_are_what_the_next_one_reads(http):
    """`cache_write_tokens` (Responses: required by the SDK's `ResponseUsage`; chat and completions:
    `prompt_tokens_details`): the prompt tokens whose full blocks the request computed and cached,
    which the same prompt next finds cached (its last token is always computed: a prompt of whole
    blocks would find one fewer)."""
    def asked(path: str, body: dict[str, Any]) -> tuple[int, int, int]:
        answer = ok(http.post(path, json=body))
        if path == "/responses":
            usage = valid(Response, answer).usage
            return usage.input_tokens, usage.input_tokens_details.cached_tokens, \
                usage.input_tokens_details.cache_write_tokens
        details = valid(Completion if path == "/completions" else ChatCompletion, answer).usage.prompt_tokens_details
        return answer["usage"]["prompt_tokens"], details.cached_tokens, details.cache_write_tokens

    text = "A long system prompt that every request of this test starts with, for its cache. " * 3
    for path, body in (("/responses", {**ASK, "input": "Responses: " + text}),  # as chat's, so not the same text
                       ("/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "Chat: " + text}]}),
                       ("/completions", {**PROMPT, "prompt": text + "!"})):
        num_prompt, cached, written = asked(path, body)
        assert cached == 0 and 0 < written <= num_prompt, (path, num_prompt, cached, written)
        assert num_prompt % 16 != 0  # not whole blocks (sluice's default block size): all it wrote is read
        assert asked(path, body) == (num_prompt, written, 0), path


# -- files and batches --------------------------------------------------------------------------------


def test_files_and_batches(http):
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": "emulated", "input": f"item {i}"}} for i in range(3)]
    content = b"".join(json.dumps(row).encode() + b"\n" for row in rows)
    uploaded = valid(FileObject, ok(http.post("/files", files={"file": ("in.jsonl", content)},
                                              data={"purpose": "batch"})))
    assert valid(FileObject, ok(http.get(f"/files/{uploaded.id}"))).filename == "in.jsonl"
    assert [f.id for f in valid_list(SyncCursorPage[FileObject], ok(http.get("/files")))] == [uploaded.id]
    batch = valid(Batch, ok(http.post("/batches", json={"input_file_id": uploaded.id, "endpoint": "/v1/embeddings",
                                                        "completion_window": "24h", "metadata": {"a": "b"}})))
    deadline = time.monotonic() + 60
    while (done := valid(Batch, ok(http.get(f"/batches/{batch.id}")))).status not in ("completed", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert done.status == "completed" and done.request_counts.completed == 3
    assert [b.id for b in valid_list(SyncCursorPage[Batch], ok(http.get("/batches")))] == [batch.id]
    again = valid(Batch, ok(http.post("/batches", json={"input_file_id": uploaded.id, "endpoint": "/v1/embeddings",
                                                        "completion_window": "24h"})))
    assert valid(Batch, ok(http.post(f"/batches/{again.id}/cancel"))).status in ("cancelling", "cancelled",
                                                                               "completed")
    output = valid(FileObject, ok(http.get(f"/files/{done.output_file_id}")))
    assert output.purpose == "batch_output"
    assert valid(FileDeleted, ok(http.delete(f"/files/{uploaded.id}"))).deleted


def _finished(http: httpx.Client, batch_id: str) -> Batch:
    deadline = time.monotonic() + 60
    while (batch := valid(Batch, ok(http.get(f"/batches/{batch_id}")))).status not in (
            "completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return batch


@pytest.mark.parametrize(("endpoint", "body", "answer"), [
    ("/v1/completions", PROMPT, Completion),
    ("/v1/chat/completions", CHAT, ChatCompletion),
    ("/v1/responses", {**ASK, "store": False}, Response),
])
def test_a_batchs_output_lines_are_each_endpoints_answers(http, endpoint, body, answer):
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": endpoint, "body": body} for i in range(2)]
    content = b"".join(json.dumps(row).encode() + b"\n" for row in rows)
    uploaded = valid(FileObject, ok(http.post("/files", files={"file": ("in.jsonl", content)},
                                              data={"purpose": "batch"})))
    done = _finished(http, valid(Batch, ok(http.post("/batches", json={
        "input_file_id": uploaded.id, "endpoint": endpoint, "completion_window": "24h"}))).id)
    assert done.status == "completed" and done.usage.output_tokens == 12, done
    lines = http.get(f"/files/{done.output_file_id}/content").text.splitlines()
    for line in lines:
        row = json.loads(line)
        assert row["response"]["status_code"] == 200 and row["error"] is None
        valid(answer, row["response"]["body"])
    assert len(lines) == 2


def test_a_failed_batchs_errors(http):
    content = b"not json\n" + json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/embeddings",
                                          "body": {"input": "x"}}).encode() + b"\n"
    uploaded = valid(FileObject, ok(http.post("/files", files={"file": ("bad.jsonl", content)},
                                              data={"purpose": "batch"})))
    failed = _finished(http, valid(Batch, ok(http.post("/batches", json={
        "input_file_id": uploaded.id, "endpoint": "/v1/embeddings", "completion_window": "24h"}))).id)
    assert failed.status == "failed" and [(e.line, e.code) for e in failed.errors.data] == [
        (1, "invalid_json"), (2, "missing_model")]


# -- error envelopes ------------------------------------------------------------------------------------


def error_of(response: httpx.Response, status: int) -> ErrorObject:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = valid(ErrorObject, body["error"])
    assert set(body["error"]) >= {"message", "type", "param", "code"} and error.message
    return error


def test_400_and_404_envelopes(http):
    error_of(http.post("/chat/completions", json={**CHAT, "max_tokens": -1}), 400)
    error_of(http.post("/completions", json={**PROMPT, "prompt": list(range(5, 1100))}), 400)
    error_of(http.post("/responses", json={**ASK, "background": True, "store": False}), 400)
    error_of(http.post("/embeddings", json={"model": "emulated", "input": []}), 400)
    error_of(http.post("/batches", json={"input_file_id": "file-nope", "endpoint": "/v1/embeddings",
                                         "completion_window": "24h"}), 404)
    for path in ("/models/nope", "/responses/resp_nope", "/conversations/conv_nope", "/files/file-nope",
                 "/batches/batch_nope"):
        error_of(http.get(path), 404)
    error_of(http.post("/chat/completions", json={**CHAT, "model": "nope"}), 404)


UNFOLLOWABLE = {"type": "json_schema", "name": "code", "schema": {"type": "string", "pattern": "^(ab )+a{1000000}$"}}
"""As in test_responses.py: followed for a few tokens, then given up on mid-stream."""


def test_a_mid_stream_error_event_and_a_failed_background_response(http):
    body = {**ASK, "input": "Hi", "max_output_tokens": 40, "text": {"format": UNFOLLOWABLE}}
    events = [event_of(event) for event in stream(http, "/responses", body)]
    assert events[-1].type == "error"
    queued = valid(Response, ok(http.post("/responses", json={**body, "background": True})))
    deadline = time.monotonic() + 60
    while (failed := valid(Response, ok(http.get(f"/responses/{queued.id}")))).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert failed.status == "failed" and failed.error.message
    chunks = stream(http, "/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "Hi"}],
                                                "max_tokens": 40, "response_format": {
                                                    "type": "json_schema", "json_schema": {
                                                        k: v for k, v in UNFOLLOWABLE.items() if k != "type"}}})
    for chunk in chunks[:-1]:
        valid(ChatCompletionChunk, chunk)
    assert set(chunks[-1]) == {"error"}  # as OpenAI's streams end in error: the envelope alone
    assert valid(ErrorObject, chunks[-1]["error"]).message


KEY, LIMITED = new_key(), new_key()


def test_401_and_429_envelopes(tmp_path: Path):
    repo = write_emulated_model(tmp_path / "repo", "emulated")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.a]\napi_keys = ["{hash_key(KEY)}"]\n'
                       f'[tenants.b]\napi_keys = ["{hash_key(LIMITED)}"]\nrequests_per_min = 1\n')
    started = start_server(repo, tmp_path, "--tenants", str(tenants))
    try:
        body = {"model": "emulated", "input": "hi"}
        url = f"{started.url}/v1/embeddings"
        error_of(httpx.post(url, json=body), 401)
        error_of(httpx.post(url, json=body, headers={"Authorization": "Bearer sk-wrong"}), 401)
        limited = {"Authorization": f"Bearer {LIMITED}"}
        assert httpx.post(url, json=body, headers=limited).status_code == 200
        error_of(httpx.post(url, json=body, headers=limited), 429)
    finally:
        started.stop()
