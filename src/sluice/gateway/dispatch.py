"""Sending an admitted request to a worker and waiting for its answer (`Dispatcher`).

    dispatch ─▶ send ─▶ choose (router, ejections, early refusal) ─▶ WorkerConnection.submit
       ▲          │ no ready replica: wait while one that died may come back
       └──────────┴── the worker died before starting it, or refused it while draining: again

A request always ends in an answer or one of the errors in `sluice.errors`: the worker answers
every request it accepted, a worker that dies resolves its in-flight requests at once (sent
again if they had not started and the deadline allows), a replica whose device failed one is
passed over for another (`router.Ejections`), and a last-resort timer covers a worker that goes
silent (`GatewayConfig.answer_grace_s`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncGenerator, Callable

from sluice import wire
from sluice.clock import Clock
from sluice.errors import DeadlineExceeded, ModelNotReady, ShuttingDown, WorkerLost
from sluice.gateway import router
from sluice.gateway.admission import excess_s, overloaded
from sluice.gateway.config import GatewayConfig
from sluice.gateway.connection import InFlight, WorkerConnection
from sluice.gateway.model_index import ModelIndex
from sluice.gateway.ticket import InferResult, Ticket, interpret, is_device_failure
from sluice.metrics import GatewayMetrics

log = logging.getLogger("sluice.gateway")


class Dispatcher:
    """Runs admitted requests on the workers of `connections` (the gateway's own table, shared)."""

    def __init__(self, clock: Clock, metrics: GatewayMetrics, config: GatewayConfig,
                 connections: dict[str, WorkerConnection], indexed: Callable[[], ModelIndex],
                 rng: random.Random, ejections: router.Ejections) -> None:
        self._clock = clock
        self._metrics = metrics
        self._config = config
        self._connections = connections
        self._indexed = indexed
        self._rng = rng
        self._ejections = ejections
        self._affinity = router.PrefixAffinity()
        self._next_id = 0
        self._is_past_grace = False

    async def dispatch(self, info: wire.ModelInfo, payload: wire.Payload, ticket: Ticket) -> InferResult:
        tried_lost = False
        failed_on: set[str] = set()  # replicas whose device failed this request
        while True:
            connection, in_flight = await self._send(info, payload, ticket, tried_lost, failed_on)
            result = await self._await_answer(connection, in_flight, ticket.deadline)
            if _is_refused_draining(connection, result):
                continue
            if result is not None:
                if ((result.outcome is not wire.Outcome.OK or not self._ejections.is_clear)
                        and self._device_failed(connection, info, result) and self._clock.now() < ticket.deadline):
                    failed_on.add(connection.worker_id)
                    if self._has_replica_besides(info, failed_on):  # another may well succeed
                        self._metrics.retried(info.name, info.version)
                        continue
                ticket.used(result)
                return interpret(connection.served(info), result)
            self._check_restartable(info, in_flight)
            tried_lost = True

    async def whole(self, info: wire.ModelInfo, payload: wire.Payload, ticket: Ticket) -> InferResult:
        """The final result of an unstreamed generation."""
        events = self.dispatch_stream(info, payload, ticket)
        try:
            async for event in events:
                if isinstance(event, InferResult):
                    return event
        finally:
            await events.aclose()
        raise RuntimeError("a generation ended without a result")

    def _device_failed(self, connection: WorkerConnection, info: wire.ModelInfo, result: wire.Result) -> bool:
        """Whether the replica's device failed the request; counted towards its ejection."""
        key = (connection.worker_id, info.name, info.version)
        if not is_device_failure(result):
            self._ejections.succeeded(key)
            return False
        ejected_s = self._ejections.failed(key, self._clock.now())
        if ejected_s:
            log.warning("worker %s failed %d requests of %s v%s in a row on its device: it gets none of "
                        "them for %.0f s while another replica serves the model", connection.worker_id,
                        self._ejections.threshold, info.name, info.version, ejected_s)
        return True

    def _has_replica_besides(self, info: wire.ModelInfo, excluded: set[str]) -> bool:
        return any(c.is_ready and c.worker_id not in excluded
                   for c in self._indexed().replicas.get((info.name, info.version), ()))

    async def dispatch_stream(
        self, info: wire.ModelInfo, payload: wire.Payload, ticket: Ticket
    ) -> AsyncGenerator[wire.TokenChunk | InferResult, None]:
        tried_lost = False
        while True:
            connection, in_flight = await self._send(info, payload, ticket, tried_lost)
            timer = connection.resolve_after(in_flight, ticket.deadline - self._clock.now()
                                             + self._config.answer_grace_s)
            try:
                while in_flight.chunks is not None and (chunk := await in_flight.chunks.get()) is not None:
                    ticket.chunk(chunk)
                    yield chunk
                result = await in_flight.future
            finally:  # also when the consumer stops early (the client went away)
                timer.cancel()
                # an unstreamed generation waits on the future itself, which its cancellation
                # cancels (done, with no answer): that too is a request to withdraw
                if not in_flight.future.done() or in_flight.future.cancelled():
                    connection.cancel(in_flight.submit.request_id)
            if in_flight.is_timed_out:
                raise DeadlineExceeded("the worker did not answer before the deadline")
            if _is_refused_draining(connection, result):
                continue
            if result is not None:
                if result.outcome is not wire.Outcome.OK or not self._ejections.is_clear:
                    self._device_failed(connection, info, result)  # counted; a stream is not sent again
                ticket.used(result)
                yield interpret(connection.served(info), result)
                return
            self._check_restartable(info, in_flight)
            tried_lost = True

    async def _send(self, info: wire.ModelInfo, payload: wire.Payload, ticket: Ticket,
                    tried_lost: bool, avoid: set[str] | None = None) -> tuple[WorkerConnection, InFlight]:
        """Submit to the best ready replica (not one in `avoid`, whose device failed the request),
        waiting (within the deadline) for one to recover if the one that had the request died."""
        self._next_id += 1
        request_id = self._next_id
        while True:
            self._check_past_grace()
            now = self._clock.now()
            if now >= ticket.deadline:
                if tried_lost:
                    raise WorkerLost(f"the worker serving model {info.name!r} (version {info.version}) stopped "
                                     "(it crashed or was killed) and none took its place before this request's "
                                     "deadline; it was not charged: retry it", retry_after_s=1.0)
                raise DeadlineExceeded("deadline passed before a worker could take the request")
            connection = self.choose(info, ticket, payload, avoid)
            if connection is None:
                if tried_lost or self._is_recovering(info):
                    tried_lost = True
                    await asyncio.sleep(self._config.redispatch_poll_s)
                    continue
                raise ModelNotReady(f"no ready worker serves {info.name} v{info.version}", retry_after_s=1.0)
            submit = wire.Submit(request_id, info.name, info.version, payload, ticket.deadline - now,
                                 ticket.tenant, int(ticket.priority), ticket.background,
                                 ticket.outgoing_trace())
            in_flight = connection.submit(submit)
            if in_flight is not None:
                return connection, in_flight
            await asyncio.sleep(self._config.redispatch_poll_s)  # not connected at this instant

    def end_grace(self) -> None:
        """The server is shutting down and its grace period is over: every request still in
        flight ends now with `ShuttingDown` (a 503 its client can retry elsewhere), rather than
        with its connection dropped when the server exits."""
        self._is_past_grace = True
        for connection in list(self._connections.values()):
            connection.abandon_in_flight()

    def _check_past_grace(self) -> None:
        if self._is_past_grace:
            raise ShuttingDown("the server is shutting down and its grace period for requests in flight "
                               "ended before this one finished; retry it", retry_after_s=1.0)

    def _check_restartable(self, info: wire.ModelInfo, in_flight: InFlight) -> None:
        """The worker was lost with the request: send it again only if it had not started. The
        client's error says what happened in its terms (the gateway's log names the worker)."""
        self._check_past_grace()
        if in_flight.is_started:
            model = f"model {info.name!r} (version {info.version})"
            if in_flight.chunks is not None:  # a stream: what it sent counts
                raise WorkerLost(f"the worker serving {model} stopped (it crashed or was killed) while generating "
                                 "this stream, which ended early; only the tokens sent were charged: retry it",
                                 retry_after_s=1.0)
            raise WorkerLost(f"the worker serving {model} stopped (it crashed or was killed) while running this "
                             "request, which did not complete; it was not charged: retry it", retry_after_s=1.0)
        self._metrics.redispatched(1)

    def _is_recovering(self, info: wire.ModelInfo) -> bool:
        """A worker that served this model is down but expected back (e.g. being restarted)."""
        return info.name in self._indexed().with_recovering and any(
            c.is_lost and info in c.known_models for c in self._connections.values())

    def choose(self, info: wire.ModelInfo, ticket: Ticket, payload: wire.Payload,
               avoid: set[str] | None = None) -> WorkerConnection | None:
        """The replica to send the request to (None: no ready one); raises `Overloaded` if it
        would not meet the request's deadline."""
        replicas = self._indexed().replicas.get((info.name, info.version), ())
        ready = [router.Candidate(c.worker_id, c.predicted_wait_for(info.name, info.version))
                 for c in replicas if c.is_ready and not (avoid and c.worker_id in avoid)]
        candidates = self._ejections.healthy(ready, info.name, info.version, self._clock.now())
        by_id = {c.worker_id: c for c in replicas}
        prompt = None
        if self._config.prefix_affinity and len(candidates) > 1:
            prompt = router.prompt_bytes(payload, self._affinity.max_bytes)
        keys: list[bytes] = []
        if prompt is None:
            chosen = router.choose(candidates, self._rng)
        else:  # a generation among several replicas: where its prompt's prefix is cached, if not too busy
            keys = self._affinity.keys(router.affinity_scope(ticket.tenant, info.name, info.version, payload), prompt)
            chosen, by_affinity = self._affinity.choose(candidates, keys, self._rng)
            self._metrics.prefix_routed(info.name, info.version, by_affinity)
        if chosen is None:
            return None
        connection = by_id[chosen.worker_id]
        # The worker's admission stays the authority; refusing here what it would refuse spares
        # the round trip (most of a rejection's latency under overload).
        late_s = excess_s(connection, ticket.tenant, ticket.priority, info, self._clock.now(), ticket.deadline)
        if late_s > 0:
            raise overloaded(self._metrics, connection, info, late_s, wire.num_items(payload))
        if keys:
            self._affinity.record(keys, chosen.worker_id)
        return connection

    async def _await_answer(
        self, connection: WorkerConnection, in_flight: InFlight, deadline: float
    ) -> wire.Result | None:
        budget = deadline - self._clock.now() + self._config.answer_grace_s
        timer = connection.resolve_after(in_flight, budget)
        try:
            result = await in_flight.future
        except asyncio.CancelledError:  # the client went away: withdraw the request
            connection.cancel(in_flight.submit.request_id)
            raise
        finally:
            timer.cancel()
        if in_flight.is_timed_out:
            raise DeadlineExceeded("the worker did not answer before the deadline")
        return result


def _is_refused_draining(connection: WorkerConnection, result: wire.Result | None) -> bool:
    """The worker did not take the request because it is draining: it goes to another worker."""
    if result is None or result.outcome is not wire.Outcome.DRAINING:
        return False
    connection.mark_draining()
    return True
