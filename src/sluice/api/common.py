"""Small helpers shared by the protocol modules: bounded body reads, deadlines, tenant and class."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Scope

from sluice import wire
from sluice.api.encoding import decoded_body
from sluice.errors import InvalidInput, PayloadTooLarge
from sluice.gateway import Caller, Gateway
from sluice.gateway.cache import CachePolicy, cache_policy
from sluice.gateway.tenancy import RequestGroup
from sluice.priority import Priority, parse_priority

TIMEOUT_HEADER = "x-request-timeout-ms"

T = TypeVar("T")
S = TypeVar("S")


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The request body, refusing more than `limit_bytes` before reading it all, decompressed
    (`Content-Encoding`: `api.encoding`) within the same limit."""
    declared = parse_count(request.headers.get("content-length", ""))
    if declared is not None:
        check_body_size(declared, limit_bytes)
    chunks = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit_bytes:
                raise PayloadTooLarge(f"request body is over the {limit_bytes}-byte limit")
            chunks.append(chunk)
    except ClientDisconnect as exc:  # nobody will read the answer; this only keeps it out of the bug log
        request.scope[GONE_SCOPE_KEY] = True
        raise InvalidInput("the client disconnected before sending the whole body") from exc
    return decoded_body(b"".join(chunks), request.headers.get("content-encoding"), limit_bytes)


async def client_gone(request: Request) -> None:
    """Returns when the client has gone. The body has been read: the next message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, answer: Awaitable[T]) -> T:
    """What `answer` gives, unless the client disconnects first: then `answer` is cancelled (which
    withdraws its request from the worker) and nobody is answered."""
    work = asyncio.ensure_future(answer)
    watch = asyncio.ensure_future(client_gone(request))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if not work.cancelled():
        return work.result()
    request.scope[GONE_SCOPE_KEY] = True
    raise InvalidInput("the client disconnected before the answer was ready")


def check_body_size(size: int, limit_bytes: int) -> None:
    if size > limit_bytes:
        raise PayloadTooLarge(f"request body of {size} bytes is over the {limit_bytes}-byte limit")


class HotRoute(Route, Generic[S]):
    """A one-shot inference route (POST), in two steps:

    - `screen(request, body)`: the checks that can refuse the request before it is sent on,
      raising the refusal, else returning what they found;
    - `respond(request, body, screened)`: the rest, to the response. Given what `screen` found
      (None: it runs `screen` itself), it checks the overload again, just before sending.

    The HTTP protocol runs `screen` as soon as a small body is in, writes a refusal at once, and
    runs `respond` in a task of its own (`SluiceApp.answer_early`), and so does a batch job's item
    (`jobs.asgi_call`); a chunked or large body comes through the ASGI endpoint, which reads the
    body and calls `respond`.
    """

    def __init__(self, path: str, screen: Callable[[Request, bytes], S],
                 respond: Callable[[Request, bytes, S | None], Awaitable[Response]], body_limit_bytes: int) -> None:
        async def endpoint(request: Request) -> Response:
            body = await read_body(request, body_limit_bytes)
            return await unless_gone(request, respond(request, body, None))

        super().__init__(path, endpoint, methods=["POST"])
        self.screen = screen
        self.respond = respond
        self.body_limit_bytes = body_limit_bytes


def parse_count(raw: str) -> int | None:
    """A header's non-negative integer (ASCII digits only: `str.isdigit` also accepts `²`)."""
    if not raw or len(raw) > 18 or not (raw.isascii() and raw.isdigit()):
        return None
    return int(raw)


def header_timeout_s(request: Request, max_timeout_s: float) -> float | None:
    """The client's deadline from `X-Request-Timeout-Ms`, if it sent one, within the gateway's
    limit (`Gateway.max_timeout_s`): checked here so that the error names the header."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        timeout_ms = float(raw)
    except ValueError:
        raise InvalidInput(f"{TIMEOUT_HEADER} must be a number of milliseconds, got {raw[:32]!r}",
                           param=TIMEOUT_HEADER) from None
    if not 0 < timeout_ms <= max_timeout_s * 1000:
        raise InvalidInput(f"{TIMEOUT_HEADER} must be in (0, {max_timeout_s * 1000:.0f}] milliseconds, "
                           f"got {raw[:32]}", param=TIMEOUT_HEADER)
    return timeout_ms / 1000.0


RECEIVED_AT_SCOPE_KEY = "sluice.received_at"
"""ASGI scope key: when the HTTP protocol saw the request begin (`api.http_protocol`)."""


def arrival(request: Request, now: float) -> float:
    """When the request reached the server (the HTTP protocol's stamp, on the gateway's clock), or
    `now` for a request that did not come through it (a batch job's item, a test's transport)."""
    received_at = request.scope.get(RECEIVED_AT_SCOPE_KEY)
    return received_at if isinstance(received_at, float) and received_at <= now else now


GONE_SCOPE_KEY = "sluice.client_gone"
"""ASGI scope key, set once the client has gone before its answer was written (the access log's `cancelled`)."""
STREAM_ERROR_SCOPE_KEY = "sluice.stream_error"
"""ASGI scope key: the error that ended a stream after its 200 head, sent as its last event
(`stream_failed`), for the access log's outcome."""
MODEL_SCOPE_KEY = "sluice.model"
"""ASGI scope key: the `wire.ModelInfo` a request was routed to (`note_model`), for the access log."""


def note_model(request: Request, info: wire.ModelInfo) -> wire.ModelInfo:
    """Keep the model version `request` was routed to, for the access log (`api.access_log`)."""
    request.scope[MODEL_SCOPE_KEY] = info
    return info


def stream_failed(scope: Scope, error: Exception) -> None:
    """Note the error that ends a stream whose 200 head was sent (its answer's status says `ok`)."""
    scope[STREAM_ERROR_SCOPE_KEY] = error


def request_id(request: Request) -> str:
    return str(request.scope.get("sluice.request_id", ""))


VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
"""A client's request id that sluice takes (`x-request-id`, a body's `request_id`): it goes into
headers, logs and response ids as it is."""


def response_id(request: Request, body_request_id: str | None, prefix: str) -> str:
    """A response's `id`, as vLLM makes it: `prefix-` and the client's `x-request-id` (if it sent a
    sane one), else the body's `request_id` (vLLM's field; a 400 naming it if it is not an id), else a
    new one."""
    if body_request_id is not None and not VALID_REQUEST_ID.match(body_request_id):
        raise InvalidInput("'request_id' must be 1 to 128 letters, digits, '.', '_', ':' or '-'", param="request_id")
    header = request.headers.get("x-request-id")
    if header and header == request_id(request):  # the client's own: sluice took it (`api.app`)
        return f"{prefix}-{header}"
    return f"{prefix}-{body_request_id or uuid.uuid4().hex}"


TENANT_SCOPE_KEY = "sluice.tenant"
"""ASGI scope key holding the authenticated tenant's name, set by the auth middleware (or, for
batch-job items run in-process, by the job executor). Never read from a client header."""
MONITOR_SCOPE_KEY = "sluice.monitor"
"""Set on a statistics or repository index request read with a metrics or admin key
(`auth.statistics_reader`, `auth.listing_reader`): it sees every model."""
BACKGROUND_SCOPE_KEY = "sluice.background"
"""Set in the ASGI scope by the batch-job executor (never from a client's request): the request is
a job's item, which yields to online work on the device."""


def request_tenant(request: Request) -> str:
    """The tenant this request is served for: "" is the single local tenant (no tenants file)."""
    return str(request.scope.get(TENANT_SCOPE_KEY, ""))


ROUTE_KEY_HEADER = "x-sluice-route-key"
VERSION_HEADER = "x-sluice-model-version"


def route_key(request: Request, user: str | None = None) -> str | None:
    """Who a sticky traffic split keeps on one version (`gateway.traffic`): the caller's
    `X-Sluice-Route-Key`, else the OpenAI `user` it sent; None (a version drawn for this request
    alone) if neither. Not the tenant: a split by tenant would give a 5% canary all of a tenant's
    traffic or none of it."""
    return request.headers.get(ROUTE_KEY_HEADER) or user or None


def resolve_openai(gateway: Gateway, model: str, request: Request, user: str | None) -> wire.ModelInfo:
    """The model version an OpenAI `model` field asks for: `name` (the model's traffic split
    chooses) or `name:version` (that version)."""
    name, _, version = model.rpartition(":")
    if name and version.isdigit() and model not in gateway.models(include_recovering=True) \
            and model not in gateway.expected_models:
        return note_model(request, gateway.resolve(name, version, tenant=request_tenant(request)))
    return note_model(request, gateway.resolve(model, None, route_key(request, user), tenant=request_tenant(request)))


def with_version(info: wire.ModelInfo, headers: dict[str, str] | None) -> dict[str, str]:
    """An answer's headers with the model version that served it (OpenAI's answers have no field for it)."""
    return {**(headers or {}), VERSION_HEADER: info.version}


PRIORITY_HEADER = "x-sluice-priority"


def requested_priority(request: Request, *body_values: tuple[str, Any]) -> Priority | None:
    """The class a request asks for: the `x-sluice-priority` header and the body's `service_tier` /
    `priority` fields (names: interactive, standard, batch; OpenAI's `flex` is batch, `priority`
    is interactive, `auto`/`default` keep the tenant's). If several are given the lowest counts;
    the gateway never lets a request rise above its tenant's default class."""
    return priority_of(request.headers.get(PRIORITY_HEADER), *body_values)


def priority_of(header: str | None, *body_values: tuple[str, Any]) -> Priority | None:
    """`requested_priority` from the `x-sluice-priority` header's value (or gRPC metadata's)."""
    found = [parse_priority(header, PRIORITY_HEADER)]
    for name, value in body_values:
        if value is not None and not isinstance(value, str):
            raise InvalidInput(f"'{name}' must be a string (interactive, standard or batch)", param=name)
        found.append(parse_priority(value, name))
    classes = [p for p in found if p is not None]
    return max(classes) if classes else None


def caller(request: Request, priority: Priority | None, estimated_tokens: float = 0.0, *,
           is_traced: bool = False, cache: CachePolicy | None = None, group: RequestGroup | None = None,
           likely_tokens: float | None = None) -> Caller:
    """`is_traced`: the client's trace context is read (`trace_context`: a header lookup that
    misses costs more than the rest of this, on every request): when the server exports traces,
    and for a generation, which an `openai-upstream` model passes on to its server even when it
    does not. `cache`: the request's `Cache-Control` policy if the caller read it already (else
    it is read here). `group`: the client request this call is one part of (`tenancy.RequestGroup`)."""
    headers = request.headers
    trace = trace_context(request) if is_traced else None
    if cache is None:
        cache = cache_policy(headers.get("cache-control"))
    return Caller(request_tenant(request), priority, estimated_tokens, trace, cache, group,
                  request.scope.get(BACKGROUND_SCOPE_KEY, False) is True, likely_tokens)


CALLING_KINDS = frozenset({"http-single", "openai-upstream"})
"""Runner kinds whose worker calls another server, which carries the caller's trace context on
(`wire.Submit.trace`) even when this server does not trace."""


def is_traced(gateway: Gateway, info: wire.ModelInfo) -> bool:
    """Whether a request to `info` reads its caller's trace context (`caller(is_traced=...)`):
    when the server exports traces, or when the model calls another server."""
    return gateway.is_tracing or info.kind in CALLING_KINDS


def trace_context(request: Request) -> wire.TraceContext | None:
    """The client's W3C trace context: its `traceparent` header and the `tracestate` that came
    with it (several `tracestate` headers are one list); None without a `traceparent`."""
    traceparent = request.headers.get("traceparent")
    if traceparent is None:
        return None
    return wire.TraceContext(traceparent, ",".join(request.headers.getlist("tracestate")))


MAX_TEXT_ITEMS = 2048
"""Texts in one request, on either protocol: OpenAI's own cap on an embeddings `input` list."""
MAX_TEXT_CHARS = 100_000


def check_texts(texts: list[str], what: str, param: str | None = None) -> list[str]:
    """The one check of a request's texts, shared by `/v1/embeddings` and KServe BYTES inputs so
    that both protocols refuse the same requests (400): none, more than `MAX_TEXT_ITEMS`, an
    empty string, or one longer than `MAX_TEXT_CHARS`. `what` names the field in messages."""
    if not texts:
        raise InvalidInput(f"{what} must not be empty", param=param)
    if len(texts) > MAX_TEXT_ITEMS:
        raise InvalidInput(f"{what} may hold at most {MAX_TEXT_ITEMS} items, got {len(texts)}", param=param)
    for text in texts:
        if not text:
            raise InvalidInput(f"{what} must not contain empty strings", param=param)
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidInput(f"{what} holds a text longer than {MAX_TEXT_CHARS} characters", param=param)
    return texts


def texts_or_token_ids(value: str | list[Any], param: str, token_id_limit: int, max_items: int,
                       items: str) -> list[str | list[int]]:
    """Inputs as OpenAI's API takes them in a completion's `prompt` or an embeddings `input`: a
    string, a list of token ids, or a list of either (a list of strings; a list of lists of token
    ids), at most `max_items` of them (`items` names them in the message). None may be empty."""
    if isinstance(value, str):
        inputs: list[Any] = [value]
    elif value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        inputs = [value]
    elif value and (all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value)):
        inputs = value
    else:
        raise InvalidInput(f"'{param}' must be a string, a list of token ids, or a list of either", param=param)
    if len(inputs) > max_items:
        raise InvalidInput(f"'{param}' holds {len(inputs)} {items}; one request takes at most {max_items}",
                           param=param)
    out: list[str | list[int]] = []
    for one in inputs:
        if not one:
            raise InvalidInput(f"'{param}' must not be empty", param=param)
        out.append(one if isinstance(one, str) else token_ids(one, param, token_id_limit))
    return out


def token_ids(ids: list[Any], param: str, limit: int) -> list[int]:
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limit for t in ids):
        raise InvalidInput(f"'{param}' token ids must be integers in [0, {limit})", param=param)
    return list(ids)


def likely_text_tokens(texts: list[str], max_tokens_per_text: int = 0) -> float:
    """A guess at a text's tokens (a token per three characters, where English averages four, plus
    two special tokens), which decides whether a request is too large for its tenant's limit at
    all: the bound (`estimate_text_tokens`) would refuse for good long texts that fit."""
    bound = max_tokens_per_text if max_tokens_per_text > 0 else math.inf
    return float(sum(min(len(text) // 3 + 2, bound) for text in texts))


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """`content` as a JSON answer (msgspec-encoded)."""
    return Response(msgspec.json.encode(content), status_code=status, media_type="application/json",
                    headers=headers)


def page_limit(query: Mapping[str, str], default: int, most: int) -> int:
    """A list endpoint's `limit` (OpenAI's list APIs): an integer in [1, most], `default` when not given."""
    limit = parse_count(query.get("limit", str(default)))
    if limit is None or not 1 <= limit <= most:
        raise InvalidInput(f"'limit' must be an integer in [1, {most}]", param="limit")
    return limit


def page_order(query: Mapping[str, str]) -> str:
    """A list endpoint's `order`: "desc" (the default: newest first) or "asc"."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidInput("'order' must be 'asc' or 'desc'", param="order")
    return order


def items_page(items: list[Any], query: Mapping[str, str], most: int, kind: str, where: str) -> Response:
    """A page of `items` (oldest first, each with an `id`): `order` (desc, the default, or asc),
    `after` (an item's id: a 400 saying there is no such `kind` in `where` if none has it), `limit`."""
    limit, order = page_limit(query, 20, most), page_order(query)
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise InvalidInput(f"no {kind} {after[:80]!r} in {where}", param="after")
        ordered = ordered[ids.index(after) + 1:]
    return list_response(ordered[:limit], len(ordered) > limit)


def list_response(data: list[dict[str, Any]], has_more: bool) -> Response:
    """OpenAI's list object: a page of `data` (each with an `id`), and whether more follow."""
    return json_response({"object": "list", "data": data, "has_more": has_more,
                          "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})


def decode_json(body: bytes, kind: type[T]) -> T:
    """A JSON body decoded and validated into `kind`; a 400 naming the offending field otherwise."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"invalid request: {exc}", param=_param_of(str(exc))) from exc
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise unreadable_json(exc, body) from exc


def unreadable_json(exc: msgspec.DecodeError | RecursionError | UnicodeDecodeError, body: bytes) -> InvalidInput:
    """The 400 for a body msgspec could not read (`json_error_reason`)."""
    return InvalidInput(f"request body is not valid JSON: {json_error_reason(exc, body)}")


def json_error_reason(exc: msgspec.DecodeError | RecursionError | UnicodeDecodeError, body: bytes) -> str:
    """Why msgspec could not read `body` as JSON, in words the client can act on: the one wording
    of every JSON route's refusal (OpenAI, KServe v2, admin; a batch's input lines). Besides
    malformed JSON, msgspec raises `RecursionError` for nesting deeper than the interpreter's
    stack allows (~1,000 levels fit in a 2 KB body), `UnicodeDecodeError` for a string holding
    bytes that are not UTF-8, and, for a string holding a lone UTF-16 surrogate escape
    (`"\\ud800"`: JSON can write it, but it is no Unicode character, so no text or tokenizer
    could take it), a `DecodeError` that says the input was truncated or a surrogate pair is
    invalid, which would send the client looking for the wrong fault."""
    if isinstance(exc, RecursionError):
        return "it is nested too deeply"
    if isinstance(exc, UnicodeDecodeError):
        return f"a string holds bytes that are not UTF-8 ({exc.reason})"
    if _holds_lone_surrogate(body):
        return ("a string holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair): "
                "it is not valid Unicode text")
    return str(exc)


def _holds_lone_surrogate(body: bytes) -> bool:
    """Read again (on the error path only) by the standard library, which keeps a lone surrogate
    escape in the string it makes, `body` is JSON but for a string that UTF-8 cannot encode."""
    if b"\\u" not in body:
        return False
    try:
        value = json.loads(body)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    except (ValueError, RecursionError):  # not JSON for other reasons (UnicodeDecodeError among them)
        return False
    return False


def _param_of(message: str) -> str | None:
    """The top-level field a msgspec validation message points at, e.g. `dimensions`."""
    for marker in ("at `$.", "missing required field `"):
        if marker in message:
            return message.split(marker, 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0]
    return None
