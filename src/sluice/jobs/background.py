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
- Streamed (`stream: true` as well): the run keeps the response's events, renumbered from the
  foreground stream's and carrying the background response's object (`response.created` and
  `response.queued` at creation, `response.in_progress`, ..., `response.completed`), in memory
  while it runs and in the store every `FLUSH_EVERY_S`. `follow` reads them live on the gateway
  that runs it and from the store elsewhere, so a client that dropped its stream resumes it
  anywhere. A takeover starts the answer again. Its events follow the stored ones with a gap in
  their numbers (`TAKEOVER_GAP`: a reader may have seen events its gateway never stored), close
  the items the earlier start left open (`response.output_item.done`, status `incomplete`), say
  `response.in_progress` again and number the new items' `output_index` after the earlier ones, so
  a reader accumulating the stream (the `openai` SDK's does) sees each index added once; the
  final event's response holds the new start's output alone.
- Cancelling (`POST .../cancel`) or deleting a running response ends its run in the store
  whichever gateway holds it; that gateway stops its work at its next renewal, within `check_s`
  (at once when it is this one), and an answer that arrives later is not written.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from sluice.api.common import TENANT_SCOPE_KEY
from sluice.api.errors import response_error_code
from sluice.api.responses import sse_event
from sluice.errors import RateLimited
from sluice.jobs.asgi_call import AppResponse, AsgiApp, app_response, call, call_streaming
from sluice.jobs.outage import OutageLog
from sluice.jobs.store import RUNNING, Event, JobStore, ResponseRun, RunRequest
from sluice.metrics import BackgroundMetrics
from sluice.tasks import cancel_and_wait, wait_event

log = logging.getLogger("sluice.jobs")

RETRIED_STATUSES = frozenset({429, 502, 503, 504})
ENDS = (b"event: response.completed\n", b"event: response.incomplete\n", b"event: response.failed\n")
"""A streamed response's last event starts with one of these."""
FLUSH_EVERY_S = 0.1
"""A streamed run's events reach the store (for other gateways' readers) at least this often."""
POLL_S = 0.1
"""How often a reader of a run that is not here looks for its new events."""
STATUS_CHECK_S = 0.5
"""How often such a reader, seeing none, looks whether the response was cancelled or deleted."""
TAKEOVER_GAP = 10_000
"""A taken-over stream's events are numbered from this many past its last stored one: the events
its earlier gateway had sent but not yet stored (at most `FLUSH_EVERY_S` of them while the store
answers) were seen by that gateway's readers, and one resuming after them must not skip new ones."""


class _Live:
    """A streamed run's events while it runs here: what local readers follow, what is not yet stored."""

    def __init__(self, next_seq: int) -> None:
        self.first_seq = next_seq
        self.index_offset = 0
        """Added to the answer's `output_index`es: how many items earlier starts of the run announced."""
        self.events: list[Event] = []
        self.pending: list[Event] = []
        self.flushed_at = time.monotonic()
        self.final: dict[str, Any] | None = None
        self.is_done = False
        self._changed = asyncio.Event()

    def emit(self, kind: str, **fields: Any) -> None:
        seq = self.first_seq + len(self.events)
        self.events.append((seq, sse_event(kind, seq, fields)))
        self.pending.append(self.events[-1])
        self._wake()

    def take_pending(self) -> list[Event]:
        taken, self.pending = self.pending, []
        self.flushed_at = time.monotonic()
        return taken

    def close(self) -> None:
        self.is_done = True
        self._wake()

    async def changed(self, timeout_s: float) -> None:
        await wait_event(self._changed, timeout_s)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class BackgroundResponses:
    """Runs this gateway's background responses and takes over those other gateways left."""

    def __init__(self, store: JobStore, *, lease_s: float = 30.0, check_s: float = 1.0, max_running: int = 256,
                 max_per_tenant: int = 1000, max_attempts: int = 3, patience_s: float = 900.0,
                 retention_s: int = 30 * 86_400,
                 purge_every_s: float = 3600.0, clock: Callable[[], float] = time.time,
                 metrics: BackgroundMetrics | None = None) -> None:
        self.store = store
        self.lease_s = lease_s
        self.check_s = min(check_s, lease_s / 3)
        """How often the leases are renewed, and cancellations through other gateways noticed."""
        self.max_running = max_running
        """Runs in progress on this gateway at most; beyond it, a new one waits in the store, queued,
        for the first gateway with room."""
        self.max_per_tenant = max_per_tenant
        """A tenant's unanswered background responses at most (across the gateways sharing the
        store): one more is refused with a 429, so a flood of creates cannot grow the store."""
        self.max_attempts = max_attempts
        self.patience_s = patience_s
        self.retention_s = retention_s
        self.purge_every_s = purge_every_s
        self._clock = clock
        self._metrics = metrics or BackgroundMetrics()
        self._token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._app: AsgiApp | None = None
        self._running: dict[str, asyncio.Task[None]] = {}
        self._live: dict[str, _Live] = {}
        self._loop: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._reserved = 0
        """Room taken by runs being stored or claimed (not yet in `_running`): counted at once, so
        that no store call holds the room of others while it waits."""
        self._purged_at = 0.0
        self._outage = OutageLog(log, "background responses")
        """The store out of reach (its database down) is logged when it begins and ends, not each round."""

    async def start(self, app: AsgiApp) -> None:
        """Run through `app` (the full app, middleware included): resume what the store holds, then
        keep the leases and take over what others left."""
        self._app = app
        self._loop = asyncio.create_task(self._housekeep())

    async def aclose(self) -> None:
        """Stop; what is running here stays in the store, leased until the lease runs out."""
        await cancel_and_wait(task for task in [self._loop, *self._running.values()] if task is not None)

    async def submit(self, owner: str, response_id: str, created_at: int, request: RunRequest,
                     input_items: bytes) -> None:
        """Store a new background response (queued) and start it here if there is room; a 429
        (`RateLimited`) if the tenant has `max_per_tenant` unanswered already."""
        if await self.store.num_response_runs(owner) >= self.max_per_tenant:
            raise RateLimited(f"{self.max_per_tenant} background responses of this tenant are not answered yet: "
                              "wait for some to end", "background", retry_after_s=5.0)
        events: list[Event] = []
        if request.stream:  # its stream opens with the response queued
            queued = msgspec.json.decode(request.response)
            events = [(0, sse_event("response.created", 0, {"response": queued})),
                      (1, sse_event("response.queued", 1, {"response": queued}))]
        encoded = msgspec.json.encode(request)
        has_room = self._app is not None and self._room() > 0
        self._reserved += has_room
        try:
            await self.store.put_response_run(owner, response_id, created_at, request.response, input_items, encoded,
                                              self._token if has_room else "",
                                              self._clock() + self.lease_s if has_room else 0.0, events)
        finally:
            self._reserved -= has_room
        if has_room:
            self._start(ResponseRun(owner, response_id, encoded, 1, len(events) - 1))
        else:
            self._wake.set()

    async def follow(self, owner: str, response_id: str, after: int) -> AsyncIterator[bytes]:
        """A streamed background response's events after sequence number `after`, as they come,
        until its end (or its cancellation or deletion): live when it runs here, else from the store."""
        checked_at = 0.0  # when the response was last seen running
        while True:
            live = self._live.get(response_id)
            if live is not None and live.first_seq <= after + 1:
                for seq, data in live.events[after + 1 - live.first_seq:]:
                    yield data
                    after = seq
                if live.is_done:
                    if live.events and live.events[-1][1].startswith(ENDS):
                        return
                    checked_at = 0.0  # it stopped here without an end: cancelled or deleted, the store says
                    continue
                await live.changed(1.0)
                continue
            found = await self.store.response_events(owner, response_id, after, 500)
            for seq, data in found:
                yield data
                after = seq
                if data.startswith(ENDS):
                    return
            if found:
                continue
            if time.monotonic() - checked_at >= STATUS_CHECK_S:  # an end without events: cancelled or deleted
                stored = await self.store.get_response(owner, response_id)
                if stored is None or msgspec.json.decode(stored.body)["status"] not in RUNNING:
                    if not await self.store.response_events(owner, response_id, after, 1):
                        return
                    continue
                checked_at = time.monotonic()
            await (live.changed(POLL_S) if live is not None else asyncio.sleep(POLL_S))

    def _room(self) -> int:
        """How many more runs may start here (`max_running` at most, counting those on their way)."""
        return self.max_running - len(self._running) - self._reserved

    def stop(self, response_id: str) -> None:
        """Stop the work of a run that was cancelled or deleted, if it runs here."""
        task = self._running.pop(response_id, None)
        if task is not None:
            task.cancel()
            self._metrics.running(len(self._running))

    def cancelled(self, response_id: str) -> None:
        """A client cancelled this response (through this gateway): stop it if it runs here."""
        self._metrics.ended("cancelled")
        self.stop(response_id)

    def _start(self, run: ResponseRun) -> None:
        task = asyncio.create_task(self._run(run))
        self._running[run.response_id] = task
        self._metrics.running(len(self._running))
        task.add_done_callback(lambda done: self._forget(run.response_id, done))

    def _forget(self, response_id: str, task: asyncio.Task[None]) -> None:
        if self._running.get(response_id) is task:
            del self._running[response_id]
            self._metrics.running(len(self._running))
            if self._room() == 1:
                self._wake.set()  # there was no room: a run may be waiting in the store

    # -- a run -----------------------------------------------------------------------------------

    async def _run(self, run: ResponseRun) -> None:
        request = msgspec.json.decode(run.request, type=RunRequest)
        response = msgspec.json.decode(request.response)
        live = None
        if request.stream:
            live = _Live(run.last_event + 1 + (TAKEOVER_GAP if run.attempts > 1 else 0))
        if live is not None:
            self._live[run.response_id] = live
        try:
            if run.attempts > self.max_attempts:
                if live is not None:
                    await self._close_earlier_items(run, live)
                log.warning("background response %s: ended failed after %d starts", run.response_id,
                            run.attempts - 1)
                final = failed(response, "server_error",
                               f"the server stopped while answering it, {run.attempts - 1} times")
            else:
                started = {**response, "status": "in_progress"}
                if live is not None:
                    if run.attempts > 1:
                        await self._close_earlier_items(run, live)
                    live.emit("response.in_progress", response=started)
                if not await self._write(run, started, live, is_final=False):
                    return  # cancelled or deleted meanwhile, or another gateway has it
                try:
                    final = await self._answer(run, request, response, live)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the app answers errors itself: a bug; the response fails, we go on
                    log.exception("background response %s raised", run.response_id)
                    final = failed(response, "server_error", f"internal error: {type(exc).__name__}")
            if live is not None and live.final is None:  # the stream has not said how it ended
                live.emit("response.failed", response=final)
            if await self._write(run, final, live, is_final=True):
                self._metrics.ended(final["status"])
            else:
                log.info("background response %s: its answer came after it was cancelled or taken over",
                         run.response_id)
        finally:
            if live is not None:
                live.close()
                del self._live[run.response_id]

    async def _answer(self, run: ResponseRun, request: RunRequest, response: dict[str, Any],
                      live: _Live | None) -> dict[str, Any]:
        """The response's end from the app's answer, asking again after a refusal that says to wait,
        for up to `patience_s`; streamed, its events go to `live` as they come."""
        assert self._app is not None
        headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in request.headers]
        give_up_at = time.monotonic() + self.patience_s
        for attempt in range(1_000_000):
            if live is None:
                answer = await call(self._app, "POST", "/v1/responses", request.body, headers,
                                    {TENANT_SCOPE_KEY: run.owner})
            else:
                feed = _Feed(self, run, response, live)
                status, answer_headers = await call_streaming(self._app, "POST", "/v1/responses", request.body,
                                                              headers, {TENANT_SCOPE_KEY: run.owner}, feed.take)
                if status == 200:
                    return live.final or failed(response, "server_error", "the answer's stream ended early")
                answer = app_response(status, answer_headers, bytes(feed.raw))
            if answer.status_code not in RETRIED_STATUSES or not answer.should_retry:
                return ended(response, answer)
            wait_s = answer.retry_after_s if answer.retry_after_s is not None else \
                random.uniform(0, min(0.5 * 2 ** attempt, 30.0))  # full jitter
            if time.monotonic() + wait_s > give_up_at:
                return ended(response, answer)
            await asyncio.sleep(max(wait_s, 0.05))
        raise AssertionError("unreachable")

    async def _close_earlier_items(self, run: ResponseRun, live: _Live) -> None:
        """A taken-over stream: end the output items its earlier starts announced and left open,
        and number the new start's items after all of theirs."""
        opened: dict[int, dict[str, Any]] = {}
        after = -1
        while found := await self.store.response_events(run.owner, run.response_id, after, 500):
            after = found[-1][0]
            for _, data in found:
                event = msgspec.json.decode(data.partition(b"data: ")[2])
                if "output_index" not in event:
                    continue
                live.index_offset = max(live.index_offset, event["output_index"] + 1)
                if event["type"] == "response.output_item.added":
                    opened[event["output_index"]] = event["item"]
                elif event["type"] == "response.output_item.done":
                    opened.pop(event["output_index"], None)
        for index, item in sorted(opened.items()):
            live.emit("response.output_item.done", output_index=index, item={**item, "status": "incomplete"})

    async def _write(self, run: ResponseRun, response: dict[str, Any] | None, live: _Live | None, *,
                     is_final: bool) -> bool:
        body = None if response is None else msgspec.json.encode(response)
        return await self.store.update_response_run(run.response_id, self._token, body, is_final=is_final,
                                                    events=live.take_pending() if live is not None else ())

    # -- leases ----------------------------------------------------------------------------------

    async def _housekeep(self) -> None:
        while True:
            self._wake.clear()  # before the round: a wake-up during it (a run left queued) starts the next one
            try:
                await self._keep_leases()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store is unreachable for now: the next round tries again
                self._outage.failed(exc, "background responses: housekeeping failed")
            else:
                self._outage.succeeded()
            await wait_event(self._wake, self.check_s)

    async def _keep_leases(self) -> None:
        now = self._clock()
        if self._running:
            running = list(self._running)
            held = await self.store.renew_response_runs(self._token, running, now + self.lease_s)
            for response_id in running:
                if response_id not in held:  # cancelled or deleted elsewhere (or taken over after a stall)
                    self.stop(response_id)
        room = self._room()
        if room > 0 and self._app is not None:
            self._reserved += room
            try:
                claimed = await self.store.claim_response_runs(self._token, now, now + self.lease_s, room)
            finally:
                self._reserved -= room
            for run in claimed:
                if run.attempts > 1:
                    log.info("background response %s: taken over (start %d)", run.response_id, run.attempts)
                    self._metrics.taken_over()
                self._start(run)
        if now - self._purged_at >= self.purge_every_s:
            self._purged_at = now
            await self.store.delete_responses_before(int(now) - self.retention_s)


class _Feed:
    """A streamed run's answer as the app sends it: its events, renumbered into the background
    response's stream and carrying its response object, to `live` (and the store, batched)."""

    def __init__(self, runner: BackgroundResponses, run: ResponseRun, response: dict[str, Any], live: _Live) -> None:
        self.runner = runner
        self.run = run
        self.response = response
        self.live = live
        self.raw = bytearray()

    async def take(self, status: int, piece: bytes) -> None:
        self.raw += piece
        if status != 200:
            return  # an error answer (JSON): read whole
        *whole, rest = bytes(self.raw).split(b"\n\n")
        self.raw = bytearray(rest)
        announced = False
        for event in whole:
            _, _, data = event.partition(b"data: ")
            if data:
                announced |= self._translate(msgspec.json.decode(data)) == "response.output_item.added"
        # an item's announcement is stored at once: a takeover numbers its items after every one
        # a reader may have seen (`_close_earlier_items` reads the store)
        if announced or time.monotonic() - self.live.flushed_at >= FLUSH_EVERY_S:
            await self.runner._write(self.run, None, self.live, is_final=False)

    def _translate(self, event: dict[str, Any]) -> str:
        """Emit `event` as the background response's; returns its kind."""
        kind = str(event.pop("type"))
        event.pop("sequence_number", None)
        if kind in ("response.created", "response.in_progress"):
            return kind  # said already, of the background response
        if kind in ("response.completed", "response.incomplete"):
            self.live.final = ended(self.response, AppResponse(200, "", msgspec.json.encode(event["response"])))
            self.live.emit(kind, response=self.live.final)
        elif kind == "error":
            self.live.emit(kind, **event)
            self.live.final = failed(self.response, response_error_code(str(event.get("code") or "server_error")),
                                     str(event.get("message") or "the answer failed"))
            self.live.emit("response.failed", response=self.live.final)
        else:
            if "output_index" in event:
                event["output_index"] += self.live.index_offset
            self.live.emit(kind, **event)
        return kind


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
    code = response_error_code(str(error.get("code") or ""), answer.status_code)
    return failed(response, code, str(error.get("message") or f"HTTP {answer.status_code}"))


def failed(response: dict[str, Any], code: str, message: str) -> dict[str, Any]:
    return {**response, "status": "failed", "error": {"code": code, "message": message}}
