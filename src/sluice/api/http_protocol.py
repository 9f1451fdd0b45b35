"""uvicorn's httptools protocol, noting when each request arrived.

A request's deadline counts from when it reached the server, not from when the event loop got
round to its handler: under load, a parsed request can wait tens of milliseconds for its task to
start (benchmarks/README.md, "Where a refusal's time goes"). The moment the parser sees a request
begin is kept in the ASGI scope (`RECEIVED_AT_SCOPE_KEY`, on the gateway's clock), and the
inference endpoints count the deadline, and admission's prediction, from it.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from sluice.api.common import RECEIVED_AT_SCOPE_KEY
from sluice.clock import Clock


def stamping_protocol(clock: Clock) -> type[Any]:
    """An `HttpToolsProtocol` subclass for `uvicorn.Config(http=...)` that stamps `clock.now()`."""

    class StampingHttpToolsProtocol(HttpToolsProtocol):
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope[RECEIVED_AT_SCOPE_KEY] = clock.now()  # type: ignore[literal-required]

    return StampingHttpToolsProtocol
