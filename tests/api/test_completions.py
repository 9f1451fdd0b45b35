"""The completions API's SSE stream when something unexpected breaks it mid-way."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import pytest

from sluice import wire
from sluice.api.completions import _Shape, _sse
from sluice.gateway import InferResult


def test_an_unexpected_error_mid_stream_is_an_error_event_then_done(caplog: pytest.LogCaptureFixture) -> None:
    closed = asyncio.Event()

    async def events() -> AsyncIterator[wire.TokenChunk | InferResult]:
        try:
            yield wire.TokenChunk(1, "more", [7])
            raise RuntimeError("a bug")
        finally:
            closed.set()

    async def scenario() -> list[bytes]:
        stream = events()
        first = await anext(stream)
        body = [part async for part in _sse(_Shape(True, "m"), first, stream)]
        assert closed.is_set()
        return body

    with caplog.at_level(logging.ERROR, logger="sluice.api"):
        body = asyncio.run(scenario())
    assert body[-1] == b"data: [DONE]\n\n"
    error = json.loads(body[-2].removeprefix(b"data: "))["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "internal error while streaming" in caplog.text
