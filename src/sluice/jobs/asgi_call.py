"""Calling the serving app in-process: an item takes the exact path an online request takes.

No socket and no HTTP client: an ASGI scope is built for the item's POST and the app's
`send` messages are collected. The app is passed in as a callable, so nothing here imports it.
An app with an `answer_early(scope, body)` (`api.app.SluiceApp`) is asked that first, as the HTTP
protocol asks it for a small request: a one-shot inference item then skips the middleware stack
and the ASGI messages, and is screened and answered by the same route code.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Message = MutableMapping[str, Any]
AsgiApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Message]],
                    Callable[[Message], Awaitable[None]]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class AppResponse:
    status_code: int
    request_id: str
    body: bytes
    retry_after_s: float | None = None
    """When the answer says to come back (`retry-after-ms`, else `Retry-After` in seconds)."""
    limit: str | None = None
    """The tenant limit that refused it (`x-sluice-limit`), if one did."""
    should_retry: bool = True
    """False when the answer says retrying cannot help (`x-should-retry: false`)."""


def retry_after_s(headers: dict[bytes, bytes]) -> float | None:
    """The delay a refusal asks for; an HTTP-date `Retry-After` (which sluice never sends) is ignored."""
    for name, scale in ((b"retry-after-ms", 0.001), (b"retry-after", 1.0)):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            continue
        if math.isfinite(value) and value >= 0:
            return value * scale
    return None


async def call(app: AsgiApp, method: str, url: str, body: bytes, headers: list[tuple[bytes, bytes]],
               scope_extras: dict[str, Any]) -> AppResponse:
    chunks: list[bytes] = []
    status_code, answer_headers = await call_streaming(app, method, url, body, headers, scope_extras,
                                                       lambda status, chunk: chunks.append(chunk))
    return app_response(status_code, answer_headers, b"".join(chunks))


async def call_streaming(app: AsgiApp, method: str, url: str, body: bytes, headers: list[tuple[bytes, bytes]],
                         scope_extras: dict[str, Any], on_body: Callable[[int, bytes], Awaitable[None] | None]
                         ) -> tuple[int, dict[bytes, bytes]]:
    """`call`, handing each piece of the answer's body to `on_body(status, piece)` as the app sends
    it (a stream's events as they come); returns the status and headers once the answer is complete."""
    path, _, query = url.partition("?")
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": query.encode(), "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        "headers": [(b"content-length", str(len(body)).encode()), *headers], **scope_extras,
    }
    early = getattr(app, "answer_early", None)
    answer = early(scope, body) if early is not None else None
    if answer is not None:
        response = await answer if inspect.isawaitable(answer) else answer
        await _handed(on_body(response.status_code, bytes(response.body)))
        return response.status_code, {bytes(k).lower(): bytes(v) for k, v in response.raw_headers}
    sent_body = False

    async def receive() -> Message:
        nonlocal sent_body
        if sent_body:  # the "client" stays connected until the answer is complete
            await asyncio.Event().wait()
        sent_body = True
        return {"type": "http.request", "body": body, "more_body": False}

    status_code = 500
    answer_headers: dict[bytes, bytes] = {}

    async def send(message: Message) -> None:
        nonlocal status_code
        if message["type"] == "http.response.start":
            status_code = int(message["status"])
            answer_headers.update((bytes(k).lower(), bytes(v)) for k, v in message.get("headers", []))
        elif message["type"] == "http.response.body" and message.get("body"):
            await _handed(on_body(status_code, bytes(message["body"])))

    await app(scope, receive, send)
    return status_code, answer_headers


async def _handed(result: Awaitable[None] | None) -> None:
    if result is not None:
        await result


def app_response(status_code: int, headers: dict[bytes, bytes], body: bytes) -> AppResponse:
    request_id = headers.get(b"x-request-id", b"").decode("latin-1")
    if status_code < 400:
        return AppResponse(status_code, request_id, body)
    limit = headers.get(b"x-sluice-limit")
    should_retry = headers.get(b"x-should-retry", b"").lower() != b"false"
    return AppResponse(status_code, request_id, body, retry_after_s(headers),
                       limit.decode("latin-1") if limit else None, should_retry)
