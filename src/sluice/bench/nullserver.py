"""A null HTTP/1.1 server: answers every request with a fixed 200 JSON body, as fast as it can.

It exists to measure the load generator itself (`sluice bench --self-test`): the server does
almost no work per request, so the request rate it sees is bounded by the client. It speaks just
enough HTTP/1.1 for keep-alive clients (headers, `Content-Length` bodies, no chunked uploads).

Run it as `python -m sluice.bench.nullserver [--port N]`; it prints the bound port on its first
line of stdout and serves until it is terminated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
from typing import cast

_BODY = b'{"ok":true}'
_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(_BODY)).encode()
    + b"\r\n\r\n"
    + _BODY
)
_HEADER_END = b"\r\n\r\n"
_LENGTH_KEY = b"\r\ncontent-length:"


class NullProtocol(asyncio.Protocol):
    """One connection: split the byte stream into requests and answer each one."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        num_answers = 0
        while True:
            end = self._buffer.find(_HEADER_END)
            if end < 0:
                break
            request_len = end + len(_HEADER_END) + _content_length(bytes(self._buffer[:end]))
            if len(self._buffer) < request_len:
                break
            del self._buffer[:request_len]
            num_answers += 1
        if num_answers and self._transport is not None:
            self._transport.write(_RESPONSE * num_answers)


def _content_length(head: bytes) -> int:
    start = head.lower().find(_LENGTH_KEY)
    if start < 0:
        return 0
    start += len(_LENGTH_KEY)
    stop = head.find(b"\r\n", start)
    return int(head[start:] if stop < 0 else head[start:stop])


async def serve(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(NullProtocol, sock=sock, backlog=4096)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    print(sock.getsockname()[1], flush=True)
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(sock))
    sys.exit(0)


if __name__ == "__main__":
    main()
