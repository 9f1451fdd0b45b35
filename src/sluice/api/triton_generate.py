"""Triton's generate extension on a generative model: text in, text out, without tensors.

    POST /v2/models/{name}[/versions/{version}]/generate           one JSON answer
    POST /v2/models/{name}[/versions/{version}]/generate_stream    Server-Sent Events

    {"text_input": "Once upon a time", "parameters": {"max_tokens": 16, "temperature": 0}}
    -> {"model_name": "tiny-lm", "model_version": "1", "text_output": "Once upon a time, ..."}

The request is Triton's: `text_input` (the prompt), an optional `id` (echoed back), `parameters`
(sampling, by the completions API's names, and KServe's own `timeout` and `priority`), and, as
the vLLM and TensorRT-LLM backends take them, sampling fields, `sampling_parameters` (a JSON
object as a string), `stream` and `exclude_input_in_output` beside `text_input` (a value there may
be a list of one, a tensor of one element). As those backends do, a whole answer's
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
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

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
    unless_gone,
    with_version,
)
from sluice.api.completions import SSE_HEADERS, sse_data
from sluice.api.errors import error_body
from sluice.api.kserve import request_terms
from sluice.api.kserve_generate import (
    EXCLUDE_INPUT,
    GENERATIVE_KINDS,
    SAMPLING_INPUT,
    SAMPLING_NAMES,
    STREAM,
    TEXT_INPUT,
    TEXT_OUTPUT,
    TextChunk,
    TextRequest,
    build_text_request,
    flag,
    generate_text,
    sampling_object,
    stream_text,
)
from sluice.errors import InvalidInput, SluiceError
from sluice.gateway import Gateway

__all__ = ["routes"]

log = logging.getLogger("sluice.api")

_OWN_FIELDS = frozenset({"id", TEXT_INPUT, "parameters", SAMPLING_INPUT, STREAM, EXCLUDE_INPUT})


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
        parsed = decode_json(body, dict[str, Any])
        text, answer_id, parameters = _text_request(info, parsed, is_stream_route)
        body_timeout_s, priority = request_terms(parameters, request.headers.get(PRIORITY_HEADER),
                                                 gateway.max_timeout_s)
    who = caller(request, priority, is_traced=True)  # untraced too: an upstream call carries the client's trace on
    deadline_s = timeout_s if body_timeout_s is None else body_timeout_s
    head: dict[str, Any] = {"model_name": info.name, "model_version": info.version}
    if answer_id is not None:
        head = {"id": answer_id, **head}
    if not text.is_stream:
        (whole,), headers = await unless_gone(request, generate_text(gateway, who, info, text, deadline_s, arrived_at))
        answer = {**head, TEXT_OUTPUT: whole}
        if not is_stream_route:
            return json_response(answer, headers=with_version(info, headers))
        return StreamingResponse(_one_event(answer), media_type="text/event-stream",
                                 headers=with_version(info, {**SSE_HEADERS, **(headers or {})}))
    limit_headers: dict[str, str] = {}  # the tenant's x-ratelimit-* headers, once admitted
    chunks = stream_text(gateway, who, info, text, deadline_s, arrived_at, limit_headers)
    try:  # errors before the first byte are HTTP statuses
        first = await unless_gone(request, anext(chunks, None))
    except BaseException:
        await chunks.aclose()
        raise
    return StreamingResponse(_events(head, first, chunks, request.scope), media_type="text/event-stream",
                             headers=with_version(info, {**SSE_HEADERS, **limit_headers}))


def _text_request(info: wire.ModelInfo, body: dict[str, Any],
                  is_stream_route: bool) -> tuple[TextRequest, str | None, dict[str, Any]]:
    """A generate request's generation, its `id` and its `parameters`; a field beside `text_input`
    is the model input the backends read, a value there a tensor (a list of one is its element)."""
    unknown = sorted(set(body) - _OWN_FIELDS - SAMPLING_NAMES)
    if unknown:
        raise InvalidInput(f"unknown field(s) {unknown}: a generate request takes {TEXT_INPUT!r}, 'id', "
                           f"'parameters', {SAMPLING_INPUT!r}, {STREAM!r}, {EXCLUDE_INPUT!r} and the sampling "
                           f"fields {sorted(SAMPLING_NAMES)}")
    given = {name: _element(value) for name, value in body.items() if name != "parameters"}
    prompt = given.get(TEXT_INPUT)
    if not isinstance(prompt, str):
        raise InvalidInput(f"a generate request needs {TEXT_INPUT!r}, the prompt, as a string", param=TEXT_INPUT)
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be a JSON object", param="parameters")
    answer_id = given.get("id")
    if answer_id is not None and not isinstance(answer_id, str):
        raise InvalidInput("'id' must be a string", param="id")
    fields = {name: value for name, value in {**parameters, **given}.items() if name in SAMPLING_NAMES}
    if SAMPLING_INPUT in given:
        fields.update(sampling_object(given[SAMPLING_INPUT]))
    flags = {name: flag({**parameters, **given}, name) for name in (STREAM, EXCLUDE_INPUT)}
    stream = is_stream_route if flags[STREAM] is None else bool(flags[STREAM])
    text = build_text_request(info, [prompt], fields, is_stream=stream, exclude_input=bool(flags[EXCLUDE_INPUT]),
                              stream_route=None if is_stream_route else f"POST /v2/models/{info.name}/generate_stream")
    return text, answer_id, parameters


def _element(value: Any) -> Any:
    return value[0] if isinstance(value, list) and len(value) == 1 else value


async def _one_event(answer: dict[str, Any]) -> AsyncIterator[bytes]:
    yield sse_data(answer)


async def _events(head: dict[str, Any], first: TextChunk | None, chunks: AsyncGenerator[TextChunk, None],
                  scope: Scope) -> AsyncIterator[bytes]:
    """One event per chunk of text, and the last chunk's even if empty (a stream that ends before
    any text still says so); an error after the first byte is an error event, then the end."""
    try:
        if first is not None:
            if first.text or first.is_last:
                yield sse_data({**head, TEXT_OUTPUT: first.text})
            async for chunk in chunks:
                if chunk.text or chunk.is_last:
                    yield sse_data({**head, TEXT_OUTPUT: chunk.text})
    except Exception as exc:  # SluiceError: the client's or the fleet's; anything else: a bug, still a clean end
        stream_failed(scope, exc)
        if not isinstance(exc, SluiceError):
            log.exception("internal error while streaming a generate request")
        yield sse_data(error_body(exc, "kserve"))
    finally:
        await chunks.aclose()  # withdraws the generation if we stopped early (client gone)
