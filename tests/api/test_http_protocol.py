"""The HTTP protocol notes when each request reached the server, and a deadline counts from then."""

from __future__ import annotations

import asyncio
import json

import httpx
import uvicorn
from starlette.requests import Request

from sluice.api.common import arrival
from sluice.api.http_protocol import stamping_protocol
from tests.conftest import free_port


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
