"""One persistent, multiplexed connection (`sluice.transport`) from this gateway to one worker.

Requests are matched to answers by `request_id`. The connection keeps the worker's latest
reported state, and knows which in-flight requests have started executing, so that when the
worker dies the gateway can re-dispatch the ones that had not.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sluice import transport, wire
from sluice.tasks import cancel_and_wait

log = logging.getLogger("sluice.gateway")

STALE_AFTER_S = 2.0
HELLO_EVERY_S = 0.25


@dataclass(slots=True, eq=False)
class InFlight:
    submit: wire.Submit
    future: asyncio.Future[wire.Result | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    is_started: bool = False
    is_timed_out: bool = False
    chunks: asyncio.Queue[wire.TokenChunk | None] | None = None
    """For a streamed generation: its output as it arrives; None when `future` is resolved."""

    def resolve(self, result: wire.Result | None) -> None:
        """The answer (None: lost or timed out). Ends a stream too."""
        if not self.future.done():
            self.future.set_result(result)
            if self.chunks is not None:
                self.chunks.put_nowait(None)


class WorkerConnection:
    def __init__(self, worker_id: str, address: str, gateway_id: str) -> None:
        self.worker_id = worker_id
        self.address = address
        self._gateway_id = gateway_id
        self._channel = transport.Channel(address, gateway_id.encode(), self._on_frame, self._on_connect,
                                          self._on_disconnect, self._on_refused)
        self.state: wire.WorkerState | None = None
        self.known_models: list[wire.ModelInfo] = []  # kept across a crash, for re-dispatch
        self.dormant: list[tuple[str, str]] = []
        """(model, version) the worker loads on demand and has not loaded (`WorkerState.dormant`)."""
        self.loading: list[tuple[str, str]] = []
        """(model, version) the worker is loading now (`WorkerState.loading`)."""
        self._served: dict[tuple[str, str], wire.ModelInfo] = {}
        self.state_at = 0.0
        self._unreported = _Unreported()
        self._item_s: dict[tuple[str, str], float] = {}
        self._newcomer_s: dict[tuple[str, str], float] = {}
        self._provisional: set[tuple[str, str]] = set()
        self._upstreams: dict[tuple[str, str], wire.UpstreamLoad] = {}
        self._sent_to_upstream: dict[tuple[str, str], int] = {}  # calls sent since the last report
        self._in_flight: dict[int, InFlight] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.is_lost = False
        self.is_ready = False
        self._is_leaving = False
        self._lost_incarnation: str | None = None
        self._sent_before_connect: set[int] = set()
        """Requests in flight when the connection was last (re)established: sent to the process that
        listened before, which a report from another incarnation shows to be gone."""
        self._weights: dict[str, float] | None = None
        self._syncs: dict[int, asyncio.Future[wire.ModelSynced]] = {}
        self.on_change: Callable[[], None] = lambda: None
        """Called when readiness or the served models change, so the gateway can re-index."""
        self.on_batch_stats: Callable[[wire.BatchStats], None] = lambda stats: None
        """Called with each of the worker's batch counts (`gateway.statistics`)."""

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def mark_draining(self) -> None:
        """The worker answered that it is draining before its report said so: send it nothing new."""
        if self.is_ready:
            self.is_ready = False
            self.on_change()

    def mark_leaving(self) -> None:
        """The worker is going away (it left the registry): send it nothing new, whatever its
        reports say, while it answers what it has."""
        self._is_leaving = True
        self.mark_draining()

    def _on_connect(self) -> None:
        self._sent_before_connect = set(self._in_flight)
        self._introduce()

    def _lose_previous_incarnation(self, previous: str) -> None:
        """Another process answers at the worker's address (it restarted there faster than its
        reports are missed): what was sent to the one before will never be answered. Those
        requests are resolved as lost now (the gateway sends those that had not started
        elsewhere), not left until their deadlines."""
        self._lost_incarnation = previous
        lost = [self._in_flight.pop(request_id) for request_id in self._sent_before_connect
                if request_id in self._in_flight]
        self._sent_before_connect = set()
        for in_flight in lost:
            self._unreported.discard(in_flight.submit.request_id)
            in_flight.resolve(None)
        if lost:
            log.warning("worker %s restarted at %s with %d requests in flight; they are lost to it",
                        self.worker_id, self.address, len(lost))

    def _on_disconnect(self) -> None:
        """A draining worker that closes the connection has answered everything it took and is
        going: what it still holds here (requests that were on their way when it closed) goes to
        another worker now, not after its reports have been missing for STALE_AFTER_S."""
        if self._is_leaving or (self.state is not None and self.state.is_draining):
            lost = self.mark_lost()
            if lost:
                log.info("draining worker %s closed with %d requests it had not taken; sending them elsewhere",
                         self.worker_id, len(lost))

    def _on_refused(self) -> None:
        """Nothing listens at the worker's address just after its connection closed: the process
        died (SIGKILL, a crash). What it had is lost now, not after its reports have been missing
        for STALE_AFTER_S: requests it had not started go to another worker, streams end."""
        if self.state is None and not self._in_flight:
            return
        lost = self.mark_lost()
        log.warning("worker %s is gone (its address refuses connections) with %d requests in flight",
                    self.worker_id, len(lost))

    def is_alive(self) -> bool:
        """Connected and reporting: it can still answer what it has."""
        return not self.is_lost and self.state is not None and time.monotonic() - self.state_at < STALE_AFTER_S

    def served(self, info: wire.ModelInfo) -> wire.ModelInfo:
        """This worker's own description of `info`'s model version: workers serving the same version
        may differ in what they report (e.g. one restarted on new weights: another cache revision)."""
        return self._served.get((info.name, info.version), info)

    async def start(self) -> None:
        self._channel.start()
        self._tasks = [asyncio.create_task(self._hello_loop())]

    async def aclose(self) -> None:
        await cancel_and_wait(self._tasks)
        await self._channel.aclose()

    def _update_readiness(self) -> None:
        is_ready = (
            not self.is_lost
            and not self._is_leaving
            and self.state is not None
            and self.state.is_ready
            and time.monotonic() - self.state_at < STALE_AFTER_S
        )
        if is_ready != self.is_ready:
            self.is_ready = is_ready
            self.on_change()

    def submit(self, message: wire.Submit) -> InFlight | None:
        """Send a request; None if the worker cannot take it right now (not connected)."""
        if self.is_lost:
            return None
        in_flight = InFlight(message)
        if isinstance(message.payload, wire.GeneratePayload) and message.payload.stream:
            in_flight.chunks = asyncio.Queue()
        key = (message.model, message.version)
        work_s = self._item_s.get(key, 0.001) * wire.num_items(message.payload)
        self._in_flight[message.request_id] = in_flight
        self._unreported.add(message.request_id, (message.tenant, message.priority), work_s)
        if not self._send_now(message):
            del self._in_flight[message.request_id]
            self._unreported.discard(message.request_id)
            return None
        if key in self._upstreams:
            self._sent_to_upstream[key] = self._sent_to_upstream.get(key, 0) + 1
        return in_flight

    def sent_flow_work_s(self, tenant: str, priority: int) -> float:
        """Device work this gateway sent for (tenant, class) that the worker's last report does
        not count yet."""
        return self._unreported.flow_work_s((tenant, priority))

    def item_s(self, model: str, version: str) -> float:
        """From the last report: the device time one more typical item adds (`QueueState.item_s`)."""
        return self._item_s.get((model, version), 0.0)

    def is_provisional(self, model: str, version: str) -> bool:
        """From the last report: its predictions for this version are provisional (`QueueState.is_provisional`)."""
        return (model, version) in self._provisional

    def newcomer_s(self, model: str, version: str) -> float:
        """From the last report: what a newcomer's own batch adds to its wait (`QueueState.newcomer_s`)."""
        return self._newcomer_s.get((model, version), 0.0)

    @property
    def predicted_wait_s(self) -> float:
        """Work ahead at the worker: its last report plus what we sent it since."""
        reported = self.state.work_ahead_s if self.state is not None else 0.0
        return reported + self.sent_work_since_state_s

    @property
    def sent_work_since_state_s(self) -> float:
        """Device work sent that the worker's last report does not count yet, all tenants and classes."""
        return self._unreported.total_s()

    def predicted_wait_for(self, model: str, version: str) -> float:
        """Predicted wait for this model: the worker's device, or, for a model served by an
        upstream server, a slot to it (its last report plus the calls we sent since)."""
        load = self._upstreams.get((model, version))
        if load is None:
            return self.predicted_wait_s
        num_sent = self._sent_to_upstream.get((model, version), 0)
        return max(load.num_waiting + load.num_running + num_sent - load.max_running + 1, 0) * load.item_s

    def resolve_after(self, in_flight: InFlight, delay_s: float) -> asyncio.TimerHandle:
        """Resolve the request with None after `delay_s` unless the worker answers first."""
        def expire() -> None:
            if self._in_flight.pop(in_flight.submit.request_id, None) is not None:
                self._send_now(wire.Cancel([in_flight.submit.request_id]))
            if not in_flight.future.done():
                in_flight.is_timed_out = True
                in_flight.resolve(None)

        return asyncio.get_running_loop().call_later(delay_s, expire)

    def set_weights(self, weights: dict[str, float]) -> None:
        """The tenants' weights for the worker's scheduler: sent now, and again with every Hello
        (so a restarted worker learns them)."""
        self._weights = weights
        self._send_now(wire.TenantWeights(weights))

    def sync_model(self, sync_id: int, model: str, *, unload: bool = False) -> asyncio.Future[wire.ModelSynced] | None:
        """Have the worker bring `model` in line with its repository, or unload it (`wire.SyncModel`):
        the future of its answer, or None if it is not connected."""
        if not self._send_now(wire.SyncModel(sync_id, model, unload)):
            return None
        future = self._syncs[sync_id] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda _: self._syncs.pop(sync_id, None))
        return future

    def abandon_in_flight(self) -> None:
        """Resolve every request in flight with None, and tell the worker to drop them: the
        server is shutting down and will not wait for them."""
        abandoned = list(self._in_flight.values())
        self._in_flight.clear()
        if abandoned:
            self._send_now(wire.Cancel([in_flight.submit.request_id for in_flight in abandoned]))
        for in_flight in abandoned:
            in_flight.resolve(None)

    def cancel(self, request_id: int) -> None:
        if self._in_flight.pop(request_id, None) is not None:
            self._send_now(wire.Cancel([request_id]))

    def _send_now(self, message: wire.Message) -> bool:
        """Write one message to the worker at once; False if it is not connected.

        Messages are not held to share a frame with others from the same loop turn: a flush
        scheduled with `call_soon` runs after everything else the loop has queued, and under
        overload that queue held a request back from its worker for tens of milliseconds
        (benchmarks/README.md, "Where a completed request's time goes"). A message that cannot be
        encoded is dropped and, if it is a request, answered with the reason (400: a value out of
        the wire's range; the API bounds the ones it knows, so one that gets here is also a gap in
        its checks, logged as an error)."""
        if self.is_lost and not isinstance(message, wire.Hello):
            return False
        try:
            frame = wire.encode(message)
        except Exception as exc:
            log.error("cannot encode a %s for worker %s: %s", type(message).__name__, self.worker_id, exc)
            if isinstance(message, wire.Submit):
                self._refuse_unsent(message, exc)
            return True
        return self._channel.send(frame)

    def _refuse_unsent(self, message: wire.Submit, exc: Exception) -> None:
        in_flight = self._in_flight.pop(message.request_id, None)
        if in_flight is None:
            return
        self._unreported.discard(message.request_id)
        error = f"the request could not be sent to a worker: {exc}"
        in_flight.resolve(wire.Result(message.request_id, wire.Outcome.FAILED, message=error,
                                      errors=[wire.ItemError(-1, error)]))

    def mark_lost(self, *, is_dead: bool = True) -> list[InFlight]:
        """Resolve every in-flight request with None and return them.

        `is_dead`: the process is known to have exited (its late reports will be ignored). A
        worker that only went silent may come back; its next report makes it ready again.
        """
        self.is_lost = True
        if self.state is not None and is_dead:
            self._lost_incarnation = self.state.incarnation
        self.state = None
        self._update_readiness()
        lost = list(self._in_flight.values())
        self._in_flight.clear()
        for in_flight in lost:
            in_flight.resolve(None)
        for synced in list(self._syncs.values()):
            synced.cancel()  # it will not answer: the model's load is not known to have finished
        return lost

    def _on_frame(self, data: bytes) -> None:
        try:
            messages = wire.decode(data)
        except Exception:
            log.warning("undecodable message from worker %s", self.worker_id)
            return
        for message in messages:
            self._on_message(message)

    def _on_message(self, message: wire.Message) -> None:
        if isinstance(message, wire.Result):
            in_flight = self._in_flight.pop(message.request_id, None)
            if in_flight is None:
                return
            self._unreported.discard(message.request_id)  # answered: no longer queued anywhere
            in_flight.resolve(message)
        elif isinstance(message, wire.TokenChunk):
            in_flight = self._in_flight.get(message.request_id)
            if in_flight is not None:
                in_flight.is_started = True
                if in_flight.chunks is not None:
                    in_flight.chunks.put_nowait(message)
        elif isinstance(message, wire.Started):
            for request_id in message.request_ids:
                started = self._in_flight.get(request_id)
                if started is not None:
                    started.is_started = True
        elif isinstance(message, wire.BatchStats):
            self.on_batch_stats(message)
        elif isinstance(message, wire.ModelSynced):
            synced = self._syncs.get(message.sync_id)
            if synced is not None and not synced.done():
                synced.set_result(message)
        elif isinstance(message, wire.WorkerState):
            if message.incarnation == self._lost_incarnation:
                return  # a late report from a process that has since died
            if self.state is not None and message.incarnation != self.state.incarnation:
                self._lose_previous_incarnation(self.state.incarnation)
            self._sent_before_connect = set()  # the same process, or the rest: sent to this one
            self.is_lost = False
            models_changed = message.models != self.known_models or message.dormant != self.dormant \
                or message.loading != self.loading or (self.state is not None and message.refused != self.state.refused)
            self.known_models = message.models
            self.dormant = message.dormant
            self.loading = message.loading
            if models_changed:
                self._served = {(info.name, info.version): info for info in message.models}
            self.state = message
            self.state_at = time.monotonic()
            self._update_readiness()
            if models_changed:
                self.on_change()
            # the report counts what the worker had received when it built it: count only the rest
            self._unreported.reported_up_to(message.seen_request_id)
            self._item_s = {(q.model, q.version): q.item_s for q in message.queues}
            self._newcomer_s = {(q.model, q.version): q.newcomer_s for q in message.queues}
            self._provisional = {(q.model, q.version) for q in message.queues if q.is_provisional}
            self._upstreams = {(u.model, u.version): u for u in message.upstreams}
            self._sent_to_upstream.clear()

    async def _hello_loop(self) -> None:
        """Introduce ourselves until the worker answers, and again whenever its reports stop."""
        while True:
            if self._is_silent():
                await asyncio.sleep(0)  # read what is already waiting first: it may be us that were slow
                if self._is_silent():
                    log.warning("worker %s silent for %.1f s with requests in flight; treating it as lost",
                                self.worker_id, time.monotonic() - self.state_at)
                    self.mark_lost(is_dead=False)
            if time.monotonic() - self.state_at > HELLO_EVERY_S:
                self._introduce()
            self._update_readiness()
            await asyncio.sleep(HELLO_EVERY_S)

    def _is_silent(self) -> bool:
        return self.state is not None and bool(self._in_flight) and time.monotonic() - self.state_at > STALE_AFTER_S

    def _introduce(self) -> None:
        """Ask for the worker's state, and give it the tenants' weights (it may have restarted)."""
        self._send_now(wire.Hello(self._gateway_id))
        if self._weights is not None:
            self._send_now(wire.TenantWeights(self._weights))


class _Unreported:
    """Work sent to the worker that its last report does not count, per (tenant, class) flow.

    A report names the highest request id the worker had received when it built it; requests
    sent after that (still in the socket, or sent while the report was on its way back) stay
    counted here until a report covers them or they are answered. Without the id, a report
    that arrives late (either loop busy) would wipe out work the worker has not seen yet, and
    the gateway would forward requests the worker then has to refuse.
    """

    def __init__(self) -> None:
        self._order: collections.deque[int] = collections.deque()
        self._sent: dict[int, tuple[tuple[str, int], float]] = {}
        self._flows: dict[tuple[str, int], list[float]] = {}  # flow -> [number of requests, work]

    def add(self, request_id: int, flow: tuple[str, int], work_s: float) -> None:
        self._order.append(request_id)
        self._sent[request_id] = (flow, work_s)
        totals = self._flows.get(flow)
        if totals is None:
            self._flows[flow] = [1, work_s]
        else:
            totals[0] += 1
            totals[1] += work_s

    def discard(self, request_id: int) -> None:
        entry = self._sent.pop(request_id, None)
        if entry is None:
            return
        flow, work_s = entry
        totals = self._flows[flow]
        totals[0] -= 1
        totals[1] = totals[1] - work_s if totals[0] else 0.0  # exact zero, not float residue

    def reported_up_to(self, request_id: int) -> None:
        """A report counts every request up to `request_id` (0: it does not say; count it all)."""
        while self._order and (request_id == 0 or self._order[0] <= request_id):
            self.discard(self._order.popleft())

    def flow_work_s(self, flow: tuple[str, int]) -> float:
        totals = self._flows.get(flow)
        return totals[1] if totals is not None else 0.0

    def total_s(self) -> float:
        return sum(work_s for _, work_s in self._flows.values())
