"""The completions API's SSE stream when something unexpected breaks it mid-way."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import pytest

from sluice import wire
from sluice.api.completion_shapes import ResponseShape
from sluice.api.completions import _sse, _tagged
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
        body = [part async for part in _sse(ResponseShape(True, "m"), _tagged([first], [stream]), [stream])]
        assert closed.is_set()
        return body

    with caplog.at_level(logging.ERROR, logger="sluice.api"):
        body = asyncio.run(scenario())
    assert body[-1] == b"data: [DONE]\n\n"
    error = json.loads(body[-2].removeprefix(b"data: "))["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "internal error while streaming" in caplog.text


def test_a_batch_of_prompts_streams_each_prompts_choices_under_their_own_index_and_one_failure_ends_all():
    closed: list[int] = []

    def result(text: str) -> InferResult:
        payload = wire.GenerationResult(text, "length", 2, 0, 1, choices=[wire.GeneratedChoice(text, "stop")])
        return InferResult(None, payload, 3, 0.0, 0.0, 1)  # type: ignore[arg-type]

    async def prompt(p: int, fail: bool) -> AsyncIterator[wire.TokenChunk | InferResult]:
        try:
            yield wire.TokenChunk(p, f"p{p}", [7], index=1)
            await asyncio.sleep(0.01)
            if fail:
                raise RuntimeError("a bug")
            yield result("")
        finally:
            closed.append(p)

    async def scenario(fail: bool) -> list[dict]:
        streams = [prompt(0, False), prompt(1, fail)]
        firsts = [await anext(stream) for stream in streams]
        shape = ResponseShape(False, "m", include_usage=True, prompt_texts=[None, None], n=2)
        body = [part async for part in _sse(shape, _tagged(firsts, streams), streams)]
        assert body[-1] == b"data: [DONE]\n\n"
        return [json.loads(part.removeprefix(b"data: ")) for part in body[:-1]]

    events = asyncio.run(scenario(fail=False))
    texts = {(c["index"], c["text"]) for e in events for c in e.get("choices", []) if c["text"]}
    assert texts == {(1, "p0"), (3, "p1")}  # choice 1 of prompt 0, choice 1 of prompt 1 (n = 2)
    finished = sorted(c["index"] for e in events for c in e.get("choices", []) if c["finish_reason"])
    assert finished == [0, 1, 2, 3]
    assert events[-1]["usage"]["prompt_tokens"] == 4 and events[-1]["choices"] == []
    closed.clear()
    failed = asyncio.run(scenario(fail=True))
    assert failed[-1]["error"]["code"] == "internal_error"  # an error event, no usage chunk after it
    assert sorted(closed) == [0, 1]
