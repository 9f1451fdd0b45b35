"""A discrete-event simulation of one device: a `Scheduler` on a `VirtualClock`, fed a list of
arrivals, running each batch on an emulated device that takes `alpha + beta * padded_cost` seconds.

    arrivals ──admit──▶ Scheduler ──next_batch, when the device frees──▶ emulated device
        │                  ▲                                                  │
        └──cancel at t─────┘◀───────────── batch_done(exec_s) ────────────────┘

The driver does what the worker does (`sluice.worker.server`): admit on arrival, form a batch the
moment the device is idle, report it done, form the next one at once. It is pure and deterministic
(the same arrivals and seed give the same trace), so tests use it to check the scheduler's
invariants over random workloads, and capacity planning uses it to ask how many requests per
second a device serves within their deadlines.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sluice.clock import VirtualClock
from sluice.scheduler.batcher import Admitted, Batch, ModelKey, Rejected, Scheduler, WorkItem


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request: when it arrives, for which model, its items' costs and its time budget."""

    at_s: float
    model: ModelKey
    costs: tuple[int, ...]
    timeout_s: float
    cancel_after_s: float | None = None
    """The client withdraws the request this long after it arrived (if it is still queued)."""


@dataclass(frozen=True, slots=True)
class EmulatedDevice:
    """A batch takes `alpha_s + beta_s * padded_cost` seconds, times a uniform jitter factor."""

    alpha_s: float
    beta_s: float
    jitter: float = 0.0

    def exec_s(self, padded_cost: int, rng: random.Random) -> float:
        seconds = self.alpha_s + self.beta_s * padded_cost
        if self.jitter:
            seconds *= max(0.0, 1.0 + rng.uniform(-self.jitter, self.jitter))
        return seconds


@dataclass(frozen=True, slots=True)
class Admission:
    request_id: int
    at_s: float
    deadline_s: float
    outcome: Admitted | Rejected
    work_ahead_s: float
    """The scheduler's work ahead (all models) right after it decided."""
    num_queued: int
    """Items in this model's queue right after it decided."""


@dataclass(frozen=True, slots=True)
class ExecutedBatch:
    batch: Batch
    started_at_s: float
    finished_at_s: float


@dataclass(frozen=True, slots=True)
class Expiry:
    item: WorkItem
    at_s: float


@dataclass(frozen=True, slots=True)
class Cancellation:
    request_id: int
    at_s: float
    num_removed: int


@dataclass(slots=True)
class Trace:
    """Everything that happened, in time order. Request ids are indices into the arrivals."""

    admissions: list[Admission] = field(default_factory=list)
    batches: list[ExecutedBatch] = field(default_factory=list)
    expiries: list[Expiry] = field(default_factory=list)
    cancellations: list[Cancellation] = field(default_factory=list)
    end_s: float = 0.0

    def num_items_on_time(self) -> int:
        """Executed items that finished by their deadline: the goodput count."""
        return sum(
            1 for run in self.batches for item in run.batch.items if run.finished_at_s <= item.deadline + 1e-9
        )

    def busy_s(self) -> float:
        return sum(run.finished_at_s - run.started_at_s for run in self.batches)


# Events at the same instant: a finishing batch first (the device frees), then cancels, then arrivals.
_DONE, _CANCEL, _ARRIVE = 0, 1, 2


def simulate(
    scheduler: Scheduler,
    clock: VirtualClock,
    arrivals: Sequence[Arrival],
    devices: Mapping[ModelKey, EmulatedDevice],
    *,
    seed: int = 0,
) -> Trace:
    """Run `arrivals` (request id = index) through `scheduler` until every queue is empty."""
    rng = random.Random(seed)
    trace = Trace()
    seq = itertools.count()
    events: list[tuple[float, int, int, object]] = []
    for request_id, arrival in enumerate(arrivals):
        if arrival.at_s < clock.now():
            raise ValueError("an arrival is earlier than the clock")
        heapq.heappush(events, (arrival.at_s, _ARRIVE, next(seq), request_id))
    running: ExecutedBatch | None = None
    while events:
        at_s, kind, _, payload = heapq.heappop(events)
        clock.set(at_s)
        if kind == _DONE:
            assert isinstance(payload, ExecutedBatch) and payload is running
            scheduler.batch_done(payload.batch, payload.finished_at_s - payload.started_at_s)
            trace.batches.append(payload)
            running = None
        elif kind == _CANCEL:
            assert isinstance(payload, int)
            trace.cancellations.append(Cancellation(payload, at_s, scheduler.cancel(payload)))
        else:
            assert isinstance(payload, int)
            arrival = arrivals[payload]
            deadline = at_s + arrival.timeout_s
            outcome = scheduler.admit(arrival.model, payload, arrival.costs, deadline)
            num_queued, _ = scheduler.queue_state(arrival.model)
            trace.admissions.append(
                Admission(payload, at_s, deadline, outcome, scheduler.work_ahead_s(), num_queued)
            )
            if isinstance(outcome, Admitted) and arrival.cancel_after_s is not None:
                heapq.heappush(events, (at_s + arrival.cancel_after_s, _CANCEL, next(seq), payload))
        if running is None and scheduler.is_idle:
            running = _start_next(scheduler, clock, devices, rng, trace)
            if running is not None:
                heapq.heappush(events, (running.finished_at_s, _DONE, next(seq), running))
    trace.end_s = clock.now()
    return trace


def _start_next(
    scheduler: Scheduler,
    clock: VirtualClock,
    devices: Mapping[ModelKey, EmulatedDevice],
    rng: random.Random,
    trace: Trace,
) -> ExecutedBatch | None:
    now = clock.now()
    decision = scheduler.next_batch()
    trace.expiries.extend(Expiry(item, now) for item in decision.expired)
    if decision.batch is None:
        return None
    exec_s = devices[decision.batch.model].exec_s(decision.batch.padded_cost, rng)
    return ExecutedBatch(decision.batch, now, now + exec_s)
