"""A discrete-event simulation of one device: a `Scheduler` on a `VirtualClock`, fed a list of
arrivals, running each batch on an emulated device that takes `alpha + beta * padded_cost` seconds.

    arrivals ──admit──▶ Scheduler ──next_batch, when the device frees──▶ emulated device
        │                  ▲                                                  │
        └──cancel at t─────┘◀───────────── batch_done(exec_s) ────────────────┘

The driver does what the worker does (`sluice.worker.batches`): admit on arrival, form a batch the
moment the device is idle, report it done, form the next one at once. It is pure and deterministic
(the same arrivals and seed give the same trace), so tests use it to check the scheduler's
invariants over random workloads, and capacity planning uses it to ask how many requests per
second a device serves within their deadlines.

Arrivals carry a tenant and a priority class; `tenant_arrivals` draws Poisson traffic for several
`TenantLoad`s, and `summarize` reports, per (tenant, class), goodput, latency percentiles and
device-time shares, and the device's busy ratio.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sluice.clock import VirtualClock
from sluice.priority import Priority
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
    tenant: str = ""
    priority: Priority = Priority.STANDARD
    background: bool = False
    """A batch job's request (`Scheduler.admit`'s `background`)."""


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
    device_s: dict[int, float] = field(default_factory=dict)
    """Per request id: its share of its batches' device time, as `batch_done` reported it."""
    end_s: float = 0.0

    def num_items_on_time(self) -> int:
        """Executed items that finished by their deadline: the goodput count."""
        return sum(
            1 for run in self.batches for item in run.batch.items if run.finished_at_s <= item.deadline + 1e-9
        )

    def busy_s(self) -> float:
        return sum(run.finished_at_s - run.started_at_s for run in self.batches)


# Events at the same instant: a finishing batch first (the device frees), then cancels, then arrivals.
_DONE, _CANCEL, _ARRIVE, _WAKE = 0, 1, 2, 3


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
            shares = scheduler.batch_done(payload.batch, payload.finished_at_s - payload.started_at_s)
            for request_id, device_s in shares.items():
                trace.device_s[request_id] = trace.device_s.get(request_id, 0.0) + device_s
            trace.batches.append(payload)
            running = None
        elif kind == _WAKE:
            pass  # held background work may start now (below)
        elif kind == _CANCEL:
            assert isinstance(payload, int)
            trace.cancellations.append(Cancellation(payload, at_s, scheduler.cancel(payload)))
        else:
            assert isinstance(payload, int)
            arrival = arrivals[payload]
            deadline = at_s + arrival.timeout_s
            outcome = scheduler.admit(arrival.model, payload, arrival.costs, deadline,
                                      tenant=arrival.tenant, priority=arrival.priority,
                                      background=arrival.background)
            num_queued, _ = scheduler.queue_state(arrival.model)
            trace.admissions.append(
                Admission(payload, at_s, deadline, outcome, scheduler.work_ahead_s(), num_queued)
            )
            if isinstance(outcome, Admitted) and arrival.cancel_after_s is not None:
                heapq.heappush(events, (at_s + arrival.cancel_after_s, _CANCEL, next(seq), payload))
        if running is None and scheduler.is_idle:
            running, retry_at = _start_next(scheduler, clock, devices, rng, trace)
            if running is not None:
                heapq.heappush(events, (running.finished_at_s, _DONE, next(seq), running))
            elif retry_at is not None and retry_at > at_s:
                heapq.heappush(events, (retry_at, _WAKE, next(seq), None))
    trace.end_s = clock.now()
    return trace


def _start_next(
    scheduler: Scheduler,
    clock: VirtualClock,
    devices: Mapping[ModelKey, EmulatedDevice],
    rng: random.Random,
    trace: Trace,
) -> tuple[ExecutedBatch | None, float | None]:
    now = clock.now()
    decision = scheduler.next_batch()
    trace.expiries.extend(Expiry(item, now) for item in decision.expired)
    if decision.batch is None:
        return None, decision.retry_at
    exec_s = devices[decision.batch.model].exec_s(decision.batch.padded_cost, rng)
    return ExecutedBatch(decision.batch, now, now + exec_s), None


# -- multi-tenant workloads and their summary ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """One tenant's traffic in one class: Poisson arrivals of single-item requests."""

    tenant: str
    rate_per_s: float
    cost_range: tuple[int, int]
    """Item costs, drawn uniformly from this inclusive range."""
    timeout_s: float
    priority: Priority = Priority.STANDARD
    model: ModelKey = ("m", "1")
    start_s: float = 0.0
    """When the tenant starts sending."""
    background: bool = False
    """Its requests are a batch job's (`Arrival.background`)."""


def tenant_arrivals(loads: Sequence[TenantLoad], duration_s: float, seed: int) -> list[Arrival]:
    """Every load's arrivals until `duration_s`, merged in time order (deterministic per seed)."""
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    for load in loads:
        now = load.start_s + rng.expovariate(load.rate_per_s)
        while now < duration_s:
            cost = rng.randint(*load.cost_range)
            arrivals.append(Arrival(now, load.model, (cost,), load.timeout_s, tenant=load.tenant,
                                    priority=load.priority, background=load.background))
            now += rng.expovariate(load.rate_per_s)
    arrivals.sort(key=lambda arrival: arrival.at_s)
    return arrivals


@dataclass(frozen=True, slots=True)
class GroupSummary:
    """One (tenant, class) in a window of time."""

    tenant: str
    priority: Priority
    num_arrived: int
    """Requests that arrived in the window; the counts and latencies below are of these."""
    num_admitted: int
    num_on_time: int
    """Requests whose every item finished by its deadline."""
    latency_p50_s: float
    latency_p99_s: float
    """Of requests that completed on time (nan when none did)."""
    goodput_items_per_s: float
    """Items of any request that finished on time within the window, per second."""
    device_s: float
    """Device-seconds of batches that started in the window used by its items (split by cost)."""
    device_share: float
    """`device_s` over all device-seconds of those batches."""

    @property
    def success_ratio(self) -> float:
        return self.num_on_time / self.num_arrived if self.num_arrived else math.nan


@dataclass(frozen=True, slots=True)
class Summary:
    groups: dict[tuple[str, Priority], GroupSummary]
    busy_ratio: float
    """Device-seconds of batches started in the window over the window's length."""


Group = tuple[str, Priority]


def summarize(arrivals: Sequence[Arrival], trace: Trace, window: tuple[float, float]) -> Summary:
    """Per (tenant, class): what became of requests that arrived within `window`, and the goodput
    and device time each got within it."""
    start_s, end_s = window
    finished: dict[int, float] = {}
    num_on_time: dict[int, int] = {}
    good: dict[Group, int] = {}
    used_s: dict[Group, float] = {}
    for run in trace.batches:
        is_in_window = start_s <= run.started_at_s < end_s
        shares = run.batch.item_shares(run.finished_at_s - run.started_at_s)
        for item, share_s in zip(run.batch.items, shares, strict=True):
            group = (item.tenant, item.priority)
            finished[item.request_id] = max(finished.get(item.request_id, 0.0), run.finished_at_s)
            if run.finished_at_s <= item.deadline + 1e-9:
                num_on_time[item.request_id] = num_on_time.get(item.request_id, 0) + 1
                if start_s <= run.finished_at_s < end_s:
                    good[group] = good.get(group, 0) + 1
            if is_in_window:
                used_s[group] = used_s.get(group, 0.0) + share_s
    admitted = {a.request_id for a in trace.admissions if isinstance(a.outcome, Admitted)}
    by_group: dict[Group, list[int]] = {}
    for request_id, arrival in enumerate(arrivals):
        if start_s <= arrival.at_s < end_s:
            by_group.setdefault((arrival.tenant, arrival.priority), []).append(request_id)
    total_used_s = sum(used_s.values())
    groups = {}
    for group in sorted(by_group.keys() | used_s.keys()):
        ids = by_group.get(group, [])
        on_time = [r for r in ids if num_on_time.get(r, 0) == len(arrivals[r].costs)]
        latencies = sorted(finished[r] - arrivals[r].at_s for r in on_time)
        groups[group] = GroupSummary(
            group[0], group[1], len(ids), sum(1 for r in ids if r in admitted), len(on_time),
            percentile(latencies, 0.5), percentile(latencies, 0.99),
            good.get(group, 0) / (end_s - start_s),
            used_s.get(group, 0.0), used_s.get(group, 0.0) / total_used_s if total_used_s else 0.0,
        )
    return Summary(groups, total_used_s / (end_s - start_s))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values (the nearest rank at or above it; nan when there are none)."""
    if not sorted_values:
        return math.nan
    return sorted_values[min(int(q * len(sorted_values)), len(sorted_values) - 1)]
