"""OpenAI's Responses API for generative models: `POST /v1/responses`.

    body ─▶ ResponsesRequest ─▶ the chat request it means ─▶ GeneratePayload ─▶ gateway.generate
         ─▶ a `response` object (stream: false), or its typed events (stream: true)

A Responses request is read as the chat request it means: `instructions` is a system message,
`input` (a string, or items: messages, `function_call`s and their `function_call_output`s) the
messages, function `tools` and `tool_choice` the chat's, `text.format` its `response_format`,
`max_output_tokens` its `max_completion_tokens`. So sampling, structured outputs, tool calls, the
context checks and the tenant's limits are the chat endpoint's (`api.completion_params`), and the
answer is the chat answer in the Responses shape: a `message` item holding the `output_text`,
and a `function_call` item per call.

Streamed, it is Responses' events, each an SSE `event:` line and a `data:` line with its `type`
and `sequence_number` (no `[DONE]`): `response.created`, `response.in_progress`; per item
`response.output_item.added`, for a message `response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`, for a
call `response.function_call_arguments.delta`/`.done`, then `response.output_item.done`; and
`response.completed`, or `response.incomplete` when `max_output_tokens` cut the answer. An error
found before the first byte is an HTTP status in OpenAI's envelope; after it, an `error` event.
A client that disconnects withdraws its sequence, as on the chat endpoint.

Stored, unless the request says `store: false`: each finished response is kept in the job store
(SQLite embedded, PostgreSQL shared by a cluster's gateways) with the conversation's items it
answered, for its tenant only, for `retention_s` (30 days, as OpenAI keeps them). A request with
`previous_response_id` continues that conversation (its items, then that response's output, then
the new `input`; instructions are not carried over, as at OpenAI); `GET /v1/responses/{id}`,
`DELETE` and `GET .../input_items` read and forget them. `include:
["message.output_text.logprobs"]` (with `top_logprobs: k`) puts the tokens' log-probabilities in
the output text and its deltas, as chat's `logprobs` reports them. A request with `conversation`
(`api.conversations`) answers after that conversation's items instead, and adds its input and its
output to them once answered (whether or not the response itself is stored). A reasoning
model's thoughts (its `reasoning_parser`: `sluice.reasoning`) come first, as a `reasoning` output
item with their `reasoning_text` (streamed as `response.reasoning_text.delta` events).

Background (`background: true`): validated as any request, then stored `queued` with its run and
answered at once; `jobs.background` runs it (the same request in the foreground, through the app)
and writes its end, which `GET` polls; `POST .../cancel` ends it. With `stream`, the answer is its
events as `jobs.background` keeps them, which `GET ...?stream=true&starting_after=N` reads again
from any gateway. What cannot be served is refused with a 400 rather than ignored: image, file and
audio inputs, built-in tools (web search, file search, ...), `reasoning`
summaries (and `reasoning.effort` for a model whose chat template does not take it, as the chat
endpoint refuses `reasoning_effort`), `truncation: "auto"`, other `include`d extras.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Scope

from sluice import wire
from sluice.api.common import (
    BACKGROUND_SCOPE_KEY,
    PRIORITY_HEADER,
    ROUTE_KEY_HEADER,
    TIMEOUT_HEADER,
    VERSION_HEADER,
    arrival,
    caller,
    decode_json,
    header_timeout_s,
    items_page,
    json_response,
    read_body,
    request_tenant,
    requested_priority,
    stream_failed,
    trace_context,
    with_version,
)
from sluice.api.completion_params import (
    ChatMessageIn,
    ChatRequest,
    JsonSchemaFormat,
    ResponseFormat,
    ToolCallFunctionIn,
    ToolCallIn,
    chat_tools,
    check_metadata,
    estimate_tokens,
    to_payloads,
)
from sluice.api.completion_shapes import ResponseShape
from sluice.api.completions import (
    SSE_HEADERS,
    Events,
    final_result,
    renamed,
    resolve_generative,
    unless_disconnected,
)
from sluice.api.conversations import (
    Conversations,
    conversation_items,
    listed_item,
    new_item_id,
    refuse_duplicate_ids,
)
from sluice.api.errors import error_body
from sluice.api.tool_calls import ChosenFunction, FunctionDef, NamedToolChoice, ToolDef, ToolPlan
from sluice.errors import InvalidInput, NotFound, SluiceError
from sluice.gateway import Gateway
from sluice.jobs.store import RUNNING, JobStore, RunRequest, StoredResponse
from sluice.reasoning import request_parser, thought_token_count

if TYPE_CHECKING:
    from sluice.jobs.background import BackgroundResponses

log = logging.getLogger("sluice.api")

RETENTION_S = 30 * 86_400
"""How long a stored response is kept (OpenAI keeps them 30 days)."""
MAX_ITEMS_PAGE = 100
NOT_STORED = ("responses are not stored by this server (it has no job store): send the conversation's items in "
              "'input' instead")
TEXT_PART_TYPES = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
               "logprobs": "include", "reasoning_effort": "reasoning"}
"""The chat request's fields that errors name, as the Responses request calls them."""
RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
"""The fields that the model's own refusals name (a prompt too long for its context, a chat
template that fails, a JSON schema that cannot be compiled or followed), as the Responses request
calls them."""
PASSED_HEADERS = (PRIORITY_HEADER, TIMEOUT_HEADER, VERSION_HEADER, ROUTE_KEY_HEADER, "cache-control")
"""A background request's headers that it runs with."""


class TextFormat(msgspec.Struct):
    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextOptions(msgspec.Struct):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[Any] = msgspec.field(default_factory=list)
    """Optional, as OpenAI's: a response may answer a conversation's or a previous response's items alone."""
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # accepted: prefix caching needs no key here
    cache_salt: str | None = None  # vLLM's: as on chat completions
    service_tier: str | None = None
    priority: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    stream_options: dict[str, Any] | None = None


def routes(gateway: Gateway, body_limit_bytes: int, store: JobStore | None = None,
           background: BackgroundResponses | None = None, retention_s: int = RETENTION_S) -> list[Route]:
    """`store`: where responses are kept (None: nowhere, every answer says `store: false`);
    `background`: what runs background responses (None: they are refused)."""
    responses = Responses(store, background, retention_s, gateway.max_timeout_s)
    conversations = Conversations(store)

    async def create(request: Request) -> Response:
        return await _serve(gateway, request, body_limit_bytes, responses, conversations)

    async def retrieve(request: Request) -> Response:
        if request.query_params.get("stream", "false").lower() != "false":
            return await responses.resume(request)
        found = await responses.get(request)
        return Response(found.body, media_type="application/json")

    async def delete(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if responses.store is None or not await responses.store.delete_response(request_tenant(request), response_id):
            raise responses.not_found(response_id)
        if responses.background is not None:
            responses.background.stop(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def input_items(request: Request) -> Response:
        items = [listed_item(item) for item in msgspec.json.decode((await responses.get(request)).input_items)]
        return items_page(items, request.query_params, MAX_ITEMS_PAGE, "input item", "this response")

    async def cancel(request: Request) -> Response:
        return await responses.cancel(request)

    return [
        Route("/v1/responses", create, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
    ]


class Responses:
    """Stored responses: kept, found, and forgotten once their retention is over."""

    def __init__(self, store: JobStore | None, background: BackgroundResponses | None, retention_s: int,
                 background_timeout_s: float) -> None:
        self.store = store
        self.background = background if store is not None else None
        self.retention_s = retention_s
        self.background_timeout_s = background_timeout_s
        """A background request's deadline when its client gave none (the gateway's longest)."""

    def not_found(self, response_id: str) -> NotFound:
        return NotFound(f"no response {response_id[:80]!r}" + ("" if self.store is not None else f": {NOT_STORED}"))

    async def get(self, request: Request) -> StoredResponse:
        response_id = request.path_params["response_id"]
        found = None if self.store is None else await self.store.get_response(request_tenant(request), response_id)
        if found is None:
            raise self.not_found(response_id)
        return found

    async def history(self, owner: str, response_id: str) -> list[Any]:
        """The conversation `response_id` answered, and its answer, as input items."""
        if self.store is None:
            raise InvalidInput(NOT_STORED, param="previous_response_id")
        found = await self.store.get_response(owner, response_id)
        if found is None:
            raise NotFound(f"no previous response {response_id[:80]!r} (it was deleted, is older than "
                           f"{self.retention_s // 86_400} days, was not stored, or is another tenant's)",
                           param="previous_response_id")
        previous = msgspec.json.decode(found.body)
        if previous["status"] not in ("completed", "incomplete"):
            raise InvalidInput(f"previous response {response_id[:80]!r} has no answer to continue from: it is "
                               f"{previous['status']}", param="previous_response_id")
        return [*msgspec.json.decode(found.input_items), *previous["output"]]

    async def keep(self, owner: str, response: dict[str, Any], items: list[Any]) -> None:
        assert self.store is not None
        await self.store.put_response(owner, response["id"], response["created_at"], msgspec.json.encode(response),
                                      msgspec.json.encode(items))

    async def cancel(self, request: Request) -> Response:
        """End a background response that is queued or in progress (`cancelled`); one that has
        ended already is answered as it is."""
        found = await self.get(request)
        response = msgspec.json.decode(found.body)
        if not response.get("background"):
            raise InvalidInput("only background responses can be cancelled: this one was answered when it was "
                               "created", param="response_id")
        if response["status"] in RUNNING:
            assert self.store is not None  # it was found in the store
            cancelled = {**response, "status": "cancelled"}
            if await self.store.cancel_response_run(request_tenant(request), response["id"],
                                                    msgspec.json.encode(cancelled)):
                if self.background is not None:  # else the gateway running it stops it at its next renewal
                    self.background.cancelled(response["id"])
                return json_response(cancelled)
            found = await self.get(request)  # it ended meanwhile
        return Response(found.body, media_type="application/json")

    async def run_later(self, owner: str, shape: ResponsesShape, request: ResponsesRequest, items: list[Any],
                        input_items: list[Any], headers: Mapping[str, str], is_batch_item: bool) -> Response:
        """Store a background response, queued, and answer that; it runs in `self.background` with
        `items` as its input (in a conversation, the new ones: it reads the conversation when it
        runs). `input_items`: what `GET .../input_items` lists, as for a response in the foreground
        (a conversation's items as they are now, then the new ones)."""
        if self.background is None:
            raise InvalidInput(NOT_STORED if self.store is None else "background responses are not run by this "
                               "server", param="background")
        if is_batch_item:
            raise InvalidInput("a batch job's item runs in the background already: leave 'background' out",
                               param="background")
        if request.store is False:
            raise InvalidInput("a background response must be stored: 'store' cannot be false", param="store")
        is_streamed = bool(request.stream)
        foreground = msgspec.structs.replace(request, background=False, store=False, stream=is_streamed,
                                             input=items, previous_response_id=None, stream_options=None)
        queued = shape.response("queued")
        passed = [(name, headers[name]) for name in PASSED_HEADERS if name in headers]
        if TIMEOUT_HEADER not in headers:  # a background response may take its time
            passed.append((TIMEOUT_HEADER, str(int(self.background_timeout_s * 1000))))
        await self.background.submit(owner, shape.id, shape.created_at, RunRequest(
            msgspec.json.encode(foreground), passed, msgspec.json.encode(queued), is_streamed),
            msgspec.json.encode(input_items))
        if not is_streamed:
            return json_response(queued)
        return StreamingResponse(self.background.follow(owner, shape.id, -1), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def resume(self, request: Request) -> Response:
        """`GET /v1/responses/{id}?stream=true[&starting_after=N]`: a streamed background
        response's events after sequence number N (all of them without it), then the rest as they come."""
        raw = request.query_params.get("starting_after", "-1")
        try:
            after = int(raw)
        except ValueError:
            raise InvalidInput(f"'starting_after' must be an event's sequence number, got {raw[:40]!r}",
                               param="starting_after") from None
        response_id = request.path_params["response_id"]
        owner = request_tenant(request)
        found = await self.get(request)
        assert self.store is not None  # it was found in the store
        if self.background is None or not await self.store.response_events(owner, response_id, -1, 1):
            how = ("was created without 'stream'" if msgspec.json.decode(found.body).get("background")
                   else "was not in the background")
            raise InvalidInput(f"only a background response created with 'stream' can be streamed again: this one "
                               f"{how}; poll it without 'stream'", param="stream")
        return StreamingResponse(self.background.follow(owner, response_id, max(after, -1)),
                                 media_type="text/event-stream", headers=SSE_HEADERS)


async def _serve(gateway: Gateway, request: Request, body_limit_bytes: int, responses: Responses,
                 conversations: Conversations) -> Response:
    arrived_at = arrival(request, gateway.now())
    timeout_s = header_timeout_s(request, gateway.max_timeout_s)
    body = await read_body(request, body_limit_bytes)
    parsed = decode_json(body, ResponsesRequest)
    _refuse_unsupported(parsed)
    conversation_id = _conversation_id(parsed)
    info = resolve_generative(gateway, parsed.model, request, parsed.user)
    owner = request_tenant(request)
    with gateway.reading(info, owner, arrived_at, trace_context(request) if gateway.is_tracing else None):
        new_items = items = _items(parsed.input)
        if parsed.previous_response_id is not None:
            items = [*await responses.history(owner, parsed.previous_response_id), *items]
        elif conversation_id is not None:
            items = [*await conversations.items_of(owner, conversation_id, param="conversation"), *items]
        refuse_duplicate_ids(items[:len(items) - len(new_items)], new_items, "input")
        joining = conversation_items(new_items, "input") if conversation_id is not None else []
        chat = chat_request_of(parsed, items)
        try:
            [payload] = to_payloads(chat, info)
            plan = chat_tools(chat, info)[2]
        except InvalidInput as exc:
            raise _as_responses_error(exc) from exc
        priority = requested_priority(request, ("service_tier", parsed.service_tier), ("priority", parsed.priority))
    is_stored = responses.store is not None and parsed.store is not False
    shape = ResponsesShape(parsed, info.name, payload, plan, is_stored,
                           reasoning=request_parser(info.reasoning_parser, payload))
    if parsed.background:
        return await responses.run_later(owner, shape, parsed, new_items if conversation_id else items, items,
                                         request.headers, request.scope.get(BACKGROUND_SCOPE_KEY, False) is True)
    limit_headers: dict[str, str] | None = {} if payload.stream else None
    stream = gateway.generate(info, payload, timeout_s, arrived_at=arrived_at,
                              caller=caller(request, priority, estimate_tokens(payload, info.max_model_len),
                                            is_traced=True,  # for an upstream call, as completions'
                                            likely_tokens=estimate_tokens(payload, info.max_model_len, likely=True)),
                              limit_headers=limit_headers)

    async def keep(response: dict[str, Any]) -> None:
        if is_stored:
            await responses.keep(owner, response, items)
        if conversation_id is not None:  # its input and its output join the conversation
            try:
                await conversations.append(owner, conversation_id, [*joining, *response["output"]])
            except NotFound:  # deleted while this was answered: the answer is the client's all the same
                log.info("response %s: its conversation %s was deleted before it was answered", response["id"],
                         conversation_id)

    if not payload.stream:
        result = await renamed(RESPONSES_PARAMS, unless_disconnected(request, [stream], final_result(stream)))
        assert isinstance(result.payload, wire.GenerationResult)
        answer = shape.whole(result.payload)
        await keep(answer)
        return json_response(answer, headers=with_version(info, result.headers))
    # errors before the first byte: a status
    first = await renamed(RESPONSES_PARAMS, unless_disconnected(request, [stream], anext(stream)))
    return StreamingResponse(_events(shape, first, stream, keep, request.scope), media_type="text/event-stream",
                             headers=with_version(info, {**SSE_HEADERS, **(limit_headers or {})}))


def _refuse_unsupported(request: ResponsesRequest) -> None:
    refused: list[tuple[bool, str, str]] = [
        (request.conversation is not None and request.previous_response_id is not None, "conversation",
         "'conversation' and 'previous_response_id' cannot both be given: a response continues one or the other"),
        (request.prompt is not None, "prompt", "stored prompt templates are not supported"),
        (request.reasoning is not None and any(v is not None for k, v in request.reasoning.items() if k != "effort"),
         "reasoning", "only reasoning 'effort' is supported (for a model whose chat template takes it): no reasoning "
                      "summaries are made"),
        (request.truncation not in (None, "disabled"), "truncation",
         "only truncation 'disabled' is supported: an input too long for the context is refused"),
        (any(extra != LOGPROBS_INCLUDE for extra in request.include or []), "include",
         f"only {LOGPROBS_INCLUDE!r} can be included (reasoning, search results and images are not served here)"),
        (request.max_tool_calls is not None, "max_tool_calls", "max_tool_calls is not supported; "
                                                               "parallel_tool_calls false allows one call"),
        (request.text is not None and request.text.verbosity not in (None, "medium"), "text.verbosity",
         "only verbosity 'medium' is supported"),
    ]
    for is_refused, param, message in refused:
        if is_refused:
            raise InvalidInput(message, param=param)
    check_metadata(request.metadata)


def _conversation_id(request: ResponsesRequest) -> str | None:
    """The conversation a request continues: `conversation` as its id, or `{"id": ...}`."""
    given = request.conversation
    if isinstance(given, dict):
        given = given.get("id")
    if given is None and request.conversation is None:
        return None
    if not isinstance(given, str) or not given:
        raise InvalidInput("'conversation' must be a conversation's id, or an object with its 'id'",
                           param="conversation")
    return given


def _items(given: str | list[Any]) -> list[Any]:
    """A request's `input` as items (a string is one user message), each with an id (for `input_items`)."""
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given, "id": new_item_id("message")}]
    return [{**item, "id": item.get("id") or new_item_id(item.get("type", "message"))} if isinstance(item, dict)
            else item for item in given]


def chat_request_of(request: ResponsesRequest, items: list[Any]) -> ChatRequest:
    """The chat request a Responses request means (see the module's docstring), given the
    conversation's items (its predecessors' and its `input`)."""
    messages = [ChatMessageIn("system", request.instructions)] if request.instructions else []
    messages += _messages(items)
    wants_logprobs = LOGPROBS_INCLUDE in (request.include or []) or request.top_logprobs is not None
    return ChatRequest(
        model=request.model, messages=messages, max_completion_tokens=request.max_output_tokens,
        logprobs=True if wants_logprobs else None, top_logprobs=request.top_logprobs,
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
        seed=request.seed, repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
        stream=request.stream, user=request.user, service_tier=request.service_tier, priority=request.priority,
        tools=[_tool(tool) for tool in request.tools] if request.tools else None,
        tool_choice=_tool_choice(request.tool_choice), parallel_tool_calls=request.parallel_tool_calls,
        response_format=_response_format(request.text.format if request.text else None),
        reasoning_effort=_effort(request), cache_salt=request.cache_salt,
    )


def _effort(request: ResponsesRequest) -> str | None:
    effort = (request.reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise InvalidInput("'reasoning.effort' must be a string", param="reasoning")
    return effort


def _messages(given: list[Any]) -> list[ChatMessageIn]:
    messages: list[ChatMessageIn] = []
    call_ids: set[str] = set()  # of the function calls so far: an output answers one of them
    thought: str | None = None  # a reasoning item's, for the assistant turn that follows it
    for item in given:
        if not isinstance(item, dict):
            raise InvalidInput("each 'input' item must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidInput(f"an input message's role must be user, system, developer or assistant, got "
                                   f"{str(role)[:40]!r}", param="input")
            text = _text(item.get("content"), "an input message's 'content'")
            messages.append(ChatMessageIn(role, text, reasoning=thought if role == "assistant" else None))
            thought = None
        elif kind == "function_call":
            call = ToolCallIn(_string(item, "call_id"), ToolCallFunctionIn(_string(item, "name"),
                                                                            _string(item, "arguments")))
            call_ids.add(call.id)
            if messages and messages[-1].role == "assistant" and thought is None:  # one turn: its text and calls
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
            else:
                messages.append(ChatMessageIn("assistant", None, tool_calls=[call], reasoning=thought))
            thought = None
        elif kind == "function_call_output":
            call_id = _string(item, "call_id")
            if call_id not in call_ids:
                raise InvalidInput(f"no function call found for the function_call_output with call_id "
                                   f"{call_id[:64]!r}", param="input")
            messages.append(ChatMessageIn("tool", _text(item.get("output"), "a function_call_output's 'output'"),
                                          tool_call_id=call_id))
        elif kind == "reasoning":  # an earlier response's thoughts, passed back: the next assistant turn's, for
            thought = _reasoning_text(item) or None  # a template that shows them (Qwen3's, in a tool loop)
        else:
            raise InvalidInput(f"input items of type {str(kind)[:40]!r} are not supported (message, function_call "
                               "and function_call_output are)", param="input")
    if not messages:
        raise InvalidInput("'input' must not be empty unless a conversation or previous_response_id gives the "
                           "items to answer", param="input")
    return messages


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's thoughts: its `reasoning_text` parts, joined (a summary is not them)."""
    content = item.get("content") or []
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise InvalidInput("a reasoning input item's 'content' must be a list of reasoning_text parts", param="input")
    texts = [part.get("text") for part in content if part.get("type") == "reasoning_text"]
    if not all(isinstance(text, str) for text in texts):
        raise InvalidInput("a reasoning_text part needs its 'text' (a string)", param="input")
    return "".join(texts)


def _text(content: Any, what: str) -> str:
    """A message's or a call output's text: a string, or text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidInput(f"{what} may only hold text (input_text) parts, got {str(kind)[:40]!r}: "
                                   "image, file and audio inputs are not supported", param="input")
            if not isinstance(part.get("text"), str):
                raise InvalidInput(f"a text part of {what} needs its 'text'", param="input")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidInput(f"{what} must be a string or a list of text parts", param="input")


def _string(item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidInput(f"a {item.get('type')} input item needs its '{key}' (a string)", param="input")
    return value


def _tool(tool: Any) -> ToolDef:
    """A Responses function tool (`{"type": "function", "name", "parameters", ...}`) as the chat's."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise InvalidInput(f"only function tools are supported, got {str(kind)[:40]!r}", param="tools")
    name, description, parameters = tool.get("name"), tool.get("description"), tool.get("parameters")
    if not isinstance(name, str) or not isinstance(description, str | None) or not isinstance(parameters, dict | None):
        raise InvalidInput("a function tool needs a 'name' (a string), and its 'description' is a string and its "
                           "'parameters' a JSON schema", param="tools")
    strict = tool.get("strict")
    return ToolDef("function", FunctionDef(name, description, parameters, strict if isinstance(strict, bool) else None))


def _tool_choice(choice: str | dict[str, Any] | None) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return NamedToolChoice("function", ChosenFunction(choice["name"]))
    raise InvalidInput("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                       param="tool_choice")


def _response_format(given: TextFormat | None) -> ResponseFormat | None:
    if given is None:
        return None
    if given.type == "json_schema":
        if given.schema is None:
            raise InvalidInput("a 'json_schema' text format needs its 'schema'", param="text.format")
        return ResponseFormat("json_schema", JsonSchemaFormat(given.name, given.schema, given.strict,
                                                               given.description))
    return ResponseFormat(given.type)  # "text", "json_object"; others refused as the chat refuses them


def _as_responses_error(exc: InvalidInput) -> InvalidInput:
    """A chat request's error, naming the Responses request's fields."""
    message = exc.message
    for chat_name, name in CHAT_PARAMS.items():
        message = message.replace(f"'{chat_name}'", f"'{name}'").replace(f"reduce {chat_name}", f"reduce {name}")
    message = message.replace("for the messages", "for the input")
    return InvalidInput(message, param=CHAT_PARAMS.get(exc.param or "", exc.param))


class ResponsesShape:
    """A Responses request's `response` object, and its stream of events."""

    def __init__(self, request: ResponsesRequest, model: str, payload: wire.GeneratePayload,
                 plan: ToolPlan | None, is_stored: bool = False, reasoning: str = "") -> None:
        self.request = request
        self.conversation_id = _conversation_id(request)
        self.is_stored = is_stored
        self.model = model
        self.payload = payload
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.chat = ResponseShape(True, model, logprobs=payload.logprobs, tools=plan, reasoning=reasoning)
        """The chat answer's shape: what reads a reasoning model's thoughts and tool calls out of the
        text, whole or as it streams."""
        self.output: list[dict[str, Any]] = []
        """A stream's items so far."""
        self._open: dict[str, Any] | None = None  # the item the stream is adding to
        self._held_logprobs: list[dict[str, Any]] = []
        """Log-probabilities of tokens whose text the stream held back, until it is known to be answer."""
        self._sequence = 0

    def response(self, status: str, usage: dict[str, Any] | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        request = self.request
        text_format: dict[str, Any] = {"type": "text"}
        if request.text is not None and request.text.format is not None:
            given = msgspec.structs.asdict(request.text.format)
            text_format = {key: value for key, value in given.items() if value is not None}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": bool(request.background), "error": None,
            "incomplete_details": None if incomplete is None else {"reason": incomplete},
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": None, "model": self.model, "output": self.output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "conversation": None if self.conversation_id is None else {"id": self.conversation_id},
            "reasoning": {"effort": self.payload.reasoning_effort, "summary": None}, "service_tier": "default",
            "store": self.is_stored,
            "temperature": self.payload.temperature, "text": {"format": text_format, "verbosity": "medium"},
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "tools": request.tools or [], "top_logprobs": self.payload.logprobs or 0, "top_p": self.payload.top_p,
            "truncation": "disabled",
            "usage": usage, "user": request.user, "metadata": request.metadata or {},
        }

    def whole(self, result: wire.GenerationResult) -> dict[str, Any]:
        """The unstreamed response."""
        thought, text = self.chat.thought_and_answer(result.text)
        is_cut = result.finish_reason == "length"
        logprobs = result.logprobs or []
        if thought is not None:  # (cut while thinking: the thoughts are what is incomplete)
            self.output.append(_reasoning(thought, "incomplete" if is_cut and not text else "completed"))
        if self.chat.reasoning:  # the answer's alone (not the tags of thoughts, even empty ones)
            logprobs = logprobs[thought_token_count(self.chat.reasoning, [t.token for t in logprobs]):]
        content, calls = self.chat.answer(text) if self.chat.tools is not None else (text, None)
        if content or not calls:
            message = _message(content or "", "incomplete" if is_cut else "completed")
            message["content"][0]["logprobs"] = self._logprobs(logprobs)
            self.output.append(message)
        self.output += [_function_call(call, "completed") for call in calls or []]
        return self._final(result)

    def _logprobs(self, reported: list[wire.TokenLogprob] | None) -> list[dict[str, Any]]:
        """Tokens' log-probabilities as an output_text part carries them (chat's `logprobs.content`)."""
        shaped = self.chat.logprobs_of(reported or [])
        return [] if shaped is None else list(shaped["content"])

    def _final(self, result: wire.GenerationResult) -> dict[str, Any]:
        is_cut = result.finish_reason == "length"
        return self.response("incomplete" if is_cut else "completed", _usage(result),
                             "max_output_tokens" if is_cut else None)

    # -- streaming --

    def event(self, kind: str, **fields: Any) -> bytes:
        self._sequence += 1
        return sse_event(kind, self._sequence - 1, fields)

    def start(self) -> list[bytes]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def chunk(self, chat_chunk: dict[str, Any] | None) -> list[bytes]:
        """The events of one chat chunk of the answer (text, tool calls, the finish)."""
        if chat_chunk is None:
            return []
        choice = chat_chunk["choices"][0]
        delta, events = choice["delta"], []
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        if delta.get("reasoning_content"):
            self._held_logprobs = []  # what was held back was thought
            events += self._reasoning_delta(delta["reasoning_content"])
        if delta.get("content"):  # (the log-probabilities of a piece that ends the thoughts are theirs)
            events += self._text_delta(delta["content"], [] if delta.get("reasoning_content")
                                       else self._answer_logprobs(delta["content"], logprobs))
        elif not delta:  # text held back (it may be a tag): its tokens' log-probabilities wait for it
            self._held_logprobs += logprobs
        for call in delta.get("tool_calls") or []:
            events += self._call_delta(call)
        if choice["finish_reason"] is not None:
            events += self._close("incomplete" if choice["finish_reason"] == "length" else "completed")
        return events

    def _answer_logprobs(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The log-probabilities of a piece of answer `text`: those held back before it, when their
        tokens are where it starts (not tags that ended empty thoughts), then its own."""
        held, self._held_logprobs = self._held_logprobs, []
        return (held if text.startswith("".join(entry["token"] for entry in held)) else []) + logprobs

    def _text_delta(self, text: str, logprobs: list[dict[str, Any]]) -> list[bytes]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._close("completed") + self._open_message()
        assert self._open is not None
        part = self._open["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        events.append(self.event("response.output_text.delta", item_id=self._open["id"],
                                 output_index=len(self.output) - 1, content_index=0, delta=text, logprobs=logprobs))
        return events

    def _reasoning_delta(self, text: str) -> list[bytes]:
        events = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self._close("completed") + self._add(_reasoning("", "in_progress"))
        assert self._open is not None
        self._open["content"][0]["text"] += text
        events.append(self.event("response.reasoning_text.delta", item_id=self._open["id"],
                                 output_index=len(self.output) - 1, content_index=0, delta=text))
        return events

    def _open_message(self) -> list[bytes]:
        item = _message("", "in_progress")
        return [*self._add(item), self.event("response.content_part.added", item_id=item["id"],
                                             output_index=len(self.output) - 1, content_index=0,
                                             part=_text_part(""))]

    def _call_delta(self, call: dict[str, Any]) -> list[bytes]:
        events = []
        function = call.get("function", {})
        if "id" in call:  # a new call
            events += self._close("completed")
            events += self._add(_function_call({"id": call["id"], "function": {"name": function.get("name", ""),
                                                                                "arguments": ""}}, "in_progress"))
        assert self._open is not None and self._open["type"] == "function_call"
        if function.get("arguments"):
            self._open["arguments"] += function["arguments"]
            events.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                     output_index=len(self.output) - 1, delta=function["arguments"]))
        return events

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self.output.append(item)
        self._open = item
        announced = {**item, "content": []} if item["type"] in ("message", "reasoning") else item
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=announced)]

    def _close(self, status: str) -> list[bytes]:
        """The open item's end (none open: nothing)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, events = len(self.output) - 1, []
        item["status"] = status
        if item["type"] == "message":
            text = item["content"][0]["text"]
            part = item["content"][0]
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text, logprobs=part["logprobs"]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=item["content"][0]["text"]))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def finish(self, result: wire.GenerationResult) -> tuple[list[bytes], dict[str, Any]]:
        """The stream's last events but the final one, and the final response."""
        events = [event for chunk in self.chat.finish_chunks(0, result) for event in self.chunk(chunk)]
        final_status = "incomplete" if result.finish_reason == "length" else "completed"
        if all(item["type"] == "reasoning" for item in self.output):  # no answer: still one (empty) message
            events += self._open_message() + self._close(final_status)
        return events, self._final(result)


async def _events(shape: ResponsesShape, first: wire.TokenChunk | Any, stream: Events,
                  keep: Callable[[dict[str, Any]], Awaitable[None]], scope: Scope) -> AsyncIterator[bytes]:
    """The stream's events; one that fails ends with an `error` event, its error noted in `scope`
    for the access log (`common.stream_failed`)."""
    try:
        for event in shape.start():
            yield event
        item: Any = first
        while item is not None:
            if isinstance(item, wire.TokenChunk):
                for event in shape.chunk(shape.chat.delta(item.text, None, item.logprobs)) if item.text else []:
                    yield event
            else:
                assert isinstance(item.payload, wire.GenerationResult)
                events, final = shape.finish(item.payload)
                for event in events:
                    yield event
                await keep(final)  # stored before the client hears that it is done
                yield shape.event(f"response.{final['status']}", response=final)
                return
            item = await anext(stream, None)
        raise RuntimeError("a generation ended without a result")
    except SluiceError as exc:  # after the first byte: an error event ends the stream
        if isinstance(exc, InvalidInput) and exc.param in RESPONSES_PARAMS:
            exc = InvalidInput(exc.message, param=RESPONSES_PARAMS[exc.param])
        stream_failed(scope, exc)
        yield _error_event(shape, exc)
    except Exception as exc:  # a bug: the client still gets an error event and a clean end
        log.exception("internal error while streaming %s", shape.id)
        stream_failed(scope, exc)
        yield _error_event(shape, exc)
    finally:
        await stream.aclose()  # withdraws the sequence if we stopped early (client gone)


def _error_event(shape: ResponsesShape, exc: Exception) -> bytes:
    """Responses' `error` event: `{"type": "error", "code", "message", "param"}` (the envelope's
    own `type`, `invalid_request_error` say, is not the event's)."""
    fields = {key: value for key, value in error_body(exc)["error"].items() if key != "type"}
    return shape.event("error", **fields)


def sse_event(kind: str, sequence_number: int, fields: Mapping[str, Any]) -> bytes:
    """One of Responses' stream events: an SSE `event:` line and a `data:` line."""
    data = msgspec.json.encode({"type": kind, "sequence_number": sequence_number, **fields})
    return f"event: {kind}\ndata: ".encode() + data + b"\n\n"


def _message(text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": new_item_id("message"), "status": status, "role": "assistant",
            "content": [_text_part(text)]}


def _reasoning(text: str, status: str) -> dict[str, Any]:
    """A reasoning model's thoughts (`sluice.reasoning`) as an output item, ahead of its answer."""
    return {"type": "reasoning", "id": new_item_id("reasoning"), "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _function_call(call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": new_item_id("function_call"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def _usage(result: wire.GenerationResult) -> dict[str, Any]:
    """`cache_write_tokens` only where known: an upstream server that does not say is not taken to have written none."""
    details: dict[str, Any] = {"cached_tokens": result.num_cached_tokens}
    if result.num_cache_write_tokens is not None:
        details["cache_write_tokens"] = result.num_cache_write_tokens
    return {"input_tokens": result.num_prompt_tokens,
            "input_tokens_details": details,
            "output_tokens": result.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": result.num_reasoning_tokens},
            "total_tokens": result.num_prompt_tokens + result.num_output_tokens}
