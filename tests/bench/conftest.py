"""A real HTTP/1.1 server on loopback whose answer depends on the request path, for the sender's tests.

    /ok       200 (keep-alive)             /close    200 with `Connection: close`, then closes
    /busy     503 with `Retry-After: 1`    /stall    never answers
    /reject   429 without `Retry-After`    /drop     closes without answering
    /lasting  200 with `Keep-Alive: timeout=3`
    /slow     200 after SLOW_S             /garbage  answers with bytes that are not HTTP

It runs on the test's own event loop and counts connections, so tests can check the client's cap.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

import httptools
import pytest

SLOW_S = 0.05

_BODY = b'{"ok":true}'


def _answer(status: str, *headers: str) -> bytes:
    head = [f"HTTP/1.1 {status}", "Content-Type: application/json", f"Content-Length: {len(_BODY)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + _BODY


_ANSWERS = {
    b"/ok": _answer("200 OK"),
    b"/slow": _answer("200 OK"),
    b"/busy": _answer("503 Service Unavailable", "Retry-After: 1"),
    b"/reject": _answer("429 Too Many Requests"),
    b"/close": _answer("200 OK", "Connection: close"),
    b"/lasting": _answer("200 OK", "Keep-Alive: timeout=3"),
}


class ScriptedServer:
    """Counts connections: `num_accepted` in all, `peak_open` at once."""

    def __init__(self) -> None:
        self.num_accepted = 0
        self.num_open = 0
        self.peak_open = 0
        self.num_requests = 0
        self.port = 0

    def connection_opened(self) -> None:
        self.num_accepted += 1
        self.num_open += 1
        self.peak_open = max(self.peak_open, self.num_open)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


class _ScriptedProtocol(asyncio.Protocol):
    def __init__(self, server: ScriptedServer) -> None:
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._path = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._server.connection_opened()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.num_open -= 1

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self._path = url

    def on_message_complete(self) -> None:
        self._server.num_requests += 1
        transport, path = self._transport, self._path
        assert transport is not None
        if path == b"/stall":
            return
        if path == b"/drop":
            transport.close()
        elif path == b"/garbage":
            transport.write(b"this is not HTTP\r\n\r\n")
        elif path == b"/slow":
            asyncio.get_running_loop().call_later(SLOW_S, self._reply, _ANSWERS[path])
        else:
            self._reply(_ANSWERS[path])
            if path == b"/close":
                transport.close()

    def _reply(self, answer: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(answer)


@pytest.fixture
async def scripted_server() -> AsyncIterator[ScriptedServer]:
    state = ScriptedServer()
    server = await asyncio.get_running_loop().create_server(lambda: _ScriptedProtocol(state), "127.0.0.1", 0)
    state.port = server.sockets[0].getsockname()[1]
    async with server:
        yield state
        server.close()
