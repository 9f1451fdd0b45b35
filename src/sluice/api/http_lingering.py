"""A lingering close for the HTTP protocol (`api.http_protocol`): closing a connection while its
client is still sending (a refusal of its head or body, an answer written before the body was
read) makes the kernel answer the unread bytes with a TCP reset, and the client, still writing,
often never reads the answer (a 413 for a 100 MB upload arrived as "connection reset by peer").

`LingeringTransport` is the connection's transport as the protocol and its requests see it: the
same methods (those called for each request bound once, at no cost per call), except `close()`,
which asks the protocol whether the client may still be sending. If it may, the answers written
so far are sent and the sending side shut (FIN: the client reads its answer, then end of
stream), and what still arrives is read and dropped (`_Drain`) until the client closes too,
`LINGER_BYTES` have come, or `LINGER_S` have passed; only then is the connection closed (as
Apache's and nginx's lingering close). A connection closed with nothing left to read (an idle
one, or after an answer to a request read whole) closes at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

LINGER_S = 2.0
"""The longest a closing connection keeps reading what its client still sends."""
LINGER_BYTES = 1 << 20
"""The most it reads so: past it, the connection is closed (a client sending at full speed has had its answer)."""


def _true() -> bool:
    return True


class LingeringTransport:
    """`transport`, whose `close()` lingers if `may_be_sending()` says the client may still be sending."""

    def __init__(self, transport: asyncio.Transport, may_be_sending: Callable[[], bool],
                 on_linger: Callable[[], None]) -> None:
        self.transport = transport
        self._may_be_sending = may_be_sending
        self._on_linger = on_linger
        self.is_lingering = False
        self.write = transport.write  # those called for each request or read: as they are
        self.is_closing = transport.is_closing
        self.pause_reading = transport.pause_reading
        self.resume_reading = transport.resume_reading

    def __getattr__(self, name: str) -> Any:  # the rest of the transport's methods, as they are
        return getattr(self.transport, name)

    def close(self) -> None:
        transport = self.transport
        if self.is_lingering or transport.is_closing():
            return
        if not self._may_be_sending():
            transport.close()
            return
        self.is_lingering = True
        self.is_closing = _true  # nothing more is written: the answers are all in
        self._on_linger()
        protocol = transport.get_protocol()
        transport.set_protocol(_Drain(transport, protocol))
        if transport.can_write_eof():  # after what is buffered (TLS cannot half-close: it only drains)
            transport.write_eof()
        transport.resume_reading()


class _Drain(asyncio.Protocol):
    """A lingering connection's protocol: drops what arrives, closes at the client's end of stream,
    past `LINGER_BYTES` or after `LINGER_S`, and then tells `protocol` the connection is lost."""

    def __init__(self, transport: asyncio.BaseTransport, protocol: Any) -> None:
        self._transport = transport
        self._protocol = protocol
        self._left = LINGER_BYTES
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        self._left -= len(data)
        if self._left <= 0:
            self._transport.close()

    def eof_received(self) -> bool:
        return False  # the transport closes

    def pause_writing(self) -> None:
        self._protocol.pause_writing()

    def resume_writing(self) -> None:
        self._protocol.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.cancel()
        self._protocol.connection_lost(exc)
