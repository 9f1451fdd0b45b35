"""Shadow copies at the gateway (`gateway.shadow` decides which): each runs in a background task
this class owns, on the shadow version, while the original runs as it always did.

    Gateway.infer ──copy()──▶ Copy ──task: dispatch to the shadow version (batch class, the
         │                     ▲      original's deadline, no tenant accounting) ─▶ metrics
         └── answered(payload) ┘      then compare with the client's answer, once it has one

A copy never touches the client's answer: it starts beside the original, its errors end in a
metric (`sluice_shadow_requests_total`), and it is dispatched with a ticket that is never
settled, so the tenant's limits, budgets and request metrics, the model's statistics and its
canary see nothing of it. It does not go through the result cache.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from sluice import wire
from sluice.clock import Clock
from sluice.errors import DeadlineExceeded, InvalidInput, ModelNotReady, Overloaded, ShuttingDown, SluiceError
from sluice.gateway.limits import Reservation
from sluice.gateway.shadow import Shadows, same_answer
from sluice.gateway.tenancy import Tenancy
from sluice.gateway.ticket import InferResult, Ticket
from sluice.metrics import GatewayMetrics
from sluice.priority import Priority

log = logging.getLogger("sluice.gateway")

MAX_COPIES_IN_FLIGHT = 256
"""Copies of one model in flight at most: copies skip the gateway's admission, so a slow shadow
version must not pile them up on the workers; beyond this a copy is not sent (counted `refused`)."""

Run = Callable[[wire.ModelInfo, wire.Payload, Ticket], Awaitable[InferResult]]


class Copy:
    """One request's copy in flight: told the client's answer (`answered`) to compare it with."""

    def __init__(self) -> None:
        self._answer: asyncio.Future[wire.Payload | None] = asyncio.get_running_loop().create_future()

    def answered(self, payload: wire.Payload | None) -> None:
        """The answer the client got (None: it got an error, nothing to compare)."""
        if not self._answer.done():
            self._answer.set_result(payload)

    async def answer(self) -> wire.Payload | None:
        return await self._answer


class Mirror:
    """Sends the copies `shadows` asks for, and counts how they went."""

    def __init__(self, clock: Clock, metrics: GatewayMetrics, tenancy: Tenancy, shadows: Shadows,
                 rng: random.Random, served: Callable[[str], dict[str, wire.ModelInfo]], run: Run) -> None:
        """`served`: a model's ready versions; `run`: dispatch a request to a version (and wait)."""
        self._clock = clock
        self._metrics = metrics
        self._tenancy = tenancy
        self.shadows = shadows
        self._rng = rng
        self._served = served
        self._run = run
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_flight: dict[str, int] = {}
        self.is_closed = False

    def copy(self, info: wire.ModelInfo, payload: wire.Payload, tenant: str, started: float,
             deadline: float) -> Copy | None:
        """Copy a request that named no version, routed to `info`, if the model's shadow takes it."""
        version = self.shadows.target(info.name, info.version, self._rng)
        if version is None:
            return None
        if self._in_flight.get(info.name, 0) >= MAX_COPIES_IN_FLIGHT:
            self._metrics.shadow_done(info.name, version, "refused")
            return None
        copy = Copy()
        task = asyncio.get_running_loop().create_task(
            self._send(info.name, version, payload, tenant, started, deadline, copy))
        self._tasks.add(task)
        self._in_flight[info.name] = self._in_flight.get(info.name, 0) + 1
        task.add_done_callback(lambda done: self._forget(info.name, done))
        return copy

    def _forget(self, name: str, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        left = self._in_flight.get(name, 1) - 1
        if left > 0:
            self._in_flight[name] = left
        else:
            self._in_flight.pop(name, None)

    async def _send(self, name: str, version: str, payload: wire.Payload, tenant: str, started: float,
                    deadline: float, copy: Copy) -> None:
        target = self._served(name).get(version)
        if target is None or self.is_closed:
            self._metrics.shadow_done(name, version, "dropped")
            return
        # never entered (`async with`): nothing is settled, recorded or observed for it
        ticket = Ticket(self._metrics, self._tenancy, self._clock, target, tenant, Priority.BATCH,
                        Reservation(tenant, 0.0, ()), started, deadline)
        try:
            result = await self._run(target, payload, ticket)
        except asyncio.CancelledError:
            self._metrics.shadow_done(name, version, "dropped")
            raise
        except Exception as exc:  # whatever happens to a copy ends here
            outcome = _outcome(exc)
            if outcome == "failed" and not isinstance(exc, SluiceError):
                log.exception("a shadow copy to model %s version %s failed", name, version)
            self._metrics.shadow_done(name, version, outcome)
            return
        self._metrics.shadow_done(name, version, "ok", self._clock.now() - started)
        answered = await copy.answer()
        if answered is not None:
            is_same = same_answer(answered, result.payload)
            if is_same is not None:
                self._metrics.shadow_compared(name, version, is_same)

    async def aclose(self) -> None:
        """Cancel the copies in flight (counted dropped)."""
        self.is_closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _outcome(error: BaseException) -> str:
    """A copy's error as its outcome label (`sluice_shadow_requests_total`)."""
    if isinstance(error, ShuttingDown | ModelNotReady):
        return "dropped"
    if isinstance(error, Overloaded):
        return "refused"
    if isinstance(error, DeadlineExceeded):
        return "expired"
    if isinstance(error, InvalidInput):
        return "invalid"
    return "failed"  # a device failure, a lost worker, an internal error
