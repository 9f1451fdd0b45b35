"""The Starlette application: routes of both protocols, request ids, body limits, the error table.

    request ─▶ RequestIdMiddleware ─▶ CompressionMiddleware ─▶ AuthMiddleware ─▶ HotRoutes
                                                                   (tenant)     │
          endpoint ◀──(POST infer | embeddings)─────────────────────────────────┤
          Starlette: ExceptionMiddleware ─▶ route ◀─────────────────────────────┘
                        (openai | kserve | admin | metrics)

    SluiceApp.answer_early: for a small body, the HTTP protocol's own path to the same id,
    authentication and hot route (`api.http_protocol`): a refusal is written before any task
    exists, the rest runs as a task of its own and is written in one go (compressed by the
    same rules as the middleware's: `api.compression`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice import metrics
from sluice.api import admin, completions, conversations, kserve, openai, responses, tokenize, triton, triton_generate
from sluice.api.access_log import CANCELLED_STATUS, AccessLog
from sluice.api.auth import AuthMiddleware, authenticate, presented_key
from sluice.api.common import GONE_SCOPE_KEY, VALID_REQUEST_ID, HotRoute, check_body_size, request_id
from sluice.api.compression import CompressionMiddleware, compress_response
from sluice.api.encoding import decoded_body
from sluice.api.errors import LIMIT_HEADER, error_response, protocol_of
from sluice.errors import InvalidInput, NotFound, SluiceError
from sluice.gateway import Gateway
from sluice.gateway.tenancy import Tenancy
from sluice.jobs.store import JobStore

if TYPE_CHECKING:
    from sluice.jobs.background import BackgroundResponses

log = logging.getLogger("sluice.api")

_ID_PREFIX = f"{uuid.uuid4().hex[:12]}-"  # unique per process; a counter makes each request's id unique
_ID_COUNTER = itertools.count(1)
LIMIT_HEADER_BYTES = LIMIT_HEADER.encode()


@dataclass(frozen=True, slots=True)
class ApiConfig:
    body_limit_bytes: int = 32 * 1024 * 1024
    access_log: bool = True
    """One JSON line on stderr per finished request (`api.access_log`; `--no-access-log`)."""


def assign_request_id(scope: Scope) -> str:
    """The request's id: the one already given to it, else the client's `x-request-id` if sane, else a new one."""
    rid = scope.get("sluice.request_id")
    if isinstance(rid, str):
        return rid
    incoming = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"").decode("latin-1")
    rid = request_id_for(incoming)
    scope["sluice.request_id"] = rid
    return rid


def request_id_for(incoming: str | None) -> str:
    """The id a request is known by: the client's `x-request-id` if it sent a sane one, else a new one."""
    return incoming if incoming and VALID_REQUEST_ID.match(incoming) else f"{_ID_PREFIX}{next(_ID_COUNTER):x}"


class RequestIdMiddleware:
    """Gives every request an id (the client's `x-request-id` if sane) and echoes it back; with
    an `AccessLog`, logs each request that came through the server once it has ended."""

    def __init__(self, app: ASGIApp, access_log: AccessLog | None = None) -> None:
        self.app = app
        self._access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = (b"x-request-id", assign_request_id(scope).encode())
        access_log = self._access_log
        if access_log is None or not access_log.is_logged(scope):
            async def send_with_id(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", []), header]
                await send(message)

            await self.app(scope, receive, send_with_id)
            return
        await self._logged(access_log, scope, receive, send, header)

    async def _logged(self, access_log: AccessLog, scope: Scope, receive: Receive, send: Send,
                      header: tuple[bytes, bytes]) -> None:
        """The request, then its access-log line: the status answered, or 499 and `cancelled` when
        the client went away before the answer was whole (a stream it stopped reading, too)."""
        answer: dict[str, Any] = {"status": None, "is_complete": False, "limit": None}

        async def send_logged(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = message["headers"] = [*message.get("headers", []), header]
                answer["status"] = message["status"]
                if message["status"] == 503:
                    answer["limit"] = next((v.decode("latin-1") for k, v in headers if k == LIMIT_HEADER_BYTES), None)
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                answer["is_complete"] = True
            await send(message)

        async def receive_watched() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not answer["is_complete"]:
                scope[GONE_SCOPE_KEY] = True
            return message

        status = 500  # what uvicorn answers an exception with
        try:
            await self.app(scope, receive_watched, send_logged)
            status = answer["status"] or 500  # (uvicorn's answer to an app that sent none)
        finally:
            if scope.get(GONE_SCOPE_KEY):
                status = answer["status"] if answer["status"] and not answer["is_complete"] else CANCELLED_STATUS
            access_log.http(scope, status, answer["limit"])


class HotRoutes:
    """Sends the one-shot inference routes (`HotRoute`) straight to their endpoints; everything
    else to `app`.

    Starlette's path to an endpoint (the router trying each route's pattern in turn, the server
    error and exception middlewares, the per-route exception wrapper) cost ~64 µs of CPU per
    request here, a sixth of the gateway's work per request at 2x overload. These endpoints
    build their whole response before sending it, so an exception is always answered by the
    same error table as the rest of the app.
    """

    def __init__(self, app: ASGIApp, routes: Sequence[HotRoute[Any]]) -> None:
        self.app = app
        self._routes = tuple(routes)

    def match(self, scope: Scope) -> HotRoute[Any] | None:
        """The hot route a request is for (its path parameters then in `scope`), or None."""
        if scope["type"] == "http" and scope["method"] == "POST":
            for route in self._routes:
                match, child_scope = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child_scope)
                    return route
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.match(scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        response = await _guarded(request, route.endpoint(request))
        await response(scope, receive, send)


class SluiceApp:
    """The ASGI application (request ids, authentication, the routes), and its early answers.

    `answer_early(scope, body)` is for the HTTP protocol (`api.http_protocol`), which calls it
    with a whole small body as soon as it is in, before the request has a task. For a one-shot
    inference route it gives the request its id, authenticates it and runs the route's `screen`:
    a refusal is returned as a response to write at once (the 503s of an overloaded model, most
    often: under 2x overload most requests), anything else as the awaitable of the rest
    (`HotRoute.respond`), for the protocol to run as the request's task and write. Either way
    the request skips the middleware stack, the body's reading through ASGI and the response's
    two trips through ASGI `send`. A refusal costs no task, and is answered from the event loop's
    I/O step instead of after every task the loop already holds (under 2x overload those waits
    made the tail of refusals' latency: benchmarks/README.md). Other requests return None: they
    go through `__call__`.
    """

    def __init__(self, hot: HotRoutes, tenancy: Tenancy, access_log: AccessLog | None = None,
                 routes: Sequence[BaseRoute] = ()) -> None:
        """`routes`: all the app's, for authentication to tell a missing route (404) from a key's
        scope (403) (`auth.AuthMiddleware`)."""
        self._app = RequestIdMiddleware(CompressionMiddleware(AuthMiddleware(hot, tenancy, routes)), access_log)
        self._hot = hot
        self._tenancy = tenancy
        self._access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)

    def refused(self, scope: Scope, status: int) -> None:
        """The HTTP protocol refused a request before any app saw it (`http_protocol.Refused`)."""
        if self._access_log is not None:
            self._access_log.refused(scope, status)

    def answer_early(self, scope: Scope, body: bytes) -> Response | Awaitable[Response] | None:
        """A refusal to write now, the awaitable of the answer, or None: not a request for this."""
        route = self._hot.match(scope)
        if route is None:
            return None
        rid = assign_request_id(scope)
        request = Request(scope)
        try:
            authenticate(scope, self._tenancy)
            check_body_size(len(body), route.body_limit_bytes)
            body = decoded_body(body, request.headers.get("content-encoding"), route.body_limit_bytes)
            screened = route.screen(request, body)
        except SluiceError as exc:
            refusal = error_response(exc, protocol_of(scope["path"]), rid)
            if self._access_log is not None:
                self._access_log.http(scope, refusal.status_code,
                                      refusal.headers.get(LIMIT_HEADER) if refusal.status_code == 503 else None)
            return refusal
        except Exception:  # a bug: the ASGI path meets it again, and logs it with the request
            return None
        return self._respond(route, request, body, screened, rid)

    async def _respond(self, route: HotRoute[Any], request: Request, body: bytes, screened: Any, rid: str) -> Response:
        try:
            response = await _guarded(request, route.respond(request, body, screened))
            response = await compress_response(response, request.headers.get("accept-encoding"),
                                             request.scope["path"])
        except asyncio.CancelledError:  # the client went away (`http_protocol`'s `connection_lost`)
            if self._access_log is not None:
                request.scope[GONE_SCOPE_KEY] = True
                self._access_log.http(request.scope, CANCELLED_STATUS)
            raise
        response.raw_headers.append((b"x-request-id", rid.encode()))
        if self._access_log is not None:
            self._access_log.http(request.scope, response.status_code,
                                  response.headers.get(LIMIT_HEADER) if response.status_code == 503 else None)
        return response


async def _guarded(request: Request, answer: Awaitable[Response]) -> Response:
    """A hot route's response, or its error's, from the same table as the rest of the app."""
    try:
        return await answer
    except SluiceError as exc:
        return await _on_sluice_error(request, exc)
    except Exception as exc:
        return await _on_bug(request, exc)


def _protocol(request: Request) -> str:
    return protocol_of(request.scope["path"])


async def _on_sluice_error(request: Request, exc: Exception) -> Response:
    return error_response(exc, _protocol(request))


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        error: SluiceError = NotFound(f"no route for {request.method} {request.url.path}")
    else:
        error = InvalidInput(f"{exc.detail} ({request.method} {request.url.path})")
    response = error_response(error, _protocol(request))
    response.status_code = exc.status_code
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _on_bug(request: Request, exc: Exception) -> Response:
    log.exception("internal error on %s %s (request %s)", request.method, request.url.path,
                  request_id(request))
    return error_response(exc, _protocol(request))


def _metrics_route(gateway: Gateway) -> Route:
    async def scrape(request: Request) -> Response:
        gateway.tenancy.check_scrape(presented_key(request.scope))
        gateway.refresh_metrics()
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    return Route("/metrics", scrape, methods=["GET"])


def build_app(
    gateway: Gateway,
    config: ApiConfig | None = None,
    lifespan: Callable[[Starlette], AbstractAsyncContextManager[Any]] | None = None,
    extra_routes: Sequence[BaseRoute] = (),
    responses_store: JobStore | None = None,
    background_responses: BackgroundResponses | None = None,
) -> SluiceApp:
    """`extra_routes`: optional services mounted beside the inference APIs (e.g. `api.batches`).
    `responses_store`: where the Responses API keeps responses (None: it keeps none);
    `background_responses`: what runs its background responses (None: they are refused)."""
    config = config or ApiConfig()
    routes = [
        *openai.routes(gateway, config.body_limit_bytes),
        *completions.routes(gateway, config.body_limit_bytes),
        *responses.routes(gateway, config.body_limit_bytes, responses_store, background_responses),
        *conversations.routes(responses_store, config.body_limit_bytes),
        *tokenize.routes(gateway, config.body_limit_bytes),
        *triton.routes(gateway),  # before kserve's: /v2/models/stats is not a model's metadata
        *kserve.routes(gateway, config.body_limit_bytes),
        *triton_generate.routes(gateway, config.body_limit_bytes),
        *admin.routes(gateway),
        _metrics_route(gateway),
        *extra_routes,
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={SluiceError: _on_sluice_error, HTTPException: _on_http_error, Exception: _on_bug},
        lifespan=lifespan,
    )
    # no 307 to the path without its trailing slash (an empty body no client reads as an error,
    # and a POST's body to send again): a path no route has is a 404 in the protocol's shape
    app.router.redirect_slashes = False
    hot = HotRoutes(app, [route for route in routes if isinstance(route, HotRoute)])
    return SluiceApp(hot, gateway.tenancy, AccessLog(gateway.now) if config.access_log else None, routes)
