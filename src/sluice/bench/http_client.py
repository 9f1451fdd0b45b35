"""A lean HTTP/1.1 client for the load generator's hot path: keep-alive connections, no task per request.

Why not aiohttp here: one `session.post` in its own Task cost 110-180 µs of generator CPU per
request on the two-core development machine (a task, context managers, header and response
objects), which at a few thousand req/s takes most of a core from the server under test. This
client does only what the generator needs, in callbacks on the event loop:

    send(index, data, started_s) ─┬─ an idle connection ──> write `data` (one prebuilt request)
                                  └─ none ──> FIFO queue; open a connection if under the cap
    answer complete (httptools) ──> on_done(index, status, has_retry_after)
                                ──> the connection takes the oldest queued request, or goes idle

Invariants:

- a connection carries at most one request at a time (no pipelining);
- every request given to `send` gets exactly one `on_done` call while the pool is open: its
  answer, or `TRANSPORT_ERROR` when the connection is refused, reset or closed before the answer
  is complete, the answer is not valid HTTP, or the request is older than `request_timeout_s`
  (one periodic sweep checks that, not a timer per request); requests still outstanding when the
  pool closes get none;
- at most `max_connections` connections are open or being opened (0: no cap); opening one is
  the only thing that runs as a task;
- a connection is reused only if the server keeps it alive (no `Connection: close`), and is
  closed after `idle_timeout_s` unused, before the server's own keep-alive timeout can close it
  just as a new request is written to it (that race showed as a few transport errors in a run).

Answers must be delimited by `Content-Length` or chunked encoding; one whose body ends only at
EOF counts as a transport error.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Self, cast
from urllib.parse import urlsplit

import httptools

from sluice.bench.stats import TRANSPORT_ERROR

IDLE_TIMEOUT_S = 2.0
"""Idle connections are closed after this long, well inside common servers' keep-alive timeouts
(uvicorn's default is 5 s), unless the server says how long it keeps them (`Keep-Alive: timeout=N`
on its answers): then until `KEEP_ALIVE_MARGIN_S` before that. Closing idle connections early
makes every burst open new ones, and a request that waits for a new connection during a burst
waits for the server's accept too: on a 2-core machine at 2x overload, the 1% of requests that
did had 100-160 ms added, more than the p99 being measured."""
KEEP_ALIVE_MARGIN_S = 1.0
SWEEP_EVERY_S = 0.05
"""How often request timeouts are checked: a timed-out request is noticed up to this late."""

OnDone = Callable[[int, int, bool], None]
"""Called once per request with (its index, the HTTP status or TRANSPORT_ERROR, whether the answer
had a `Retry-After` header). It must not raise."""

_SKIPPED_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding"})


@dataclass(frozen=True, slots=True)
class Origin:
    """The server a pool connects to."""

    scheme: str
    host: str
    port: int

    @property
    def is_tls(self) -> bool:
        return self.scheme == "https"


def split_url(url: str) -> tuple[Origin, str]:
    """(origin, request target) of an http:// or https:// URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"need an http:// or https:// URL with a host, got {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Origin(parts.scheme, parts.hostname, port), target


def keep_alive_timeout_s(value: bytes) -> float | None:
    """The `timeout` of a `Keep-Alive` header (`timeout=5, max=1000`), or None."""
    for part in value.split(b","):
        key, _, number = part.strip().partition(b"=")
        if key.lower() == b"timeout" and number.strip().isdigit():
            return float(number.strip())
    return None


def post_head(url: str, headers: Mapping[str, str]) -> bytes:
    """A POST to `url` with `headers`, up to and including `Content-Length: `; encode it once per workload.

    `Host` comes from the URL; `Content-Length` is added per request by `post_request`.
    """
    _, target = split_url(url)
    netloc = urlsplit(url).netloc.rpartition("@")[2]
    lines = [f"POST {target} HTTP/1.1", f"Host: {netloc}"]
    lines += [f"{name}: {value}" for name, value in headers.items() if name.lower() not in _SKIPPED_HEADERS]
    if any(c in f"{name}{value}" for name, value in headers.items() for c in "\r\n\0"):
        raise ValueError(f"header names and values cannot contain line breaks: {dict(headers)!r}")
    return ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")


def post_request(head: bytes, body: bytes) -> bytes:
    """The whole request: a `post_head` result, the body's length, the body."""
    return b"%b%d\r\n\r\n%b" % (head, len(body), body)


class _Connection(asyncio.Protocol):
    """One keep-alive connection. It owns its in-flight request; the pool owns which list it is in."""

    def __init__(self, pool: HttpPool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._has_retry_after = False
        self.index = -1
        """The request in flight, -1 when idle."""
        self.started_s = 0.0
        self.idle_since_s = 0.0
        self.is_closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def send(self, index: int, data: bytes, started_s: float) -> None:
        assert self.index < 0 and self._transport is not None, "a connection carries one request at a time"
        self.index, self.started_s, self._has_retry_after = index, started_s, False
        self._transport.write(data)

    def close(self, *, is_abort: bool = False) -> int:
        """Close now (`is_abort`: without flushing); returns the request it carried, or -1."""
        index, self.index = self.index, -1
        if self._transport is not None:
            self._transport.abort() if is_abort else self._transport.close()
        return index

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._pool.on_broken(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 11 and name.lower() == b"retry-after":
            self._has_retry_after = True
        elif len(name) == 10 and name.lower() == b"keep-alive":
            self._pool.on_keep_alive(value)

    def on_message_complete(self) -> None:
        index, self.index = self.index, -1
        if index >= 0:
            parser = self._parser
            self._pool.on_answer(self, index, parser.get_status_code(), self._has_retry_after,
                                 parser.should_keep_alive())

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        index, self.index = self.index, -1
        self._pool.on_lost(self, index)


class HttpPool:
    """Keep-alive connections to one origin, used as `async with HttpPool(...) as pool: pool.send(...)`."""

    def __init__(self, origin: Origin, on_done: OnDone, max_connections: int, request_timeout_s: float,
                 clock: Callable[[], float] = time.perf_counter, idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        if max_connections < 0 or not request_timeout_s > 0 or not idle_timeout_s > 0:
            raise ValueError(f"need max_connections >= 0 and positive timeouts, got {max_connections}, "
                             f"{request_timeout_s} s, {idle_timeout_s} s")
        self._idle_timeout_s = self._default_idle_timeout_s = idle_timeout_s
        self._keep_alive = b""  # the last `Keep-Alive` header read
        self._origin = origin
        self._on_done = on_done
        self._max_connections = max_connections
        self._timeout_s = request_timeout_s
        self._clock = clock
        self._ssl = ssl.create_default_context() if origin.is_tls else None
        self._open: set[_Connection] = set()
        self._idle: list[_Connection] = []
        """A stack: the most recently used connection goes out first."""
        self._waiting: deque[tuple[int, bytes, float]] = deque()
        """(index, request, started_s) with no connection yet, oldest first."""
        self._num_connecting = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._is_closed = False
        self.peak_connections = 0
        """The most connections open or being opened at once."""

    async def __aenter__(self) -> Self:
        self._spawn(self._sweep())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the sweep and any connecting, close every connection. Outstanding requests get no callback."""
        self._is_closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for connection in self._open:
            connection.close(is_abort=True)
        self._open.clear()
        self._idle.clear()
        self._waiting.clear()

    @property
    def num_connections(self) -> int:
        return len(self._open)

    def send(self, index: int, data: bytes, started_s: float) -> None:
        """Send request `index` (a whole `post_request`), handed to the pool at `started_s`.

        Its timeout counts from `started_s`, so time spent queued for a connection counts too.
        """
        if self._idle:
            self._idle.pop().send(index, data, started_s)
            return
        self._waiting.append((index, data, started_s))
        self._open_for_waiting()

    # Connection callbacks -------------------------------------------------------------------

    def on_answer(self, connection: _Connection, index: int, status: int, has_retry_after: bool,
                  is_keep_alive: bool) -> None:
        self._on_done(index, status, has_retry_after)
        if self._is_closed:
            return
        if is_keep_alive and not connection.is_closed:
            self._reuse(connection)
        else:
            connection.close()
            self._forget(connection)
            self._open_for_waiting()

    def on_lost(self, connection: _Connection, index: int) -> None:
        self._forget(connection)
        if self._is_closed:
            return
        if index >= 0:
            self._on_done(index, TRANSPORT_ERROR, False)
        self._open_for_waiting()

    def on_broken(self, connection: _Connection) -> None:
        """The server sent something that is not HTTP: fail the request, drop the connection."""
        self._drop(connection)
        self._open_for_waiting()

    def on_keep_alive(self, value: bytes) -> None:
        """The server said how long it keeps an idle connection: keep ours open until just before."""
        if value == self._keep_alive:  # the same on every answer: parsed once
            return
        self._keep_alive = value
        timeout_s = keep_alive_timeout_s(value)
        if timeout_s is not None and timeout_s > KEEP_ALIVE_MARGIN_S + self._default_idle_timeout_s:
            self._idle_timeout_s = timeout_s - KEEP_ALIVE_MARGIN_S

    # Internals --------------------------------------------------------------------------

    def _reuse(self, connection: _Connection) -> None:
        if self._waiting:
            connection.send(*self._waiting.popleft())
        else:
            connection.idle_since_s = self._clock()
            self._idle.append(connection)

    def _drop(self, connection: _Connection) -> None:
        index = connection.close(is_abort=True)
        self._forget(connection)
        if index >= 0 and not self._is_closed:
            self._on_done(index, TRANSPORT_ERROR, False)

    def _forget(self, connection: _Connection) -> None:
        if connection in self._open:
            self._open.remove(connection)
            with contextlib.suppress(ValueError):
                self._idle.remove(connection)

    def _open_for_waiting(self) -> None:
        """Open one connection per queued request that is not already waiting on one, up to the cap."""
        cap = self._max_connections
        while (not self._is_closed and len(self._waiting) > self._num_connecting
               and (cap == 0 or len(self._open) + self._num_connecting < cap)):
            self._num_connecting += 1
            self.peak_connections = max(self.peak_connections, len(self._open) + self._num_connecting)
            self._spawn(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        origin = self._origin
        connection: _Connection | None = None
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self), origin.host, origin.port, ssl=self._ssl),
                self._timeout_s)
        except (OSError, TimeoutError):
            connection = None
        finally:
            self._num_connecting -= 1
        if self._is_closed:
            if connection is not None:
                connection.close(is_abort=True)
            return
        if connection is None or connection.is_closed:
            # The oldest queued request is the one this connection would have carried.
            if self._waiting:
                self._on_done(self._waiting.popleft()[0], TRANSPORT_ERROR, False)
            self._open_for_waiting()
            return
        self._open.add(connection)
        self._reuse(connection)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            now_s = self._clock()
            self._expire(now_s - self._timeout_s)
            self._close_idle(now_s - self._idle_timeout_s)

    def _close_idle(self, cutoff_s: float) -> None:
        """Close connections idle since `cutoff_s`: before the server's keep-alive timeout closes
        them, when a request sent at that moment would meet the closing connection and fail."""
        idle = self._idle  # the least recently used at the bottom of the stack
        while idle and idle[0].idle_since_s <= cutoff_s:
            connection = idle.pop(0)
            connection.close()
            self._forget(connection)

    def _expire(self, cutoff_s: float) -> None:
        """Fail every request handed over at or before `cutoff_s`, closing the connections they were on."""
        waiting = self._waiting
        while waiting and waiting[0][2] <= cutoff_s:
            self._on_done(waiting.popleft()[0], TRANSPORT_ERROR, False)
        stale = [c for c in self._open if c.index >= 0 and c.started_s <= cutoff_s]
        for connection in stale:
            self._drop(connection)
        if stale:
            self._open_for_waiting()

    def _spawn(self, coro: Coroutine[None, None, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
