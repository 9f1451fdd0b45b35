"""The HTTP protocol notes when each request reached the server (a deadline counts from then), and
answers the requests the application refuses early without starting their tasks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Coroutine

import httpx
import uvicorn
from starlette.requests import Request
from starlette.responses import Response

from sluice.api.app import build_app
from sluice.api.common import arrival
from sluice.api.http_lingering import LINGER_BYTES
from sluice.api.http_protocol import (
    BODY_TIMEOUT_S,
    MAX_HEAD_BYTES,
    MAX_PIPELINED,
    PARSE_PIECE_BYTES,
    stamping_protocol,
)
from sluice.clock import MonotonicClock
from sluice.gateway import Gateway
from sluice.metrics import GatewayMetrics
from tests.conftest import free_port, until


class _StepClock:
    """Each reading is one second after the previous one."""

    def __init__(self) -> None:
        self.readings = 0

    def now(self) -> float:
        self.readings += 1
        return float(self.readings)


async def _echo_arrival(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    body = json.dumps({"received_at": scope.get("sluice.received_at")}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def test_each_request_carries_the_moment_its_first_bytes_were_parsed() -> None:
    clock = _StepClock()

    async def scenario() -> list[float]:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(_echo_arrival, host="127.0.0.1", port=port, loop="asyncio",
                                               http=stamping_protocol(clock), log_config=None, lifespan="off"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient() as client:
            stamps = [(await client.post(f"http://127.0.0.1:{port}/x", content=b"{}")).json()["received_at"]
                      for _ in range(3)]
        server.should_exit = True
        await serving
        return stamps

    assert asyncio.run(scenario()) == [1.0, 2.0, 3.0]  # one reading per request, on the given clock


def test_the_deadline_counts_from_the_stamp_unless_it_is_missing_or_from_the_future() -> None:
    def request(scope_extra: dict[str, object]) -> Request:
        return Request({"type": "http", "method": "POST", "path": "/", "headers": [], **scope_extra})

    assert arrival(request({"sluice.received_at": 7.5}), now=10.0) == 7.5
    assert arrival(request({}), now=10.0) == 10.0  # a batch job's item, run in-process
    assert arrival(request({"sluice.received_at": 12.0}), now=10.0) == 10.0  # another clock's reading



async def _slow_reader(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to `port` whose receive buffer is small (4 KiB): a client that reads its
    answers slowly, so the server's writes back up quickly."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock)

class _Recorder:
    """An ASGI app that echoes each request's body, and notes the paths it was called for."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        self.paths.append(scope["path"])
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})


def _refuse_path_refuse(scope, body: bytes) -> Response | None:
    if scope["path"] != "/refuse":
        return None
    return Response(b'{"error": "busy: ' + body + b'"}', status_code=503, media_type="application/json",
                    headers={"retry-after": "1"})


@contextlib.asynccontextmanager
async def _connected(app, answer_early, body_timeout_s: float = BODY_TIMEOUT_S) -> AsyncIterator[
        tuple[int, asyncio.StreamReader, asyncio.StreamWriter, uvicorn.Server]]:
    """A server with the protocol on a free port, and one connection to it: (port, reader, writer, server)."""
    port = free_port()
    protocol = stamping_protocol(_StepClock(), answer_early, body_timeout_s)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio", log_config=None,
                                           http=protocol, lifespan="off"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield port, reader, writer, server
    finally:
        writer.close()
        server.should_exit = True
        await serving


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
    body = await reader.readexactly(int(headers["content-length"]))
    return int(lines[0].split()[1]), headers, body


def _post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%b\r\n%b" % (path.encode(), len(body), extra, body)


def test_a_refused_request_is_answered_without_reaching_the_app_and_the_connection_goes_on() -> None:
    app = _Recorder()

    async def scenario() -> list[tuple[int, dict[str, str], bytes]]:
        async with _connected(app, _refuse_path_refuse) as (_, reader, writer, _):
            # pipelined: a refusal between two requests that go on, in one write
            writer.write(_post("/a", b"one") + _post("/refuse", b"two") + _post("/b", b"three"))
            answers = [await _read_response(reader) for _ in range(3)]
            writer.write(_post("/refuse", b"four"))  # the same connection, after a refusal
            answers.append(await _read_response(reader))
        return answers

    answers = asyncio.run(scenario())
    assert [(status, body) for status, _, body in answers] == [
        (200, b"one"), (503, b'{"error": "busy: two"}'), (200, b"three"), (503, b'{"error": "busy: four"}')]
    refused = answers[1][1]
    assert refused["retry-after"] == "1" and refused["content-type"] == "application/json"
    assert "date" in refused and "server" in refused  # uvicorn's own headers, as on every answer
    assert app.paths == ["/a", "/b"]  # the refused requests never reached the app


def test_requests_it_cannot_hold_go_to_the_app_untouched() -> None:
    """A body without a declared length, or one a client will send only after `100 Continue`,
    must not wait for its task; nor a body larger than uvicorn reads before the task takes it."""
    app = _Recorder()
    asked: list[str] = []

    def answer_early(scope, body: bytes) -> Response | None:
        asked.append(scope["path"])
        return None

    async def scenario() -> list[tuple[int, bytes]]:
        async with _connected(app, answer_early) as (_, reader, writer, _):
            writer.write(b"POST /chunked HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"3\r\nabc\r\n0\r\n\r\n")
            answers = [await _read_response(reader)]
            writer.write(b"POST /continue HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 100")
            writer.write(b"ok")
            answers.append(await _read_response(reader))
            big = b"x" * (1 << 17)
            writer.write(_post("/big", big))
            answers.append(await _read_response(reader))
            writer.write(_post("/small", b"s"))
            answers.append(await _read_response(reader))
        return [(status, body) for status, _, body in answers]

    assert asyncio.run(scenario()) == [(200, b"abc"), (200, b"ok"), (200, b"x" * (1 << 17)), (200, b"s")]
    assert asked == ["/small"]


def test_an_answer_made_later_is_written_whole_and_in_order() -> None:
    app = _Recorder()

    async def later(body: bytes) -> Response:
        await asyncio.sleep(0.05)
        return Response(b"later: " + body, headers={"x-answer": "later"})

    def answer_early(scope, body: bytes):
        return later(body) if scope["path"] == "/later" else _refuse_path_refuse(scope, body)

    async def scenario() -> list[tuple[int, dict[str, str], bytes]]:
        async with _connected(app, answer_early) as (port, reader, writer, _):
            writer.write(_post("/later", b"one") + _post("/refuse", b"two") + _post("/a", b"three"))
            answers = [await _read_response(reader) for _ in range(3)]
            writer.write(_post("/later", b"four"))  # the same connection goes on
            answers.append(await _read_response(reader))
            _, gone = await asyncio.open_connection("127.0.0.1", port)
            gone.write(_post("/later", b"five"))
            gone.close()  # gone before its answer is ready: nothing to write, nothing breaks
            await asyncio.sleep(0.1)
        return answers

    answers = asyncio.run(scenario())
    assert [(status, body) for status, _, body in answers] == [
        (200, b"later: one"), (503, b'{"error": "busy: two"}'), (200, b"three"), (200, b"later: four")]
    assert answers[0][1]["x-answer"] == "later" and answers[0][1]["content-length"] == "10"
    assert app.paths == ["/a"]


def test_a_client_gone_before_its_answer_is_ready_withdraws_the_making_of_it() -> None:
    """An early answer's task has no ASGI `receive` to learn of a disconnect from: the protocol
    cancels it (as a one-shot inference, that withdraws the request from its worker)."""
    outcomes: list[str] = []

    async def never(body: bytes) -> Response:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            outcomes.append("cancelled")
            raise
        return Response(b"too late")

    async def scenario() -> None:
        async with _connected(_Recorder(), lambda scope, body: never(body)) as (_, _reader, writer, _):
            writer.write(_post("/slow", b"x"))
            await asyncio.sleep(0.1)
            assert outcomes == []
            writer.close()
            await until(lambda: outcomes == ["cancelled"])

    asyncio.run(scenario())


def test_a_client_that_does_not_read_its_refusals_is_held_back_not_buffered() -> None:
    """A client pipelining requests without reading the answers must not make the server buffer
    them without bound: once the connection's send buffer is full the next refusal waits for it to
    drain, and the server reads no further request meanwhile."""
    app = _Recorder()
    body = b"x" * 8000  # each refusal echoes it: ~8 KB
    count = 1000  # ~8 MB of answers, far more than the sockets' own buffers take

    async def scenario() -> tuple[int, list[tuple[int, bytes]]]:
        async with _connected(app, _refuse_path_refuse) as (port, _, _, server):
            reader, writer = await _slow_reader(port)
            writer.write(b"".join(_post("/refuse", body) for _ in range(count)))
            most = 0
            for _ in range(100):  # 0.5 s of not reading
                await asyncio.sleep(0.005)
                buffered = [p.transport.get_write_buffer_size() for p in server.server_state.connections]
                most = max([most, *buffered])
            answers = [await _read_response(reader) for _ in range(count)]
            writer.close()
        return most, [(status, answer) for status, _, answer in answers]

    most, answers = asyncio.run(scenario())
    assert most < 256 * 1024, f"the server buffered {most} bytes for a client that did not read"
    assert answers == [(503, b'{"error": "busy: ' + body + b'"}')] * count  # all answered, in order, once read
    assert app.paths == []



def test_a_request_head_past_the_limit_is_refused_not_buffered() -> None:
    """httptools keeps a head in memory until it is whole, and uvicorn bounds it nowhere: one
    connection streaming headers grew the gateway by the ~300 MB it sent. Past `MAX_HEAD_BYTES`,
    many headers or one endless one, the answer is 431 and the connection is closed."""
    app = _Recorder()

    async def refused(head: list[bytes]) -> bytes:
        async with _connected(app, _refuse_path_refuse) as (_, reader, writer, _):
            answer = asyncio.create_task(reader.read())  # until the server closes
            for piece in head:  # one at a time, each read by the server before the next is sent
                if answer.done():
                    break
                writer.write(piece)
                await asyncio.sleep(0.001)
            return await asyncio.wait_for(answer, 5)

    def headers(size: int) -> bytes:
        return b"".join(b"x-%d: %s\r\n" % (i, b"v" * 100) for i in range(size // 100))

    many = [b"POST /a HTTP/1.1\r\nhost: x\r\n", headers(MAX_HEAD_BYTES)]
    endless = [b"GET /a HTTP/1.1\r\nx-big: ", *[b"v" * 16384] * 256]  # one header value, 4 MiB if let
    long_url = [b"GET /", *[b"a" * 16384] * 256]
    for head in (many, endless, long_url):
        answer = asyncio.run(refused(head))
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
        assert b"connection: close" in answer
    assert app.paths == []

    async def fine() -> tuple[int, dict[str, str], bytes]:
        async with _connected(app, _refuse_path_refuse) as (_, reader, writer, _):
            writer.write(_post("/ok", b"fine", headers(MAX_HEAD_BYTES // 2)))
            return await _read_response(reader)

    assert asyncio.run(fine())[0::2] == (200, b"fine")


def test_a_request_head_past_the_limit_is_refused_in_its_routes_error_shape() -> None:
    """The 431 of a head too large is the route's error, as every refusal the protocol writes
    itself: OpenAI's envelope under /v1, KServe's `{"error": ...}` under /v2 (it was plain text,
    which the openai SDK and tritonclient cannot read a message from)."""
    too_many = b"".join(b"x-%d: %s\r\n" % (i, b"v" * 100) for i in range(MAX_HEAD_BYTES // 100))
    for path in (b"/v1/embeddings", b"/v2/models/m/infer"):
        head = b"POST %b HTTP/1.1\r\nhost: x\r\n%b\r\n" % (path, too_many)
        (status, body), = _answers(asyncio.run(_written_until_closed(head)))
        assert status == 431
        error = json.loads(body)["error"]
        if path.startswith(b"/v1"):
            assert error["code"] == "request_header_fields_too_large" and "64 KiB" in error["message"]
        else:
            assert "64 KiB" in error


def test_a_thousand_refusals_pipelined_behind_a_slow_answer_are_all_answered_in_order() -> None:
    """Each early refusal written starts the next pipelined request: they were answered one within
    the other's call, and past Python's recursion limit the connection's remaining requests never
    were."""
    app = _Recorder()
    count = 1500
    release = asyncio.Event()

    async def later(body: bytes) -> Response:
        await release.wait()
        return Response(b"later: " + body)

    def answer_early(scope, body: bytes):
        return later(body) if scope["path"] == "/later" else _refuse_path_refuse(scope, body)

    async def scenario() -> list[tuple[int, bytes]]:
        async with _connected(app, answer_early) as (_, reader, writer, _):
            writer.write(_post("/later", b"first") + b"".join(_post("/refuse", b"%d" % i) for i in range(count)))
            await writer.drain()
            await asyncio.sleep(0.1)  # all parsed and queued behind the first (the test holds either way)
            release.set()
            answers = [await _read_response(reader) for _ in range(count + 1)]
        return [(status, body) for status, _, body in answers]

    assert asyncio.run(scenario()) == [(200, b"later: first")] + [
        (503, b'{"error": "busy: %d"}' % i) for i in range(count)]
    assert app.paths == []


def test_a_client_that_pipelines_without_reading_has_few_requests_parsed_ahead() -> None:
    """uvicorn parses every request of a read and queues it: 8 MB of pipelined GETs from a client
    that did not read grew the gateway by 300 MB. At most `MAX_PIPELINED` (and what one piece
    parsed holds) wait parsed; the rest waits as read, and every request is still answered in order."""
    app = _Recorder()
    count = 20000  # ~1 MB of requests

    def request(i: int) -> bytes:
        return _post("/p", b"%05d" % i)

    async def scenario() -> tuple[int, list[tuple[int, bytes]]]:
        async with _connected(app, None) as (port, _, _, server):
            reader, writer = await _slow_reader(port)
            writer.write(b"".join(request(i) for i in range(count)))
            most = 0
            for _ in range(60):  # 0.3 s of not reading
                await asyncio.sleep(0.005)
                most = max([most, *(len(p.pipeline) for p in server.server_state.connections)])
            answers = [await _read_response(reader) for _ in range(count)]
            writer.close()
        return most, [(status, answer) for status, _, answer in answers]

    most, answers = asyncio.run(scenario())
    assert most <= MAX_PIPELINED + PARSE_PIECE_BYTES // len(request(0)), f"{most} requests parsed and queued"
    assert answers == [(200, b"%05d" % i) for i in range(count)]


def test_a_connection_silent_or_slow_to_send_its_head_is_closed_after_the_keep_alive_timeout() -> None:
    """uvicorn arms its keep-alive timeout only after an answer, and each read resets it: a
    connection that never sent a byte, or trickled a header byte now and then (slowloris), was
    held for ever. Now the first is closed as an idle connection is; the second gets 408."""

    async def scenario() -> tuple[bytes, bytes, bytes]:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(_Recorder(), host="127.0.0.1", port=port, loop="asyncio",
                                               log_config=None, lifespan="off", timeout_keep_alive=1,
                                               http=stamping_protocol(_StepClock(), _refuse_path_refuse)))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        silent, _ = await asyncio.open_connection("127.0.0.1", port)
        trickling, trickle = await asyncio.open_connection("127.0.0.1", port)
        trickle.write(b"GET /v2/models/m HTTP/1.1\r\nhost: x\r\n")
        closed = asyncio.gather(asyncio.wait_for(silent.read(), 10), asyncio.wait_for(trickling.read(), 10))
        while not closed.done():  # a byte every 0.1 s, each a read that resets uvicorn's own timer
            trickle.write(b"x")
            await asyncio.sleep(0.1)
        working, work = await asyncio.open_connection("127.0.0.1", port)
        work.write(_post("/b", b"still served"))  # a connection that sends its request is served
        answer = await _read_response(working)
        server.should_exit = True
        await serving
        silent_end, trickled_end = await closed
        return silent_end, trickled_end, answer[2]

    silent_end, trickled_end, answer = asyncio.run(scenario())
    assert silent_end == b""
    assert trickled_end.startswith(b"HTTP/1.1 408 ") and b"connection: close" in trickled_end
    (_, body), = _answers(trickled_end)
    assert "did not arrive within 1 s" in json.loads(body)["error"]  # in its route's (KServe's) error shape
    assert answer == b"still served"


async def _later(body: bytes) -> Response:
    await asyncio.sleep(0.05)
    return Response(b"later: " + body)


def _later_or_refuse(scope, body: bytes):
    """Early answers: `/later`'s made after 50 ms, `/refuse`'s at once, the others the app's."""
    return _later(body) if scope["path"] == "/later" else _refuse_path_refuse(scope, body)


async def _written_until_closed(requests: bytes, app: _Recorder | None = None) -> bytes:
    """All a server with `_later_or_refuse` (and `app`) writes for `requests`, sent at once, until it closes."""
    async with _connected(app or _Recorder(), _later_or_refuse) as (_, reader, writer, _):
        writer.write(requests)
        return await asyncio.wait_for(reader.read(), 5)


def test_what_cannot_be_parsed_is_refused_after_the_answers_to_the_requests_before_it() -> None:
    """uvicorn wrote its 400 for bytes it could not parse at once and closed: a client that had
    pipelined a request before them read the 400 as that request's answer (and the request, still
    made, went unanswered). The 400 now comes after the answers before it, each in order."""
    scenario = _written_until_closed

    garbage = b"NOT HTTP\r\n\r\n"
    for requests, answers in [
        (_post("/later", b"one") + garbage, [b"later: one"]),  # an early answer made later
        (_post("/a", b"two") + garbage, [b"two"]),  # the app's
        (_post("/later", b"3") + _post("/refuse", b"4") + _post("/b", b"5") + garbage,
         [b"later: 3", b'{"error": "busy: 4"}', b"5"]),
    ]:
        written = asyncio.run(scenario(requests))
        bodies = [part.split(b"\r\n\r\n", 1)[1] for part in written.split(b"HTTP/1.1 ")[1:]]
        assert bodies == [*answers, b"Invalid HTTP request received."], written
        assert written.count(b"HTTP/1.1 400 ") == 1 and written.endswith(b"Invalid HTTP request received.")


def test_a_pipelined_request_being_answered_learns_that_its_client_has_gone() -> None:
    """uvicorn tells of a disconnect only the request it read last: one pipelined before it, being
    answered, never learnt (its work went on for nobody, and its answer was written to a closed
    transport, a 500 logged as an internal error under uvloop)."""
    told: list[str] = []
    started = asyncio.Event()

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await receive()  # the body
        if scope["path"] == "/wait":
            started.set()
            with contextlib.suppress(TimeoutError):
                told.append((await asyncio.wait_for(receive(), 8))["type"])  # until the client goes
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def scenario() -> None:
        async with _connected(app, None) as (_, reader, writer, _):
            writer.write(_post("/first", b"1") + _post("/wait", b"2") + _post("/last", b"3"))
            assert (await _read_response(reader))[2] == b"ok"
            await asyncio.wait_for(started.wait(), 5)
            writer.close()
            await until(lambda: told == ["http.disconnect"])

    asyncio.run(scenario())


def test_a_request_whose_body_cannot_be_parsed_is_refused_at_once_or_after_those_before_it() -> None:
    """A body that cannot be parsed (a chunk size that is not one, a transfer coding that is not
    chunked) refuses the request it belongs to: at once if it is the one being answered (its
    task, waiting for the body, is told the client has gone), else after the answers before it."""
    app = _Recorder()

    def scenario(requests: bytes) -> Coroutine[None, None, bytes]:
        return _written_until_closed(requests, app)

    bad_chunk = b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nffffffffffffffffffff\r\n"
    bad_coding = b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: xchunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    for requests, answers in [
        (bad_chunk, []),
        (bad_coding, []),
        (_post("/later", b"one") + _post("/a", b"two") + bad_chunk, [b"later: one", b"two"]),
    ]:
        written = asyncio.run(scenario(requests))
        bodies = [part.split(b"\r\n\r\n", 1)[1] for part in written.split(b"HTTP/1.1 ")[1:]]
        assert bodies == [*answers, b"Invalid HTTP request received."], written
    assert app.paths == ["/c", "/c", "/a"]  # the refused request queued behind others never started


def _answers(written: bytes) -> list[tuple[int, bytes]]:
    """Each answer's status and body, in what a server wrote (each with its Content-Length)."""
    answers = []
    while written:
        head, written = written.split(b"\r\n\r\n", 1)
        length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        answers.append((int(head[9:12]), written[:length]))
        written = written[length:]
    return answers


def test_a_transfer_coding_other_than_chunked_is_501_and_the_connection_closed() -> None:
    """RFC 9112 §6.1: a transfer coding the server does not understand is answered 501, and the
    connection closed (httptools read `gzip, chunked` as chunked, and the app got the body still
    gzipped as if it were the request's)."""
    app = _Recorder()

    def request(path: bytes, codings: bytes, version: bytes = b"1.1") -> bytes:
        return (b"POST %b HTTP/%b\r\nhost: x\r\n%b\r\n3\r\nabc\r\n0\r\n\r\n" % (path, version, codings))

    gzip_chunked = request(b"/v1/embeddings", b"transfer-encoding: gzip, chunked\r\n")
    written = asyncio.run(_written_until_closed(_post("/a", b"one") + gzip_chunked, app))
    assert [status for status, _ in _answers(written)] == [200, 501], written
    assert b"connection: close" in written and b"content-type: application/json" in written
    error = json.loads(_answers(written)[1][1])["error"]
    assert error["code"] == "unsupported_transfer_coding" and "gzip" in error["message"]
    # over two headers, on a KServe route: its error shape
    two_headers = request(b"/v2/models/m/infer", b"transfer-encoding: deflate\r\ntransfer-encoding: chunked\r\n")
    (status, body), = _answers(asyncio.run(_written_until_closed(two_headers, app)))
    assert status == 501 and "deflate" in json.loads(body)["error"]
    # RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding is faulty framing
    (status, _), = _answers(asyncio.run(_written_until_closed(request(b"/a", b"transfer-encoding: chunked\r\n",
                                                                       b"1.0"), app)))
    assert status == 400
    assert app.paths == ["/a"]  # none of them reached the app
    chunked = asyncio.run(_written_until_closed(request(b"/b", b"transfer-encoding: Chunked\r\nconnection: close\r\n"),
                                                app))
    assert _answers(chunked) == [(200, b"abc")]  # chunked alone, in any case, is served


def test_a_request_without_one_host_header_is_400() -> None:
    """RFC 9112 §3.2: an HTTP/1.1 request with no Host header, or more than one (which one names
    the server?), is answered 400. So is one with two Content-Lengths (httptools' own refusal)."""
    app = _Recorder()
    for head in (b"GET /v1/models HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n",
                 b"GET /v1/models HTTP/1.1\r\nhost: a\r\nHost: a\r\n\r\n",
                 b"GET /v1/models HTTP/1.1\r\naccept: */*\r\n\r\n"):
        (status, body), = _answers(asyncio.run(_written_until_closed(head, app)))
        assert status == 400 and json.loads(body)["error"]["code"] == "invalid_host_header", body
    two_lengths = b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 5\r\n\r\nabcde"
    assert [status for status, _ in _answers(asyncio.run(_written_until_closed(two_lengths, app)))] == [400]
    assert app.paths == []
    old = asyncio.run(_written_until_closed(b"GET /v1/models HTTP/1.0\r\n\r\n", app))
    assert _answers(old) == [(200, b"")]  # HTTP/1.0 needs none


def test_a_body_trickling_in_is_refused_408_after_the_body_timeout() -> None:
    """A client that sends a head declaring a large body and then a byte now and then held its
    request (its task, its slot in the limits) for ever. Past the body timeout (plus a second for
    each `BODY_MIN_BYTES_PER_S` received) it is answered 408 in the route's error shape and
    closed, whether its request's task had started (a large body) or its early answer waited for
    the body (a small one). A large body sent steadily, for longer than the timeout, is served."""
    app = _Recorder()

    async def scenario() -> tuple[list[bytes], tuple[int, dict[str, str], bytes]]:
        async with _connected(app, _refuse_path_refuse, body_timeout_s=1) as (port, reader, writer, _):
            trickling = []
            for path, length in ((b"/v1/embeddings", 1_000_000), (b"/v2/models/m/infer", 100)):
                trickle_reader, trickle = await asyncio.open_connection("127.0.0.1", port)
                trickle.write(b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\nx" % (path, length))
                trickling.append((trickle_reader, trickle))
            closed = asyncio.gather(*(asyncio.wait_for(r.read(), 10) for r, _ in trickling))
            while not closed.done():  # a byte every 0.1 s on each
                for _, trickle in trickling:
                    trickle.write(b"x")
                await asyncio.sleep(0.1)
            body = b"y" * (300 * 1024)
            writer.write(b"POST /steady HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body))
            for start in range(0, len(body), 30 * 1024):  # 1.5 s at least: 20 KiB/s, above the least rate
                writer.write(body[start:start + 30 * 1024])
                await asyncio.sleep(0.15)
            return await closed, await _read_response(reader)

    (large, small), steady = asyncio.run(scenario())
    for written, shape in ((large, "openai"), (small, "kserve")):
        (status, body), = _answers(written)
        assert status == 408 and b"connection: close" in written, written
        error = json.loads(body)["error"]
        assert (error["code"] == "request_timeout") if shape == "openai" else isinstance(error, str)
    assert steady[0] == 200 and steady[2] == b"y" * (300 * 1024)
    assert app.paths == ["/v1/embeddings", "/steady"]  # the small body's early answer was never asked for


async def _answer_while_sending(port: int, head: bytes, filler: bytes) -> tuple[bytes, int]:
    """What a client that sends `head`, then `filler` again and again, reads (its answer, or the
    error that ended the read), and how much of `filler` it sent before the server closed (it
    goes on sending after its answer, up to 64 MiB)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    reading = asyncio.create_task(reader.read())
    sent = 0
    with contextlib.suppress(ConnectionError):
        while sent < 64 << 20:
            writer.write(filler)
            await writer.drain()
            sent += len(filler)
    writer.close()
    try:
        return await asyncio.wait_for(reading, 5), sent
    except ConnectionError as exc:
        return repr(exc).encode(), sent


def test_a_client_still_sending_reads_its_refusal_before_the_connection_closes() -> None:
    """A refusal written while the client is still sending (a 413 for a body too large, a 400 for
    a chunk it cannot parse, a 431 for an endless head) used to be followed by a close with the
    client's bytes unread: the kernel reset the connection, and the client, still writing, read
    "connection reset by peer", never the answer. Now the server shuts its sending side, reads and
    drops what still comes for a bounded time and size, and then closes."""
    clock = MonotonicClock()
    app = build_app(Gateway(clock, GatewayMetrics()))
    filler = b"x" * 65536

    async def scenario() -> list[tuple[bytes, int]]:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio", log_config=None,
                                               http=stamping_protocol(clock, app.answer_early), lifespan="off"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            return [await _answer_while_sending(port, head, filler) for head in (
                b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                b"content-type: application/json\r\ncontent-length: 100000000\r\n\r\n",
                b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
                b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\nx-long: ",
            )]
        finally:
            server.should_exit = True
            await serving

    (too_large, sent), (bad_chunk, _), (endless, _) = asyncio.run(scenario())
    assert too_large.startswith(b"HTTP/1.1 413 "), too_large
    assert json.loads(too_large.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "payload_too_large"
    assert bad_chunk.startswith(b"HTTP/1.1 400 "), bad_chunk
    assert endless.startswith(b"HTTP/1.1 431 "), endless
    assert sent < 32 * LINGER_BYTES  # what it read before closing is bounded: the server closed, not the client
