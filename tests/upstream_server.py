"""A small single-item inference API for the `http-single` runner's tests, on a loopback port.

    POST /infer  {"input": "some text"}      -> {"output": [16 numbers: a deterministic unit vector]}
                 {"input": [1.0, 2.0, ...]}  -> {"output": 3.0 + ...}   (the row's sum)

It runs an aiohttp server on its own event loop in a background thread, so synchronous tests
and a `sluice serve` subprocess can both call it. Behaviour is injected through `UpstreamServer`'s
attributes (the test owns the object, no admin endpoint needed):

- `delay_s`: every request waits this long before answering;
- `fail_next` / `slow_next`: the next N requests answer `fail_status` / wait `slow_s` first;
- `fail_rate`: each request answers `fail_status` with this probability;
- per item: a text `status:NNN` or a row whose first value is `-NNN` always answers NNN.

It counts requests and the most that were ever in flight at once.

    POST /v1/completions, /v1/chat/completions  -> an OpenAI SSE stream, for `openai-upstream`

plays the next entry of `sse_plans` (a `SsePlan`; when none is left, `SsePlan()`): an HTTP error
status with OpenAI's error envelope, or text deltas (or whole chat deltas), then (unless `is_broken`) a finish_reason, a
usage chunk and `[DONE]`. The last request's body and headers are kept (`/infer`'s headers too).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import socket
import threading
from dataclasses import dataclass, field
from types import TracebackType

import numpy as np
from aiohttp import web

DIMS = 16


def expected_text_output(text: str) -> list[float]:
    """What the server answers for a text item (for tests to compare against)."""
    digest = hashlib.blake2b(text.encode(), digest_size=4 * DIMS).digest()
    vector = np.frombuffer(digest, dtype=np.uint32).astype(np.float64) - 2**31
    return [float(v) for v in vector / np.linalg.norm(vector)]


@dataclass
class SsePlan:
    deltas: list[str | dict[str, object]] = field(default_factory=lambda: ["Hello", " world"])
    """Text, or (chat) a whole delta object such as {"tool_calls": [...]}."""
    finish_reason: str = "stop"
    status: int = 200
    error_param: str | None = None
    is_broken: bool = False  # the stream stops after the deltas: no finish_reason, no [DONE]
    usage: dict[str, object] = field(default_factory=lambda: {
        "prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 3}})


class UpstreamServer:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.fail_next = 0
        self.slow_next = 0
        self.slow_s = 1.0
        self.fail_rate = 0.0
        self.sse_plans: list[SsePlan] = []
        self.last_body: dict[str, object] = {}
        self.last_headers: dict[str, str] = {}
        self.fail_status = 503
        self.num_requests = 0
        self.num_in_flight = 0
        self.max_in_flight = 0
        self._rng = random.Random(0)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="upstream", daemon=True)
        self._runner: web.AppRunner | None = None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}/infer"

    def __enter__(self) -> UpstreamServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def reset_counts(self) -> None:
        self.num_requests = 0
        self.max_in_flight = self.num_in_flight

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/infer", self._infer)
        app.router.add_post("/v1/completions", self._sse)
        app.router.add_post("/v1/chat/completions", self._sse)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _infer(self, request: web.Request) -> web.Response:
        self.num_requests += 1
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        self.last_headers = dict(request.headers)
        try:
            return await self._answer(await request.json())
        finally:
            self.num_in_flight -= 1

    async def _answer(self, body: dict[str, object]) -> web.Response:
        delay_s = self.delay_s
        if self.slow_next > 0:
            self.slow_next -= 1
            delay_s += self.slow_s
        if delay_s:
            await asyncio.sleep(delay_s)
        item = body.get("input")
        status = _injected_status(item)
        if status is None and self.fail_next > 0:
            self.fail_next -= 1
            status = self.fail_status
        if status is None and self.fail_rate and self._rng.random() < self.fail_rate:
            status = self.fail_status
        if status is not None:
            return web.json_response({"error": f"injected failure {status}"}, status=status)
        if isinstance(item, str):
            return web.json_response({"output": expected_text_output(item)})
        if isinstance(item, list) and all(isinstance(v, int | float) for v in item):
            return web.json_response({"output": float(sum(item))})
        return web.json_response({"error": "input must be a string or a list of numbers"}, status=400)


    async def _sse(self, request: web.Request) -> web.StreamResponse:
        self.num_requests += 1
        self.last_body = await request.json()
        self.last_headers = dict(request.headers)
        plan = self.sse_plans.pop(0) if self.sse_plans else SsePlan()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if plan.status != 200:
            error = {"message": f"injected {plan.status}", "type": "invalid_request_error",
                     "param": plan.error_param, "code": None}
            return web.json_response({"error": error}, status=plan.status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        is_chat = request.path.endswith("/chat/completions")
        for text in plan.deltas:
            delta = text if isinstance(text, dict) else {"content": text}
            choice = {"index": 0, "delta": delta} if is_chat else {"index": 0, "text": text}
            await response.write(_event({"choices": [{**choice, "finish_reason": None}], "usage": None}))
        if plan.is_broken:
            return response
        end = {"index": 0, "delta": {}} if is_chat else {"index": 0, "text": ""}
        await response.write(_event({"choices": [{**end, "finish_reason": plan.finish_reason}], "usage": None}))
        await response.write(_event({"choices": [], "usage": plan.usage}))
        await response.write(b"data: [DONE]\n\n")
        return response


def _event(content: object) -> bytes:
    return b"data: " + json.dumps(content).encode() + b"\n\n"


def _injected_status(item: object) -> int | None:
    if isinstance(item, str) and item.startswith("status:"):
        return int(item.removeprefix("status:"))
    if isinstance(item, list) and item and isinstance(item[0], int | float) and -599 <= item[0] <= -400:
        return int(-item[0])
    return None
