"""Per-request cost of the HTTP protocol's parsing, with no I/O: uvicorn's httptools protocol
against sluice's subclass (`api.http_protocol`), each fed the same 9-header GET on one
connection, the request's answer marked complete at once (no task, no write).

    python benchmarks/http_parse.py [--requests 200000] [--rounds 7]

Prints the median (and least) over the rounds of each protocol's CPU µs per request, the two
alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from sluice.api.http_protocol import stamping_protocol
from sluice.clock import MonotonicClock

REQUEST = (b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1:8000\r\naccept: application/json\r\n"
           b"accept-encoding: gzip, deflate\r\nconnection: keep-alive\r\nuser-agent: OpenAI/Python 1.0\r\n"
           b"authorization: Bearer sk-0123456789abcdef\r\nx-request-id: 1234\r\n"
           b"x-stainless-lang: python\r\ncontent-type: application/json\r\n\r\n")


class _Transport(asyncio.Transport):
    def write(self, data: Any) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _app(scope: Any, receive: Any, send: Any) -> None:
    pass


def _per_request_us(protocol_class: type[Any], num_requests: int, loop: asyncio.AbstractEventLoop) -> float:
    class Bench(protocol_class):  # type: ignore[misc, valid-type]
        def _start_asgi_task(self, cycle: Any, app: Any) -> None:  # the app's work is not measured
            cycle.response_complete = True

    config = uvicorn.Config(_app, http=Bench, log_config=None, lifespan="off")
    config.load()
    protocol = Bench(config, ServerState(), {}, _loop=loop)
    protocol.connection_made(_Transport())
    feed, complete = protocol.data_received, protocol.on_response_complete
    start = time.process_time()  # CPU time: what a shared host's other processes take is not counted
    for _ in range(num_requests):
        feed(REQUEST)
        complete()
    elapsed = time.process_time() - start
    protocol.connection_lost(None)
    loop.run_until_complete(asyncio.sleep(0))  # drops the cancelled keep-alive timers
    return elapsed / num_requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    loop = asyncio.new_event_loop()
    protocols = {"uvicorn": HttpToolsProtocol, "sluice": stamping_protocol(MonotonicClock())}
    times: dict[str, list[float]] = {name: [] for name in protocols}
    for _ in range(args.rounds):
        for name, protocol_class in protocols.items():
            times[name].append(_per_request_us(protocol_class, args.requests, loop))
    for name, found in times.items():
        print(f"{name:8} {statistics.median(found):5.2f} µs/request (least {min(found):.2f}, most {max(found):.2f})")
    loop.close()


if __name__ == "__main__":
    main()
