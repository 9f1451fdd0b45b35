"""The worker's messages to gateways (`Outbox`): queued, and sent together once per loop turn.

Everything queued for one gateway in one turn of the event loop (the `Started` of a batch, the
`Result`s of the one before, a state report) leaves in one frame: one send, one wakeup at the
gateway, however many messages it carries.
"""

from __future__ import annotations

import asyncio

from sluice import transport, wire


class Outbox:
    """The messages queued for each gateway (by its transport identity) until `flush`."""

    def __init__(self) -> None:
        self.listener: transport.Listener | None = None
        """Where they are sent; set once the worker listens."""
        self._queued: dict[bytes, list[wire.Message]] = {}

    def reply(self, identity: bytes, message: wire.Message) -> None:
        """Queue a message for a gateway; everything queued in one loop turn leaves in one frame."""
        if not self._queued:
            asyncio.get_running_loop().call_soon(self.flush)
        self._queued.setdefault(identity, []).append(message)

    def flush(self) -> None:
        assert self.listener is not None
        queued, self._queued = self._queued, {}
        for identity, messages in queued.items():
            self.listener.send(identity, wire.encode_many(messages))  # dropped if that gateway is gone
