"""uvicorn's httptools protocol, noting when each request arrived and answering early refusals.

*Arrival.* A request's deadline counts from when it reached the server, not from when the event
loop got round to its handler: under load, a parsed request can wait tens of milliseconds for its
task to start (benchmarks/README.md, "Where a refusal's time goes"). The moment the parser sees a
request begin is kept in the ASGI scope (`RECEIVED_AT_SCOPE_KEY`, on the gateway's clock), and
the inference endpoints count the deadline, and admission's prediction, from it.

*Early answers.* For a POST whose whole body is small (a declared `Content-Length` within
uvicorn's read buffer, no `Expect: 100-continue`), the request's task is started only once the
body is in, and first the application's `answer_early(scope, body)` is asked
(`SluiceApp.answer_early`). A response it returns (a refusal) is written at once, from the
parser's callback, and no task is made (unless the client has stopped reading: then it waits
for the connection to drain, as any response does); an awaitable (the rest of a one-shot inference) becomes
the request's task, which writes its response in one write (and is cancelled, withdrawing the
request, if the client goes before it is written); None starts the ASGI task as
uvicorn would, with the whole body waiting for it.

    data_received ─▶ parser ─▶ on_headers_complete ─▶ _start_asgi_task ─(small POST)─▶ held
                             └▶ on_message_complete ─▶ answer_early(scope, body)
                                                         ├─ Response: written now
                                                         ├─ awaitable: a task awaits it and writes it
                                                         └─ None: the held ASGI task starts

*Bounds.* httptools keeps a request's head (its line and headers) in memory until it is whole,
and uvicorn sets no limit on it: a head past `MAX_HEAD_BYTES` is answered 431 and the connection
closed, so a client streaming headers cannot grow the gateway's memory without bound. Nor can one that
pipelines requests without reading the answers: uvicorn parses every request of a read and queues
them (a 50-byte GET queued took ~2 KB; 8 MB of them, 300 MB), so at most `MAX_PIPELINED` are
parsed ahead of the one being answered, and the rest of what was read waits unparsed, with reading
paused, until their turn. A connection that sends nothing is closed after the keep-alive timeout,
as an idle one is, and a request head still unfinished that long after its first read is answered
408 and closed (uvicorn has no such limit: a client trickling a header byte now and then held its
connection for ever); so is a body still unfinished `body_timeout_s` after its head (plus a second
for each `BODY_MIN_BYTES_PER_S` of it), in the route's error shape.

*Framing* (RFC 9112). An HTTP/1.1 request without one `Host` header is answered 400; a
`Transfer-Encoding` other than `chunked` alone (`gzip, chunked`: httptools read it as chunked and
handed on the body still gzipped) 501, and Transfer-Encoding in an HTTP/1.0 request 400
(`api.http_framing`); in the route's error shape, and the request never reaches the
application. httptools itself refuses two `Content-Length`s, or one beside `Transfer-Encoding`
(400). Every refusal closes the connection, lingering while the client may still be sending
(`api.http_lingering`), so that it reads the refusal rather than a reset.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, cast

from starlette.responses import Response
from starlette.types import Scope
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from sluice.api.common import RECEIVED_AT_SCOPE_KEY
from sluice.api.errors import error_json, protocol_of
from sluice.api.http_framing import framing_problem
from sluice.api.http_lingering import LingeringTransport
from sluice.clock import Clock
from sluice.gateway.ticket import defer_accounting, run_deferred

MAX_HEAD_BYTES = 64 * 1024
"""The most a request's line and headers may take (h11's own default is 16 KiB; nginx's 32 KiB)."""

MAX_PIPELINED = 32
"""Requests a connection may have parsed and waiting behind the one being answered."""
PARSE_PIECE_BYTES = 4096
"""A read larger than this is parsed a piece at a time, to stop at `MAX_PIPELINED`."""

BODY_TIMEOUT_S = 60.0
"""The default time a request's body has to arrive, once its head is in (`stamping_protocol`)."""
BODY_MIN_BYTES_PER_S = 16 * 1024
"""Each this many bytes of a body received give it one more second (a large upload is not cut
short; a body trickling in slower than this is): Apache's `mod_reqtimeout` `MinRate`."""

_NOTED_HEADERS = frozenset({b"host", b"transfer-encoding", b"expect"})

EarlyAnswer = Callable[[Scope, bytes], Response | Awaitable[Response] | None]
"""`SluiceApp.answer_early`: a response to write now, the awaitable of one, or None (the ASGI app's)."""
Refused = Callable[[Scope, int], None]
"""`SluiceApp.refused`: told of each refusal the protocol writes itself (its status), for the access log."""


def stamping_protocol(clock: Clock, answer_early: EarlyAnswer | None = None,
                      body_timeout_s: float = BODY_TIMEOUT_S, refused: Refused | None = None) -> type[Any]:
    """An `HttpToolsProtocol` subclass for `uvicorn.Config(http=...)` that stamps `clock.now()`
    on each request and, given `answer_early`, answers what it refuses before a task exists;
    `refused` is told of the refusals it writes itself (a 400, 408, 431 or 501: no app saw them).
    A request's body must arrive within `body_timeout_s` of its head, plus a second for each
    `BODY_MIN_BYTES_PER_S` of it (else 408 and the connection closed)."""
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s must be positive, got {body_timeout_s}")

    class SluiceHttpToolsProtocol(HttpToolsProtocol):
        _held: tuple[RequestResponseCycle, Any] | None = None
        _answering: tuple[RequestResponseCycle, asyncio.Task[None]] | None = None
        _current: RequestResponseCycle | None = None  # the request being answered (its task started)
        _next: deque[tuple[RequestResponseCycle, Any]] | None = None  # while `_answer_pipelined` runs
        _in_head = False  # between a request's first byte and the end of its headers
        _head_bytes = 0  # of its head, as httptools hands them over
        _head_streamed = 0  # bytes of reads that were all one unfinished head (httptools keeps a header until whole)
        _head_refusal: tuple[int, bytes, bytes] | None = None  # raised from a parser callback (`_HeadRefused`)
        _num_hosts = 0  # `Host` headers of the request being parsed
        _codings: list[bytes] | None = None  # its `Transfer-Encoding` values
        _in_body = False  # between the end of a request's head and the end of its body
        _body_timer: asyncio.TimerHandle | None = None
        _body_since = 0.0  # loop time the body's timer counts from
        _body_seen_since = 0  # `_body_seen` then
        _body_seen = 0  # of the current request's body
        _unparsed: bytes | None = None  # read, but not parsed yet: requests waiting for their turn
        _unparsed_at = 0
        _parsing = False
        _head_timer: asyncio.TimerHandle | None = None
        _refusal: tuple[int, bytes, bytes] | None = None  # status, body, content type: the connection's last answer
        _refused_cycle: RequestResponseCycle | None = None  # the request refused, when its head was read
        _refused_scope: Any = {}  # its scope, or the head's being read; empty when refused before a head began

        def data_received(self, data: bytes) -> None:
            if self._unparsed is not None:  # not read while paused; kept in order all the same
                self._unparsed = self._unparsed[self._unparsed_at:] + data
                self._unparsed_at = 0
                self.flow.pause_reading()
            elif len(data) <= PARSE_PIECE_BYTES:
                self._parse(data)
            else:
                self._unparsed, self._unparsed_at = data, 0
                self._parse_unparsed()

        def _parse_unparsed(self) -> None:
            """Parse what was read a piece at a time, and stop while `MAX_PIPELINED` requests wait
            for their turn: the rest is kept as read (uvicorn would parse it all into requests
            queued without bound, ~2 KB of memory for each 50-byte request), and reading pauses.
            A body of a declared length is parsed in one piece."""
            if self._parsing:
                return  # an answer written from within `_parse`: the loop below goes on
            self._parsing = True
            try:
                while (data := self._unparsed) is not None:
                    if self.parser is None or self.transport.is_closing():
                        self._unparsed = None
                    elif len(self.pipeline) >= MAX_PIPELINED:
                        self.flow.pause_reading()  # until an answer is written: on_response_complete
                        return
                    else:
                        start = self._unparsed_at
                        end = start + max(self._body_left(), PARSE_PIECE_BYTES)
                        if end >= len(data):
                            self._unparsed = None
                        self._unparsed_at = end
                        self._parse(memoryview(data)[start:end])
            finally:
                self._parsing = False

        def _body_left(self) -> int:
            """How much of the current request's declared body is still to come (0 if none is known)."""
            if self._in_head or self.cycle is None or not self.cycle.more_body:
                return 0
            for name, value in self.scope["headers"]:
                if name == b"content-length":
                    return max(int(value) - self._body_seen, 0) if value.isdigit() else 0
            return 0

        def on_body(self, body: bytes) -> None:
            self._body_seen += len(body)
            super().on_body(body)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._refusal is not None:
                if self._answered_before_refusal():
                    self._write_refusal()
            elif self._unparsed is not None:
                self._parse_unparsed()

        def _parse(self, data: bytes | memoryview) -> None:
            if self._refusal is not None:
                return  # the refusal is all that is left to write
            head_of = self.scope if self._in_head else None
            super().data_received(cast(bytes, data))  # httptools takes a memoryview as it is
            if head_of is not None and self._in_head and self.scope is head_of:  # all of it was that head's
                self._head_streamed += len(data)
                if self._head_streamed > MAX_HEAD_BYTES and not self.transport.is_closing():
                    self._refuse(*self._head_too_large())
            if self._in_head and self._head_timer is None and not self.transport.is_closing():
                # a head that did not come whole in one read (never so for a client's usual request)
                self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_timed_out)
            elif self._in_body and self._body_timer is None and not self.transport.is_closing():
                self._start_body_timer()  # a body that did not come whole with its head

        def _start_body_timer(self) -> None:
            self._body_since, self._body_seen_since = self.loop.time(), self._body_seen
            self._body_timer = self.loop.call_later(body_timeout_s, self._body_timed_out)

        def _body_timed_out(self) -> None:
            """A body still unfinished `body_timeout_s` after its timer started (and a second more for
            each `BODY_MIN_BYTES_PER_S` of it since): 408 and close, or only close if its request
            was answered already. Time the server did not read (paused: the body waits for its
            task, or the request for its turn) or had not asked for it yet (`Expect: 100-continue`)
            is not the client's."""
            self._body_timer = None
            if not self._in_body or self.transport.is_closing():
                return
            if self.flow.read_paused or self._unparsed is not None or self.cycle.waiting_for_100_continue:
                self._start_body_timer()
                return
            now = self.loop.time()
            due = self._body_since + body_timeout_s + (self._body_seen - self._body_seen_since) / BODY_MIN_BYTES_PER_S
            if now < due:
                self._body_timer = self.loop.call_later(due - now, self._body_timed_out)
            elif self.cycle.response_started:
                self.transport.close()
            else:
                message = f"the request body did not arrive within {body_timeout_s:g} s"
                self._refuse(408, error_json(message, "request_timeout", self._protocol()), JSON)

        def _head_too_large(self) -> tuple[int, bytes, bytes]:
            """The 431 of a head past `MAX_HEAD_BYTES`, in the error shape of the route its URL names."""
            message = f"the request's line and headers are over {MAX_HEAD_BYTES // 1024} KiB"
            return 431, error_json(message, "request_header_fields_too_large", self._protocol()), JSON

        def _protocol(self) -> str:
            """Which protocol's error shape the request being parsed takes (`errors.protocol_of`)."""
            return protocol_of(self.url.decode("latin-1"))

        def _may_be_sending(self) -> bool:
            """Whether the client may still be sending (its closing connection lingers: `api.http_lingering`)."""
            return self._refusal is not None or self._in_head or self._in_body or self._unparsed is not None

        def _on_linger(self) -> None:
            """The connection closes, lingering: no timer is needed, and no request will be answered."""
            self._unset_keepalive_if_required()
            self._cancel_timers()
            self._tell_gone()

        def _cancel_timers(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            lingering = LingeringTransport(cast(asyncio.Transport, transport), self._may_be_sending, self._on_linger)
            super().connection_made(lingering)  # type: ignore[arg-type]
            # a connection that never sends a request is idle: closed as a kept-alive one is
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

        def _head_timed_out(self) -> None:
            """A head still unfinished a keep-alive timeout after its first read: 408 and close, however
            slowly it still trickles in (data resets uvicorn's keep-alive timer, not this one)."""
            self._head_timer = None
            if self._in_head and not self.transport.is_closing():
                message = f"the request's line and headers did not arrive within {self.timeout_keep_alive:g} s"
                self._refuse(408, error_json(message, "request_timeout", self._protocol()), JSON)

        def on_message_begin(self) -> None:
            self._unset_keepalive_if_required()  # an early answer armed it within this same read
            super().on_message_begin()
            self._in_head, self._head_bytes, self._head_streamed, self._body_seen, self._num_hosts, self._codings = (
                True, 0, 0, 0, 0, None)
            self.scope[RECEIVED_AT_SCOPE_KEY] = clock.now()  # type: ignore[literal-required]

        def on_url(self, url: bytes) -> None:
            self.url += url  # uvicorn's own, inline, as `on_header`'s
            self._head_bytes += len(url)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._count_head(0)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_bytes += len(name) + len(value) + 4
            if self._head_bytes > MAX_HEAD_BYTES:
                self._count_head(0)
            name = name.lower()  # uvicorn's own, inline: this runs for every header of every request
            if name in _NOTED_HEADERS:
                if name == b"host":
                    self._num_hosts += 1
                elif name == b"expect":
                    self.expect_100_continue = self.expect_100_continue or value.lower() == b"100-continue"
                else:
                    self._codings = [*(self._codings or ()), value]
            self.headers.append((name, value))

        def _count_head(self, size: int) -> None:
            self._head_bytes += size
            if self._head_bytes > MAX_HEAD_BYTES:
                self._head_refusal = self._head_too_large()
                raise _HeadRefused  # httptools stops; uvicorn's `send_400_response` answers

        def on_headers_complete(self) -> None:
            self._in_head = False
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if self._num_hosts != 1 or self._codings is not None:
                problem = framing_problem(self._num_hosts, self._codings, self.parser.get_http_version())
                if problem is not None:
                    status, message, code = problem
                    self._head_refusal = (status, error_json(message, code, self._protocol()), JSON)
                    self._in_head = True  # the head refused, for the access log: its method and path
                    self.scope["method"] = self.parser.get_method().decode("ascii", "replace")
                    self.scope["path"] = self.url.decode("latin-1").partition("?")[0]
                    raise _HeadRefused  # the request is never started, and its body never read
            super().on_headers_complete()
            self._in_body = True

        def send_400_response(self, msg: str) -> None:
            if self._head_refusal is not None:
                self._refuse(*self._head_refusal)
            else:
                self._refuse(400, msg.encode("ascii"))

        def _refuse(self, status: int, message: bytes, content_type: bytes = TEXT) -> None:
            """A refusal of what a client sent (uvicorn's 400 for what it cannot parse, a 431 or a
            408): nothing more is read, and it is written, then the connection closed, once the
            answers to the requests before it are (uvicorn wrote it at once, so a client read it
            as the answer to its request still being made)."""
            in_head = self._in_head
            self._in_head = False
            self._unparsed = None
            if self._refusal is None:
                self._refusal = (status, message, content_type)
                self._refused_scope = self.scope if in_head else {}
                self.flow.pause_reading()
                cycle = self.cycle
                if cycle is not None and cycle.more_body and not cycle.response_complete:
                    # within a request's body (a chunk's size that is not one, a transfer coding
                    # that is not chunked): that request is the one refused, and is never started
                    self._refused_cycle = cycle
                    self._refused_scope = cycle.scope
                    self.pipeline = deque(entry for entry in self.pipeline if entry[0] is not cycle)
                    if self._held is not None and self._held[0] is cycle:
                        self._held = None
            if self._answered_before_refusal():
                self._write_refusal()

        def _answered_before_refusal(self) -> bool:
            """Whether every request read before what is refused has been answered."""
            last, refused = self.cycle, self._refused_cycle
            if last is None:
                return True
            if last is not refused:
                return last.response_complete  # answers are written in order
            current = self._current
            return not self.pipeline and (current is None or current is refused or current.response_complete)

        def _write_refusal(self) -> None:
            if self._refusal is None or self.transport.is_closing():
                return
            status, message, content_type = self._refusal
            content = [STATUS_LINE[status]]
            for name, value in self.server_state.default_headers:
                content += [name, b": ", value, b"\r\n"]
            content += [b"content-type: ", content_type, b"\r\ncontent-length: %d\r\n" % len(message),
                        b"connection: close\r\n\r\n", message]
            self.transport.write(b"".join(content))
            self.transport.close()  # lingering: the client may still be sending
            if refused is not None:
                refused(self._refused_scope, status)

        def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
            self._current = cycle
            if answer_early is None or app is not self.app or not _may_answer_early(cycle):
                super()._start_asgi_task(cycle, app)
            elif cycle.more_body:
                self._held = (cycle, app)  # until its body is in: on_message_complete
            elif self._next is not None:  # within the answer before: `_answer_pipelined` goes on
                self._next.append((cycle, app))
            else:
                self._answer_pipelined(cycle, app)

        def _answer_pipelined(self, cycle: RequestResponseCycle, app: Any) -> None:
            """A pipelined request, whole already. Writing an early answer starts the next request
            queued (uvicorn's `on_response_complete`): each is answered here in turn, not one
            within the other's call (a thousand pipelined refusals went past Python's recursion
            limit, and the rest of the connection's requests were never answered)."""
            self._next = queued = deque([(cycle, app)])
            try:
                while queued:
                    self._answer_or_start(*queued.popleft())
            finally:
                self._next = None

        def on_message_complete(self) -> None:
            self._in_body = False
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            super().on_message_complete()
            held = self._held
            if held is not None and held[0] is self.cycle:
                self._held = None
                self._answer_or_start(*held)

        def _answer_or_start(self, cycle: RequestResponseCycle, app: Any) -> None:
            assert answer_early is not None
            answer = answer_early(cast(Scope, cycle.scope), bytes(cycle.body))
            if answer is None:
                super()._start_asgi_task(cycle, app)
            elif isinstance(answer, Response) and not self.flow.write_paused:
                self._write(cycle, answer)
            else:  # the answer is not ready, or the client is not reading what it was sent
                task = self.loop.create_task(self._write_when_ready(cycle, answer))
                task.add_done_callback(self.tasks.discard)
                self.tasks.add(task)  # uvicorn's shutdown waits for the requests in self.tasks
                self._answering = (cycle, task)

        def connection_lost(self, exc: Exception | None) -> None:
            """A client gone before its early answer was written withdraws the request: the task
            making it is cancelled (uvicorn tells an ASGI task through `receive`; this one has none)."""
            super().connection_lost(exc)
            self._cancel_timers()
            self._tell_gone()

        def _tell_gone(self) -> None:
            """Tell the request being answered that its client has gone, and withdraw an early answer
            being made."""
            for cycle in (self._current, self.cycle):
                if cycle is not None and not cycle.response_complete:
                    # uvicorn tells only the request read last, which need not be the one being answered
                    # (pipelined behind it): that one went on, and wrote to the closed transport (a 500
                    # logged as an internal error under uvloop)
                    cycle.disconnected = True
                    cycle.message_event.set()
            answering, self._answering = self._answering, None
            if answering is not None and not answering[0].response_complete:
                answering[1].cancel()

        async def _write_when_ready(self, cycle: RequestResponseCycle, answer: Response | Awaitable[Response]) -> None:
            """Write `answer` once it is made and the client has read what it was sent before: until
            then this request's response is incomplete, so uvicorn reads no further request from
            the connection (a client that pipelines requests without reading the answers is held
            back by its own socket, not buffered without bound here).

            The request's accounting (metrics, the tenant's settlement) runs right after the
            write, in the same step (`gateway.ticket.defer_accounting`), or before waiting for a
            client that is not reading."""
            deferred = defer_accounting()
            try:
                response = answer if isinstance(answer, Response) else await answer
                if self.flow.write_paused and not cycle.disconnected:
                    run_deferred(deferred)
                    await self.flow.drain()
                if not cycle.disconnected:  # as uvicorn's own `send`: nothing to write to
                    self._write(cycle, response)
            finally:
                run_deferred(deferred)

        def _write(self, cycle: RequestResponseCycle, response: Response) -> None:
            """The whole response in one write (uvicorn's ASGI `send` writes head and body apart)."""
            content = [STATUS_LINE[response.status_code]]
            for name, value in (*self.server_state.default_headers, *response.raw_headers):
                content += [name, b": ", value, b"\r\n"]
            if not cycle.keep_alive:
                content.append(b"connection: close\r\n")
            content += [b"\r\n", bytes(response.body)]
            cycle.response_started = cycle.response_complete = True
            self.transport.write(b"".join(content))
            if not cycle.keep_alive:
                self.transport.close()
            self.on_response_complete()

    return SluiceHttpToolsProtocol


TEXT = b"text/plain; charset=utf-8"
JSON = b"application/json"


class _HeadRefused(Exception):
    """Raised from a parser callback: the request's head is refused (`_head_refusal`: past
    `MAX_HEAD_BYTES`, or its framing headers are wrong)."""


def _may_answer_early(cycle: RequestResponseCycle) -> bool:
    """A POST whose body is declared and fits the read buffer: holding its task until the body is
    in can neither stall the read (uvicorn pauses reading past `HIGH_WATER_LIMIT` until the task
    takes the body) nor leave a client waiting for `100 Continue`."""
    scope = cycle.scope
    if scope["method"] != "POST" or cycle.waiting_for_100_continue:
        return False
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.isdigit() and int(value) <= HIGH_WATER_LIMIT
    return False
