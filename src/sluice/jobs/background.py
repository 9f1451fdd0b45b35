"""Background responses (`POST /v1/responses` with `background: true`): answered later, polled.

    create ─▶ store: response (queued) + its run, leased to this gateway ─▶ 200 queued
    run:  in_progress ─▶ app(POST /v1/responses, the same request in the foreground) ─▶ its end:
          completed / incomplete / failed, written only while this gateway still holds the lease
    every check_s: renew the leases of the runs in progress here (a run gone: cancelled or
          deleted: stop it), claim runs whose lease ran out (their gateway stopped), purge
          responses past their retention

- The request runs through the serving app in-process (`asgi_call.call`, as batch-job items do),
  as its tenant, so it gets the online path's validation, limits, priority, batching, deadlines
  and metrics. The create call already validated it: what can still fail is capacity, a limit or
  the model.
- Overload and limits are waits, not failures: a 429/502/503/504 that does not say retrying is
  useless is tried again after its `Retry-After` (else an exponential backoff), for up to
  `patience_s`; then, like any other error, the response ends `failed` with the error.
- Nothing is lost with a gateway: a run's lease is renewed while it runs; once it runs out (the
  gateway crashed or stopped), any gateway sharing the store takes the run over and starts it
  again from its request (an embedded server, alone on its SQLite store, takes back every run at
  startup). A run started `max_attempts` times without an end ends `failed`.
- Cancelling (`POST .../cancel`) or deleting a running response ends its run in the store
  whichever gateway holds it; that gateway stops its work at its next renewal, within `check_s`
  (at once when it is this one), and an answer that arrives later is not written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from sluice.api.common import TENANT_SCOPE_KEY
from sluice.jobs.asgi_call import AppResponse, AsgiApp, call
from sluice.jobs.store import JobStore, ResponseRun, RunRequest

log = logging.getLogger("sluice.jobs")

RETRIED_STATUSES = frozenset({429, 502, 503, 504})


class BackgroundResponses:
    def __init__(self, store: JobStore, *, lease_s: float = 30.0, check_s: float = 1.0, max_running: int = 256,
                 max_attempts: int = 3,
                 patience_s: float = 900.0, retention_s: int = 30 * 86_400, purge_every_s: float = 3600.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.lease_s = lease_s
        self.check_s = min(check_s, lease_s / 3)
        """How often the leases are renewed, and cancellations through other gateways noticed."""
        self.max_running = max_running
        """Runs in progress on this gateway at most; beyond it, a new one waits in the store, queued,
        for the first gateway with room."""
        self.max_attempts = max_attempts
        self.patience_s = patience_s
        self.retention_s = retention_s
        self.purge_every_s = purge_every_s
        self._clock = clock
        self._token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._app: AsgiApp | None = None
        self._running: dict[str, asyncio.Task[None]] = {}
        self._loop: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._purged_at = 0.0

    async def start(self, app: AsgiApp) -> None:
        """Run through `app` (the full app, middleware included): resume what the store holds, then
        keep the leases and take over what others left."""
        self._app = app
        self._loop = asyncio.create_task(self._housekeep())

    async def aclose(self) -> None:
        """Stop; what is running here stays in the store, leased until the lease runs out."""
        tasks = [task for task in [self._loop, *self._running.values()] if task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def submit(self, owner: str, response_id: str, created_at: int, request: RunRequest,
                     input_items: bytes) -> None:
        """Store a new background response (queued) and start it here if there is room."""
        has_room = self._app is not None and len(self._running) < self.max_running
        await self.store.put_response_run(owner, response_id, created_at, request.response, input_items,
                                          msgspec.json.encode(request), self._token if has_room else "",
                                          self._clock() + self.lease_s if has_room else 0.0)
        if has_room:
            self._start(ResponseRun(owner, response_id, msgspec.json.encode(request), 1))
        else:
            self._wake.set()

    def stop(self, response_id: str) -> None:
        """Stop the work of a run that was cancelled or deleted, if it runs here."""
        task = self._running.pop(response_id, None)
        if task is not None:
            task.cancel()

    def _start(self, run: ResponseRun) -> None:
        task = asyncio.create_task(self._run(run))
        self._running[run.response_id] = task
        task.add_done_callback(lambda done: self._forget(run.response_id, done))

    def _forget(self, response_id: str, task: asyncio.Task[None]) -> None:
        if self._running.get(response_id) is task:
            del self._running[response_id]
            if len(self._running) == self.max_running - 1:
                self._wake.set()  # room for a run waiting in the store

    # -- a run -----------------------------------------------------------------------------------

    async def _run(self, run: ResponseRun) -> None:
        request = msgspec.json.decode(run.request, type=RunRequest)
        response = msgspec.json.decode(request.response)
        if run.attempts > self.max_attempts:
            log.warning("background response %s: ended failed after %d starts", run.response_id, run.attempts - 1)
            await self._end(run, {**response, "status": "failed", "error": {
                "code": "server_error", "message": f"the server stopped while answering it, {run.attempts - 1} times"}})
            return
        if not await self._write(run, {**response, "status": "in_progress"}, is_final=False):
            return  # cancelled or deleted meanwhile, or another gateway has it
        try:
            answer = await self._answer(run, request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the app answers errors itself: this is a bug; the response fails, we go on
            log.exception("background response %s raised", run.response_id)
            answer = AppResponse(500, "", msgspec.json.encode(
                {"error": {"message": f"internal error: {type(exc).__name__}", "code": None}}))
        await self._end(run, ended(response, answer))

    async def _answer(self, run: ResponseRun, request: RunRequest) -> AppResponse:
        """The app's answer, asking again after a refusal that says to wait, for up to `patience_s`."""
        assert self._app is not None
        headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in request.headers]
        give_up_at = time.monotonic() + self.patience_s
        for attempt in range(1_000_000):
            answer = await call(self._app, "POST", "/v1/responses", request.body, headers,
                                {TENANT_SCOPE_KEY: run.owner})
            if answer.status_code not in RETRIED_STATUSES or not answer.should_retry:
                return answer
            wait_s = answer.retry_after_s if answer.retry_after_s is not None else \
                random.uniform(0, min(0.5 * 2 ** attempt, 30.0))  # full jitter
            if time.monotonic() + wait_s > give_up_at:
                return answer
            await asyncio.sleep(max(wait_s, 0.05))
        raise AssertionError("unreachable")

    async def _end(self, run: ResponseRun, response: dict[str, Any]) -> None:
        if not await self._write(run, response, is_final=True):
            log.info("background response %s: its answer came after it was cancelled or taken over",
                     run.response_id)

    async def _write(self, run: ResponseRun, response: dict[str, Any], *, is_final: bool) -> bool:
        return await self.store.update_response_run(run.response_id, self._token, msgspec.json.encode(response),
                                                    is_final=is_final)

    # -- leases ----------------------------------------------------------------------------------

    async def _housekeep(self) -> None:
        while True:
            try:
                await self._keep_leases()
            except asyncio.CancelledError:
                raise
            except Exception:  # the store is unreachable for now: the next round tries again
                log.exception("background responses: housekeeping failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.check_s)

    async def _keep_leases(self) -> None:
        now = self._clock()
        if self._running:
            running = list(self._running)
            held = await self.store.renew_response_runs(self._token, running, now + self.lease_s)
            for response_id in running:
                if response_id not in held:  # cancelled or deleted elsewhere (or taken over after a stall)
                    self.stop(response_id)
        room = self.max_running - len(self._running)
        if room > 0 and self._app is not None:
            for run in await self.store.claim_response_runs(self._token, now, now + self.lease_s, room):
                if run.attempts > 1:
                    log.info("background response %s: taken over (start %d)", run.response_id, run.attempts)
                self._start(run)
        if now - self._purged_at >= self.purge_every_s:
            self._purged_at = now
            await self.store.delete_responses_before(int(now) - self.retention_s)


def ended(response: dict[str, Any], answer: AppResponse) -> dict[str, Any]:
    """The background response's end: the queued object with the foreground answer's outcome."""
    if answer.status_code == 200:
        done = msgspec.json.decode(answer.body)
        return {**response, **{key: done.get(key) for key in ("status", "output", "usage", "incomplete_details")},
                "error": None}
    try:
        error = msgspec.json.decode(answer.body).get("error") or {}
    except (msgspec.DecodeError, AttributeError):
        error = {}
    code = error.get("code") or ("rate_limit_exceeded" if answer.status_code == 429 else "server_error")
    message = error.get("message") or f"HTTP {answer.status_code}"
    return {**response, "status": "failed", "error": {"code": str(code), "message": str(message)}}
