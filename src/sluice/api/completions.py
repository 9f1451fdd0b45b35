"""OpenAI-compatible text generation: `/v1/completions` and `/v1/chat/completions`.

    body ─▶ validate ─▶ GeneratePayload ─▶ gateway.generate ─┬─▶ JSON (stream: false)
                                                             └─▶ SSE chunks ... data: [DONE]

Errors found before the first byte are HTTP statuses in OpenAI's envelope; once the stream has
started, an error is sent as an SSE event carrying the same envelope, then `[DONE]`. A client that
disconnects cancels its sequence on the worker, whether it is waiting for a whole answer, for a
stream's first token, or reading the stream. Fields `vllm bench serve` sends (`ignore_eos`,
`top_k`, `min_tokens`, `repetition_penalty`) are honoured, as are OpenAI's `presence_penalty`,
`frequency_penalty`, `logit_bias` and `logprobs` (completions: `logprobs: k`; chat: `logprobs: true`
with `top_logprobs: k`; k up to 20, from the model's own distribution), and completions' `echo`
(the prompt before the text, with its tokens' log-probabilities; `max_tokens: 0` only scores the
prompt, as evaluation harnesses ask), `n` completions of one prompt (up to 16, each its own
sequence on the worker, answered and charged as one request), and batches of prompts (each a
generation of its own through the gateway; their answers joined, their streams merged),
structured outputs (`response_format`, vLLM's `guided_*` and `structured_outputs`) and chat tool
calls (`tools` with `tool_choice` "required", a named function, or "auto" for a model that names
its `tool_call_parser`: `api.tool_calls`; legacy `functions` and `function_call`:
`api.legacy_functions`), chat's `echo` and `reasoning_effort` (for a chat template that reads it).
What cannot be served is refused with a 400 rather than silently ignored (`api.completion_params`).
`null` for an optional field means "not given", as in OpenAI's API.

The request's fields and their checks are `api.completion_params`; the response objects
`api.completion_shapes`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Scope

from sluice import wire
from sluice.api import legacy_functions
from sluice.api.common import (
    arrival,
    caller,
    decode_json,
    header_timeout_s,
    read_body,
    request_tenant,
    requested_priority,
    resolve_openai,
    response_id,
    stream_failed,
    trace_context,
    unless_gone,
    with_version,
)
from sluice.api.completion_params import (
    ChatRequest,
    CompletionRequest,
    chat_echo,
    chat_tools,
    estimate_tokens,
    to_payloads,
)
from sluice.api.completion_shapes import ResponseShape
from sluice.api.errors import error_body
from sluice.errors import InvalidInput, SluiceError
from sluice.gateway import Caller, Gateway, InferResult
from sluice.gateway.tenancy import RequestGroup
from sluice.reasoning import request_parser

log = logging.getLogger("sluice.api")

T = TypeVar("T")

def routes(gateway: Gateway, body_limit_bytes: int) -> list[Route]:
    async def completions(request: Request) -> Response:
        return await _serve(gateway, request, body_limit_bytes, CompletionRequest)

    async def chat(request: Request) -> Response:
        return await _serve(gateway, request, body_limit_bytes, ChatRequest)

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ]


async def _serve(gateway: Gateway, request: Request, body_limit_bytes: int,
                 kind: type[CompletionRequest] | type[ChatRequest]) -> Response:
    arrived_at = arrival(request, gateway.now())
    timeout_s = header_timeout_s(request, gateway.max_timeout_s)
    body = await read_body(request, body_limit_bytes)
    parsed: CompletionRequest | ChatRequest = decode_json(body, kind)
    is_legacy = isinstance(parsed, ChatRequest) and legacy_functions.is_legacy(parsed)
    info = resolve_generative(gateway, parsed.model, request, parsed.user)
    with gateway.reading(info, request_tenant(request), arrived_at,
                         trace_context(request) if gateway.is_tracing else None):
        try:
            if isinstance(parsed, ChatRequest):
                parsed = legacy_functions.as_tools(parsed)
            payloads = to_payloads(parsed, info)
            answer_id = response_id(request, parsed.request_id, "chatcmpl" if isinstance(parsed, ChatRequest)
                                    else "cmpl")
        except InvalidInput as exc:
            raise (legacy_functions.renamed(exc) if is_legacy else exc) from exc
        priority = requested_priority(request, ("service_tier", parsed.service_tier), ("priority", parsed.priority))
    first = payloads[0]
    limit_headers: dict[str, str] | None = {} if first.stream else None  # a whole answer has its own
    who = caller(request, priority, is_traced=True)  # untraced too: an upstream call carries the client's trace on
    streams = generations(gateway, who, info, payloads, timeout_s, arrived_at, limit_headers)
    options = parsed.stream_options
    include_usage = options is not None and bool(options.include_usage)
    prompt_texts = [payload.prompt if payload.echo else None for payload in payloads]
    tools = chat_tools(parsed, info)[2] if isinstance(parsed, ChatRequest) else None
    shape = ResponseShape(isinstance(parsed, ChatRequest), info.name, include_usage, first.logprobs, prompt_texts,
                          first.n, tools, is_legacy_functions=is_legacy,
                          echo=chat_echo(parsed) if isinstance(parsed, ChatRequest) else "",
                          continuous_usage=options is not None and bool(options.continuous_usage_stats),
                          return_token_ids=first.return_token_ids, response_id=answer_id,
                          reasoning=request_parser(info.reasoning_parser, first))
    # the model's own refusals name `max_tokens`: the client may have sent `max_completion_tokens`
    names = {"max_tokens": "max_completion_tokens"} if getattr(parsed, "max_completion_tokens", None) else {}
    if not first.stream:
        results = await renamed(names, unless_disconnected(request, streams, whole_generations(streams)))
        answers = [result.payload for result in results if isinstance(result.payload, wire.GenerationResult)]
        assert len(answers) == len(results)
        return Response(msgspec.json.encode(shape.whole(answers)), media_type="application/json",
                        headers=with_version(info, results[0].headers))
    # errors before the first byte become HTTP statuses
    firsts = await renamed(names, unless_disconnected(request, streams, _each(streams, anext)))
    for p, first in enumerate(firsts):  # the prompts' token counts (and ids), for the role chunks
        if isinstance(first, wire.TokenChunk):
            shape.count_prompt(p, first.num_prompt_tokens)
            shape.note_prompt_token_ids(p, first.prompt_token_ids)
    return StreamingResponse(_sse(shape, _tagged(firsts, streams), streams, request.scope),
                             media_type="text/event-stream",
                             headers=with_version(info, {**SSE_HEADERS, **(limit_headers or {})}))


SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
"""A stream's headers: no cache, and no buffering by a proxy (nginx reads x-accel-buffering)."""


def resolve_generative(gateway: Gateway, model: str, request: Request, user: str | None) -> wire.ModelInfo:
    """The model version a generation request asks for (`api.common.resolve_openai`), which must generate text."""
    info = resolve_openai(gateway, model, request, user)
    if info.kind not in ("generative", "openai-upstream"):
        raise InvalidInput(f"model {model!r} does not generate text; use /v1/embeddings or /v2/models/{model}/infer",
                           param="model")
    return info


Events = AsyncGenerator[wire.TokenChunk | InferResult, None]
"""One prompt's generation through the gateway: its chunks (if streamed), then its result."""


def generations(gateway: Gateway, who: Caller, info: wire.ModelInfo, payloads: list[wire.GeneratePayload],
                timeout_s: float | None, arrived_at: float,
                limit_headers: dict[str, str] | None = None) -> list[Events]:
    """One generation through the gateway for each prompt's payload, for `who` (each with its own
    token estimate). `limit_headers`, if given, receives the tenant's `x-ratelimit-*` headers once
    the first is admitted."""
    # a batch of prompts is one request to the tenant's limits, however many generations it runs
    estimates = [estimate_tokens(payload, info.max_model_len) for payload in payloads]
    likely = [estimate_tokens(payload, info.max_model_len, likely=True) for payload in payloads]
    group = RequestGroup(sum(estimates), sum(likely)) if len(payloads) > 1 else None
    return [gateway.generate(info, payload, timeout_s, arrived_at=arrived_at,
                             caller=replace(who, estimated_tokens=estimates[p], likely_tokens=likely[p], group=group),
                             limit_headers=limit_headers if p == 0 else None)
            for p, payload in enumerate(payloads)]


async def whole_generations(streams: list[Events]) -> list[InferResult]:
    """Every generation's result, its payload the whole answer (all withdrawn if one fails).
    Each stream is closed once its result is in: that ends its request's ticket (its outcome's
    metrics, its span) here, in the request's own task; a stream left open would end it only
    when collected, outside the request, where its accounting was lost."""
    results = await _each(streams, final_result)
    for stream in streams:
        await stream.aclose()
    return results


async def _each(streams: list[Events], first: Callable[[Events], Awaitable[T]]) -> list[T]:
    """`first(stream)` of every prompt's stream, at once; if one fails, the others are withdrawn
    and its error is the request's."""
    if len(streams) == 1:
        return [await first(streams[0])]
    tasks = [asyncio.ensure_future(first(stream)) for stream in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        raise


async def unless_disconnected(request: Request, streams: list[Events], waiting: Awaitable[T]) -> T:
    """What `waiting` (on `streams`) gives, unless the client disconnects first: then the
    generations are withdrawn from their workers (blocks freed within a step) and nobody is answered."""
    try:
        return await unless_gone(request, waiting)
    except BaseException:
        for stream in streams:
            await stream.aclose()  # withdraws what still runs (the wait's cancellation may have done so)
        raise


async def renamed(names: Mapping[str, str], waiting: Awaitable[T]) -> T:
    """`waiting`'s result; an `InvalidInput` it raises naming a field in `names` names the
    client's field instead (the worker knows the request by its payload's names): in `param`, and
    in its message where the name cannot be a plain word ("reduce max_tokens", not "these messages")."""
    try:
        return await waiting
    except InvalidInput as exc:
        if exc.param is not None and exc.param in names:
            message = exc.message
            if "_" in exc.param:
                message = re.sub(rf"\b{re.escape(exc.param)}\b", names[exc.param], message)
            raise InvalidInput(message, param=names[exc.param]) from exc
        raise


async def final_result(events: Events) -> InferResult:
    async for event in events:
        if isinstance(event, InferResult):
            return event
    raise RuntimeError("a generation ended without a result")


async def _tagged(firsts: list[wire.TokenChunk | InferResult], streams: list[Events]
                  ) -> AsyncGenerator[tuple[int, wire.TokenChunk | InferResult], None]:
    """Every prompt's events, each with its prompt's position, as they come, until every prompt's
    result has come. One prompt's events are read directly; several are merged through a queue."""
    if len(streams) == 1:
        event: wire.TokenChunk | InferResult | None = firsts[0]
        while event is not None:
            yield 0, event
            if isinstance(event, InferResult):
                return
            event = await anext(streams[0], None)
        raise RuntimeError("a generation ended without a result")
    queue: asyncio.Queue[tuple[int, wire.TokenChunk | InferResult | BaseException]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(p, first, stream, queue))
             for p, (first, stream) in enumerate(zip(firsts, streams, strict=True))]
    try:
        for _ in range(len(streams)):
            while True:
                p, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield p, item
                if isinstance(item, InferResult):
                    break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(p: int, first: wire.TokenChunk | InferResult, stream: Events,
                queue: asyncio.Queue[tuple[int, wire.TokenChunk | InferResult | BaseException]]) -> None:
    """Prompt `p`'s events into `queue`, up to its result, or the error that ended it."""
    try:
        event = first
        while not isinstance(event, InferResult):
            queue.put_nowait((p, event))
            event = await anext(stream)
        queue.put_nowait((p, event))
    except StopAsyncIteration:
        queue.put_nowait((p, RuntimeError("a generation ended without a result")))
    except Exception as exc:
        queue.put_nowait((p, exc))


async def _sse(shape: ResponseShape, events: AsyncGenerator[tuple[int, wire.TokenChunk | InferResult], None],
               streams: list[Events], scope: Scope | None = None) -> AsyncIterator[bytes]:
    """The stream's events; one that fails ends with an error event, its error noted in `scope`
    for the access log (`common.stream_failed`)."""
    n = shape.n
    finals: list[wire.GenerationResult] = []
    try:
        if shape.is_chat:
            for index in range(shape.num_choices):
                yield sse_data(shape.role_chunk(index))
        async for p, event in events:
            if isinstance(event, InferResult):
                payload = event.payload
                assert isinstance(payload, wire.GenerationResult)
                finals.append(payload)
                shape.count(p, payload)
                for chunk in shape.finish_chunks(p, payload):
                    yield sse_data(chunk)
                continue
            shape.count(p, event)
            shape.add_token_ids(p, event)
            if event.prompt is not None:  # with the prompt's first token: each of its choices starts with it
                for index in range(p * n, p * n + n):
                    yield sse_data(shape.echo(event.prompt, index))
            if event.text or (shape.logprobs is not None and event.logprobs):
                delta = shape.delta(event.text, None, event.logprobs, p * n + event.index)
                if delta is not None:
                    yield sse_data(delta)
        if shape.include_usage:
            yield sse_data(shape.usage_chunk(finals))
    except SluiceError as exc:  # after the first byte: an error event, then the end of the stream
        if scope is not None:
            stream_failed(scope, exc)
        yield sse_data(error_body(exc))
    except Exception as exc:  # a bug: the client still gets an error event and a clean end
        log.exception("internal error while streaming %s", shape.id)
        if scope is not None:
            stream_failed(scope, exc)
        yield sse_data(error_body(exc))
    finally:
        await events.aclose()
        for stream in streams:
            await stream.aclose()  # withdraws the sequences if we stopped early (client gone)
    yield b"data: [DONE]\n\n"


def sse_data(content: Any) -> bytes:
    """One Server-Sent Event carrying `content` as JSON."""
    return b"data: " + msgspec.json.encode(content) + b"\n\n"
