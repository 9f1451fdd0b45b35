"""Triton's generate extension on a generative model: text in, text out, without tensors.

    POST /v2/models/{name}[/versions/{version}]/generate           one JSON answer
    POST /v2/models/{name}[/versions/{version}]/generate_stream    Server-Sent Events

    {"text_input": "Once upon a time", "parameters": {"max_tokens": 16, "temperature": 0}}
    -> {"model_name": "tiny-lm", "model_version": "1", "text_output": "Once upon a time, ..."}

The request is Triton's: `text_input` (the prompt), an optional `id` (echoed back), `parameters`
(sampling, by the completions API's names, and KServe's own `timeout` and `priority`), and, as
the vLLM and TensorRT-LLM backends take them, sampling fields, `stream` and
`exclude_input_in_output` beside `text_input`. As those backends do, a whole answer's
`text_output` starts with the prompt unless `exclude_input_in_output` is true; a stream's events
carry only the new text, one event per chunk the worker sends, and no `[DONE]` (Triton's stream
has none). `stream: false` on `/generate_stream` gives one event holding the whole answer;
`stream: true` on `/generate` is a 400 naming the streaming route.

Errors are KServe's shape (`{"error": "..."}`) with the status; once a stream has started, an
error is an event of that shape and the stream ends. The generation itself is `/v1/completions`'
(`api.completions`): the same checks, limits, deadlines and cancellation when the client goes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Scope

from sluice import wire
from sluice.api.common import (
    PRIORITY_HEADER,
    arrival,
    caller,
    decode_json,
    header_timeout_s,
    json_response,
    note_model,
    read_body,
    request_tenant,
    route_key,
    stream_failed,
    trace_context,
    with_version,
)
from sluice.api.completion_params import CompletionRequest, to_payloads
from sluice.api.completions import SSE_HEADERS, Events, generations, unless_disconnected, whole_generations
from sluice.api.errors import error_body
from sluice.api.kserve import request_terms
from sluice.api.kserve_generate import GENERATIVE_KINDS, SAMPLING_NAMES, TEXT_INPUT, TEXT_OUTPUT
from sluice.errors import InvalidInput, SluiceError
from sluice.gateway import Gateway, InferResult

__all__ = ["routes"]

log = logging.getLogger("sluice.api")

_OWN_FIELDS = frozenset({"id", TEXT_INPUT, "parameters", "stream", "exclude_input_in_output"})


def routes(gateway: Gateway, body_limit_bytes: int) -> list[Route]:
    async def generate(request: Request) -> Response:
        return await _generate(gateway, request, body_limit_bytes, is_stream_route=False)

    async def generate_stream(request: Request) -> Response:
        return await _generate(gateway, request, body_limit_bytes, is_stream_route=True)

    table = []
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        table += [Route(prefix + "/generate", generate, methods=["POST"]),
                  Route(prefix + "/generate_stream", generate_stream, methods=["POST"])]
    return table


class _Terms(msgspec.Struct, frozen=True):
    payload: wire.GeneratePayload
    parameters: dict[str, Any]
    answer_id: str | None
    prompt: str
    with_prompt: bool


async def _generate(gateway: Gateway, request: Request, body_limit_bytes: int, *, is_stream_route: bool) -> Response:
    arrived_at = arrival(request, gateway.now())
    timeout_s = header_timeout_s(request, gateway.max_timeout_s)
    name, version = request.path_params["name"], request.path_params.get("version")
    tenant = request_tenant(request)
    info = note_model(request, gateway.resolve(name, version, route_key(request), tenant=tenant))
    if info.kind not in GENERATIVE_KINDS:
        raise InvalidInput(f"model {name!r} does not generate text; use /v2/models/{name}/infer")
    body = await read_body(request, body_limit_bytes)
    with gateway.reading(info, tenant, arrived_at, trace_context(request) if gateway.is_tracing else None):
        terms = _terms(info, decode_json(body, dict[str, Any]), is_stream_route)
        body_timeout_s, priority = request_terms(terms.parameters, request.headers.get(PRIORITY_HEADER),
                                                 gateway.max_timeout_s)
    who = caller(request, priority, is_traced=True)  # untraced too: an upstream call carries the client's trace on
    limit_headers: dict[str, str] | None = {} if terms.payload.stream else None
    streams = generations(gateway, who, info, [terms.payload], timeout_s if body_timeout_s is None else body_timeout_s,
                          arrived_at, limit_headers)
    head: dict[str, Any] = {"model_name": info.name, "model_version": info.version}
    if terms.answer_id is not None:
        head = {"id": terms.answer_id, **head}
    if not terms.payload.stream:
        (result,) = await unless_disconnected(request, streams, whole_generations(streams))
        assert isinstance(result.payload, wire.GenerationResult)
        text = terms.prompt + result.payload.text if terms.with_prompt else result.payload.text
        answer = {**head, TEXT_OUTPUT: text}
        if not is_stream_route:
            return json_response(answer, headers=with_version(info, result.headers))
        return StreamingResponse(_one_event(answer), media_type="text/event-stream",
                                 headers=with_version(info, {**SSE_HEADERS, **(result.headers or {})}))
    # errors before the first byte are HTTP statuses
    first = await unless_disconnected(request, streams, anext(streams[0]))
    return StreamingResponse(_events(head, first, streams[0], request.scope), media_type="text/event-stream",
                             headers=with_version(info, {**SSE_HEADERS, **(limit_headers or {})}))


def _terms(info: wire.ModelInfo, body: dict[str, Any], is_stream_route: bool) -> _Terms:
    """A generate request's generation, checked as `/v1/completions` checks its fields."""
    prompt = body.get(TEXT_INPUT)
    if not isinstance(prompt, str):
        raise InvalidInput(f"a generate request needs {TEXT_INPUT!r}, the prompt, as a string", param=TEXT_INPUT)
    unknown = sorted(set(body) - _OWN_FIELDS - SAMPLING_NAMES)
    if unknown:
        raise InvalidInput(f"unknown field(s) {unknown}: a generate request takes {TEXT_INPUT!r}, 'id', 'parameters', "
                           f"'stream', 'exclude_input_in_output' and the sampling fields {sorted(SAMPLING_NAMES)}")
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be a JSON object", param="parameters")
    answer_id = body.get("id")
    if answer_id is not None and not isinstance(answer_id, str):
        raise InvalidInput("'id' must be a string", param="id")
    given = {**parameters, **body}  # a field beside text_input is the model input the backends read
    stream = _flag(given, "stream", is_stream_route)
    if stream and not is_stream_route:
        raise InvalidInput("'stream': true needs /generate_stream; /generate answers once", param="stream")
    exclude = _flag(given, "exclude_input_in_output", False)
    fields = {name: value for name, value in given.items() if name in SAMPLING_NAMES}
    try:
        request = msgspec.convert({**fields, "model": info.name, "prompt": prompt, "stream": stream},
                                  CompletionRequest)
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"sampling parameters: {exc}") from exc
    (payload,) = to_payloads(request, info)
    return _Terms(payload, parameters, answer_id, prompt, with_prompt=not stream and not exclude)


def _flag(given: dict[str, Any], name: str, default: bool) -> bool:
    value = given.get(name, default)
    if not isinstance(value, bool):
        raise InvalidInput(f"{name!r} must be true or false", param=name)
    return value


async def _one_event(answer: dict[str, Any]) -> AsyncIterator[bytes]:
    yield _event(answer)


async def _events(head: dict[str, Any], first: wire.TokenChunk | InferResult, events: Events,
                  scope: Scope) -> AsyncIterator[bytes]:
    """One event per chunk with text; an error after the first byte is an error event, then the end."""
    try:
        event: wire.TokenChunk | InferResult | None = first
        while isinstance(event, wire.TokenChunk):
            if event.text:
                yield _event({**head, TEXT_OUTPUT: event.text})
            event = await anext(events, None)
        if event is None:
            raise RuntimeError("a generation ended without a result")
    except Exception as exc:  # SluiceError: the client's or the fleet's; anything else: a bug, still a clean end
        stream_failed(scope, exc)
        if not isinstance(exc, SluiceError):
            log.exception("internal error while streaming a generate request")
        yield _event(error_body(exc, "kserve"))
    finally:
        await events.aclose()  # withdraws the sequence if we stopped early (client gone)


def _event(content: Any) -> bytes:
    return b"data: " + msgspec.json.encode(content) + b"\n\n"
