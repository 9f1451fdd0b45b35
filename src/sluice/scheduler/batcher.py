"""The device scheduler: which queued items run together next, decided when the device frees.

    admit(request, tenant, class) ──▶ per-model queue: per length bucket, a deadline heap per
         │                            flow (class, tenant)                     (model_queue.py)
         └─ Rejected(retry_after_s) when the work            │
            ahead of it (below) would make it late           ▼ next_batch(), when the device frees
                                      1. class: strict priority; a lower class owed its minimum
                                         share goes first                       (fair.ClassShares)
                                      2. tenant: start-time fair queueing, smallest tag (fair.FairShare)
                                      3. item: that tenant's earliest deadline; it fixes the batch's
                                         (model version, length bucket)
                                      4. fill: same-class items of that bucket in tag order, then
                                         other classes' compatible items, within the limits and
                                         the earliest member's deadline; background (batch job)
                                         items only ride in an online batch's spare room and head
                                         one only when online work is quiet  (backlog.py)
                                                             │
                                                             ▼ device ──▶ batch_done(exec_s):
                                        expired items come back     measured time, split by cost,
                                        in Decision.expired (504)   replaces the predicted charges

Invariants:
- a lone request at an idle device starts at once: there is no batching window;
- a batch holds items of one model version and one length bucket (costs within a factor of two,
  so padding wastes under half the batch; background riders may come from shorter buckets), at
  most `max_batch_size` items and `max_batch_cost` padded cost (an item costlier than that alone
  runs alone), and is never so large that its predicted time misses its earliest member's deadline;
- an item whose deadline cannot be met by running it alone, now, never reaches the device, and
  neither does any other item of its request: they all come back in `Decision.expired`;
- every admitted item leaves exactly once: in a batch, in `Decision.expired`, or by `cancel()`;
- queued work is bounded in device-seconds: admission refuses, at once, a request whose
  predicted completion behind the work that will run before it is past its deadline (see
  `admit`); with one tenant in one class that is all the work queued, so
  `now + work_ahead_s() <= deadline` for every request right after it is admitted (but while
  a model's profile is provisional, which leaves its running batch out: `_fits_first_batches`);
- fairness and the class starvation bound are stated in `fair.py`;
- nothing grows without bound: queues by that rule and `max_queue_items` per (class, tenant),
  heaps by compaction.

Under overload the device stays busy with full batches and the excess is refused early: the
simulation tests (`tests/scheduler/test_simulate.py`, `test_fair_simulate.py`) hold goodput at
2x and 3x capacity to >= 90%, and tenants' device-time shares to their weights.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sluice.clock import Clock
from sluice.priority import Priority
from sluice.repository import BatchingConfig
from sluice.scheduler.backlog import Backlog, Batch, ModelKey
from sluice.scheduler.fair import DEFAULT_MIN_CLASS_SHARES, ClassShares, FairShare, TenantStats
from sluice.scheduler.model_queue import Estimate, ModelQueue, WorkItem
from sluice.scheduler.profile import LatencyProfile
from sluice.scheduler.waits import ClassWait, DemandRates, TenantWait, WaitReport, fair_excess_s, jump_rate

__all__ = ["Admitted", "Batch", "ClassWait", "Decision", "ModelKey", "RejectReason", "Rejected", "Scheduler",
           "TenantStats", "TenantWait", "WaitReport", "WorkItem"]


@dataclass(frozen=True, slots=True)
class Admitted:
    items: tuple[WorkItem, ...]


MIN_PROBE_SLOWDOWN = 2.0
"""Probes (`Scheduler.admit`) only once the profile's estimate rose this many times over its
fastest: not for the noise of a device running as usual."""


class RejectReason(enum.StrEnum):
    OVERLOADED = "overloaded"
    """The work queued ahead would make the request miss its deadline."""
    QUEUE_FULL = "queue_full"
    """The tenant's queue for the model, in its class, holds its maximum number of items."""
    DEADLINE_UNREACHABLE = "deadline_unreachable"
    """Even alone on an idle device the request would finish after its deadline."""


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: RejectReason
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    batch: Batch | None
    expired: tuple[WorkItem, ...] = ()
    retry_at: float | None = None
    """With no batch: background work was held back for online work's sake (`backlog.py`) and
    may start at this time on the scheduler's clock; call `next_batch` again then, if nothing
    else has."""


class Scheduler:
    """Queues and batch formation for one device. Not thread-safe: one event loop owns it."""

    def __init__(self, clock: Clock, *, drain_halflife_s: float = 2.0,
                 min_class_shares: Mapping[Priority, float] = DEFAULT_MIN_CLASS_SHARES,
                 background_ride_share: float = 0.02, background_quiet_arrivals: float = 0.05,
                 probe_interval_s: float = 5.0) -> None:
        """`background_ride_share` and `background_quiet_arrivals`: how far background (batch job)
        items yield to online work; see `backlog.py`. `probe_interval_s`: at most one probe per
        model in this long (`admit`)."""
        self._clock = clock
        self._probe_interval_s = probe_interval_s
        self._backlog = Backlog(FairShare(), ClassShares(min_class_shares), ride_share=background_ride_share,
                                quiet_arrivals=background_quiet_arrivals)
        self._queues = self._backlog.queues
        self._fair = self._backlog.fair  # read only: the backlog keeps it
        self._running: Batch | None = None
        self._running_since = 0.0
        self._running_credit_s = 0.0
        self._drain_halflife_s = drain_halflife_s
        self._drain_rate = 1.0
        self._last_done_at: float | None = None
        self._was_backlogged = False
        self._demand = DemandRates()

    # -- configuration -------------------------------------------------------------------------

    def add_model(self, key: ModelKey, batching: BatchingConfig, profile: LatencyProfile) -> None:
        if key in self._queues:
            raise ValueError(f"model {key[0]} v{key[1]} is already scheduled")
        self._queues[key] = ModelQueue(batching, profile)

    def remove_model(self, key: ModelKey) -> None:
        """Stop scheduling a model version that holds no work (queued or running): ValueError if it does."""
        queue = self._queues[key]
        if queue.num_items or (self._running is not None and self._running.model == key):
            raise ValueError(f"model {key[0]} v{key[1]} still has work")
        del self._queues[key]

    def profile(self, key: ModelKey) -> LatencyProfile:
        return self._queues[key].profile

    def models(self) -> list[ModelKey]:
        return list(self._queues)

    def set_tenant_weights(self, weights: Mapping[str, float], *, default_weight: float = 1.0) -> None:
        """Tenants' fair-share weights (a tenants file reload may call it at any time); tenants not
        named get `default_weight`. Applies to device time charged from now on."""
        self._fair.set_weights(weights, default_weight=default_weight)

    # -- admission -----------------------------------------------------------------------------

    def admit(self, key: ModelKey, request_id: int, costs: Sequence[int], deadline: float, *,
              tenant: str = "", priority: Priority = Priority.STANDARD,
              background: bool = False) -> Admitted | Rejected:
        """Queue every item of a request, or none of them. `background`: a batch job's request,
        which yields to online work (see `backlog.py`).

        Refused, checked in this order:
        - DEADLINE_UNREACHABLE: alone on an idle device it would still finish after `deadline`
          (but not, while the model's latency profile is provisional, on a device idle now: it
          runs at once, and its batch corrects a prediction that no batch could correct if every
          request were refused on it; nor, at most once per `probe_interval_s` per model, on a
          device idle now, when it would fit the device at its fastest and only the profile's
          estimate, raised `MIN_PROBE_SLOWDOWN` times or more (`LatencyProfile.slowdown`), refuses
          it: after a real slowdown that is over, such a probe is the only batch that can bring
          the estimate back down; a probe that ran faster than predicted lets the next request
          probe at once);
        - QUEUE_FULL: its tenant would have more than `max_queue_items` items queued in its class
          (a cap per flow, so that neither a flood of lower-class work nor another tenant's
          flood can lock a request out; tenants are bounded by configuration);
        - OVERLOADED: it would finish late behind the work that runs before it: the running
          batch's remainder, then, at the measured drain rate, all queued work and the other
          buckets' fill room less what will wait for it (lower classes' work, and in its own
          class what other tenants have queued beyond their fair share of the time its tenant's
          work takes, under generalized processor sharing), then its own work with room for its
          batch to fill up. Counting all work of its class, not only what earliest-deadline-first
          would run first, means a newcomer never pushes an earlier admission of its tenant past
          its deadline; dividing by the drain rate means a queue that drains slower than predicted
          admits less until it has caught up. A tenant flooding the device is refused on its own
          backlog while others in its class are still admitted. `retry_after_s` is how long until
          the same request would fit, if nothing else arrived.
          Not while the model's latency profile is provisional, and the batches of what is queued
          and the request alone would finish in time (`_fits_first_batches`).
        """
        queue = self._queues[key]
        if self._backlog.has_request(request_id):
            raise ValueError(f"request {request_id} is already queued")
        if len(costs) == 0:
            return Admitted(())
        costs = [int(cost) for cost in costs]
        if min(costs) < 0:
            raise ValueError("item costs must not be negative")
        priority = Priority(priority)
        now = self._clock.now()
        estimate = queue.estimate(costs)
        is_busy = background or self._running is not None or not self._backlog.is_empty
        if math.isnan(deadline) or deadline <= now or (
                now + estimate.alone_s > deadline and (is_busy or not queue.profile.is_provisional)
                and not self._probes(queue, request_id, estimate, now, deadline, is_busy)):
            return Rejected(RejectReason.DEADLINE_UNREACHABLE, 0.0)
        num_queued = self._fair.num_queued(priority, tenant)
        num_over = num_queued + len(costs) - queue.batching.max_queue_items
        if num_over > 0:
            share = min(num_over / max(num_queued, 1), 1.0)
            return Rejected(RejectReason.QUEUE_FULL, self._retry_after(share * self._fair.queued_s(priority, tenant)))
        works_s = [queue.item_work_s(cost) for cost in costs]
        # (an idle device with nothing queued starts online work at once: it finishes as it
        # would alone, checked above; on the event loop at low load this is most requests)
        if is_busy and (background or not self._fits_first_batches(key, queue, estimate, now, deadline)):
            skipped_s = self._skipped_s(priority, tenant, sum(works_s))
            finish = now + self._finish_s(now, estimate.replaced_room_s, skipped_s, estimate.own_s,
                                          self._jump_rate(now, priority, tenant, sum(works_s)), priority,
                                          estimate.alone_s)
            if finish > deadline:
                return Rejected(RejectReason.OVERLOADED, max(finish - deadline, 0.001))
        items = tuple(WorkItem(request_id, i, cost, deadline, now, tenant=tenant, priority=priority, work_s=work_s,
                               background=background)
                      for i, (cost, work_s) in enumerate(zip(costs, works_s, strict=True)))
        self._backlog.push(key, request_id, items)
        self._demand.add(priority, tenant, sum(works_s), now)
        return Admitted(items)

    def _probes(self, queue: ModelQueue, request_id: int, estimate: Estimate, now: float, deadline: float,
                is_busy: bool) -> bool:
        """Whether to admit, as a probe, a request refused only by the profile's raised estimate
        (see `admit`); marks it as the queue's probe if so."""
        if is_busy or now - queue.last_probe_at < self._probe_interval_s:
            return False
        if queue.profile.slowdown < MIN_PROBE_SLOWDOWN:
            return False
        if now + estimate.alone_s / queue.profile.slowdown > deadline:
            return False  # too tight even for the device at its fastest: not the estimate's doing
        queue.probe_id, queue.last_probe_at = request_id, now
        return True

    def _fits_first_batches(self, key: ModelKey, queue: ModelQueue, estimate: Estimate, now: float,
                            deadline: float) -> bool:
        """While a model's latency profile is provisional (it rests on warm-up timings, which a
        busy host makes far too slow, more than on real batches: `LatencyProfile.is_provisional`),
        an online request is not refused as OVERLOADED when the device holds nothing but this
        model's work, one batch of it running at most, and the batches that what is queued forms
        with the request, as predicted, finish by its deadline. The running batch's predicted
        remainder, the estimate in doubt, is not counted: a fresh worker takes a burst, within
        what its predictions say the queue can hold, and the batches it runs correct them."""
        if not queue.profile.is_provisional or self.num_queued() != queue.num_items:
            return False
        if self._running is not None and self._running.model != key:
            return False
        return now + queue.work_s() + estimate.added_s <= deadline

    def cancel(self, request_id: int) -> int:
        """Withdraw a request's queued items, with their work; returns how many were still queued.

        Items already in a running batch are not touched: the worker discards their results.
        """
        return self._backlog.cancel(request_id)

    # -- batch formation -----------------------------------------------------------------------

    def next_batch(self) -> Decision:
        """Form the next batch for a device that is free now (see the module's diagram)."""
        if self._running is not None:
            raise RuntimeError("next_batch() called while a batch is running")
        now = self._clock.now()
        expired: list[WorkItem] = []
        filled = self._backlog.form(now, expired)
        if filled is not None:
            self._running, self._running_credit_s = filled
            self._running_since = now
            return Decision(self._running, tuple(expired))
        self._was_backlogged = False
        return Decision(None, tuple(expired), self._backlog.held_until)

    def batch_done(self, batch: Batch, exec_s: float) -> dict[int, float]:
        """Record that the running batch finished after `exec_s` seconds on the device.

        Returns each request's share of `exec_s` (split by cost; what `wire.Result.device_s`
        adds up), which also replaces the predicted charges in its tenant's fair-queueing tag.
        """
        if batch is not self._running:
            raise RuntimeError("batch_done() for a batch that is not running")
        self._running = None
        queue = self._queues[batch.model]
        if queue.probe_id is not None and any(item.request_id == queue.probe_id for item in batch.items):
            queue.probe_id = None
            if exec_s < batch.predicted_s:  # the device is faster than thought: probe again at once
                queue.last_probe_at = -math.inf
        queue.profile.observe(batch.padded_cost, exec_s)
        self._update_drain_rate(self._clock.now(), exec_s)
        measured_s = max(exec_s, 0.0) if math.isfinite(exec_s) else batch.predicted_s
        self._backlog.account(batch, measured_s)
        return batch.device_shares(measured_s)

    # -- state for routing, admission and metrics ----------------------------------------------

    @property
    def is_idle(self) -> bool:
        return self._running is None

    def work_ahead_s(self) -> float:
        """Device-seconds of work before a newly admitted item could start, were it last in line:
        the running batch's predicted remainder and every queue's estimate (see `model_queue`)."""
        return self._running_left_s(self._clock.now()) + sum(q.work_s() for q in self._queues.values())

    def newcomer_s(self, key: ModelKey, cost: int) -> float:
        """What one item of `cost` arriving now would add to `wait_report()`'s wait of its class
        before it is done: its own work, with room for its batch to fill, less the fill room
        already counted for the bucket it joins (what `admit` adds on top of the report)."""
        estimate = self._queues[key].estimate([max(int(cost), 0)])
        return max(estimate.own_s - estimate.replaced_room_s / max(self._drain_rate, 0.05), 0.0)

    def queue_state(self, key: ModelKey) -> tuple[int, float]:
        queue = self._queues[key]
        return queue.num_items, queue.work_s()

    def num_queued(self) -> int:
        return sum(q.num_items for q in self._queues.values())

    def tenant_stats(self) -> tuple[TenantStats, ...]:
        """Per tenant and class: queued items and work, device-seconds used (for metrics)."""
        return self._fair.stats()

    def wait_report(self) -> WaitReport:
        """Predicted waits, in wall seconds, for the gateway's early admission: per class, for a
        tenant with nothing queued; per (tenant, class) with work queued, until that work is done."""
        now = self._clock.now()
        classes = []
        for priority in Priority:
            weight = sum(self._fair.weight(t) for t in self._fair.queued_by_tenant(priority))
            wait_s = self._finish_s(now, 0.0, self._skipped_s(priority, None, 0.0), 0.0,
                                    self._jump_rate(now, priority, None, 0.0), priority)
            classes.append(ClassWait(priority, wait_s, weight))
        tenants = []
        for stats in self._fair.stats():
            if stats.num_queued:
                skipped_s = self._skipped_s(stats.priority, stats.tenant, 0.0)
                jump = self._jump_rate(now, stats.priority, stats.tenant, 0.0)
                wait_s = self._finish_s(now, 0.0, skipped_s, 0.0, jump, stats.priority)
                tenants.append(TenantWait(stats.tenant, stats.priority, stats.num_queued, wait_s))
        return WaitReport(tuple(classes), tuple(tenants))

    @property
    def drain_rate(self) -> float:
        """Queued work, in `work_ahead_s()` seconds, retired per second of wall time while work waits.

        1.0 when batches run back to back, as full and as fast as predicted. It falls when the
        device waits on the worker between batches, runs slower than predicted, or runs batches cut
        short by their deadlines; `work_ahead_s() / drain_rate` is how long the queue takes to drain.
        """
        return self._drain_rate

    # -- internals: estimates ------------------------------------------------------------------

    def _retry_after(self, excess_s: float) -> float:
        return max(excess_s / max(self._drain_rate, 0.05), 0.001)

    def _running_left_s(self, now: float) -> float:
        if self._running is None:
            return 0.0
        return max(self._running.predicted_s - (now - self._running_since), 0.0)

    def _skipped_s(self, priority: Priority, tenant: str | None, own_work_s: float) -> float:
        """Queued device-seconds that would not run before `own_work_s` more of `tenant`'s work
        (tenant None: a tenant with nothing queued, of the default weight): lower classes' work,
        and other tenants' work in its class beyond their fair share (see `waits.fair_excess_s`)."""
        lower_s = sum(self._fair.queued_s(p) for p in Priority if p > priority)
        queued = self._fair.queued_by_tenant(priority)
        own_s = own_work_s + (queued.pop(tenant, 0.0) if tenant is not None else 0.0)
        weight = self._fair.weight(tenant) if tenant is not None else self._fair.default_weight
        others = [(work_s, self._fair.weight(name)) for name, work_s in queued.items()]
        return lower_s + fair_excess_s(own_s, weight, others)

    def _jump_rate(self, now: float, priority: Priority, tenant: str | None, own_work_s: float) -> float:
        """The device fraction later arrivals will take ahead of `tenant`'s queued work and
        `own_work_s` more (see `waits.jump_rate`)."""
        higher_s = sum(self._demand.class_rate(p, now) for p in Priority if p < priority)
        queued = self._fair.queued_by_tenant(priority)
        own_s = own_work_s + (queued.pop(tenant, 0.0) if tenant is not None else 0.0)
        weight = self._fair.weight(tenant) if tenant is not None else self._fair.default_weight
        others = {name: (queued.get(name, 0.0), self._fair.weight(name), rate)
                  for name, rate in self._demand.rates(priority, now).items() if name != tenant}
        return jump_rate(higher_s, own_s, weight, others)

    def _finish_s(self, now: float, replaced_room_s: float, skipped_s: float, own_s: float, jump: float,
                  priority: Priority, own_run_s: float = 0.0) -> float:
        """Seconds from now until `own_s` more work of class `priority` would be done (`_wait_s`
        ahead of it, and the batches lower classes are owed before its own batch starts:
        `Backlog.lower_batches_s`; `own_run_s` of `own_s` is that batch running), with everything
        after the running batch stretched by later arrivals taking `jump` of the device."""
        running_s = self._running_left_s(now)
        queued_s = self._wait_s(now, replaced_room_s, skipped_s) - running_s
        queued_s += self._backlog.lower_batches_s(priority, running_s + queued_s + max(own_s - own_run_s, 0.0))
        return running_s + (queued_s + own_s) / (1.0 - jump)

    def _wait_s(self, now: float, replaced_room_s: float, skipped_s: float = 0.0) -> float:
        """Wall seconds before a request joining buckets whose fill room is `replaced_room_s` would
        get to run: the running batch, then every queued item and the room left for other buckets'
        batches to fill up (`ModelQueue.fill_room_s`), at the measured drain rate; all but the
        fraction `skipped_s` is of the items' queued work (`WorkItem.work_s`), which would wait
        for it. (The queues' estimate counts whole batches; the items' counts their shares of
        full ones: the fraction carries the split over to the estimate.)"""
        queued_s = room_s = 0.0
        for queue in self._queues.values():
            queued_s += queue.work_s()
            room_s += queue.fill_room_s()
        room_s = max(room_s - replaced_room_s, 0.0)
        ahead_s = queued_s + room_s
        if skipped_s > 0:
            item_work_s = sum(self._fair.queued_s(p) for p in Priority)
            ahead_s *= max(1.0 - skipped_s / item_work_s, 0.0) if item_work_s > 0 else 1.0
        return self._running_left_s(now) + ahead_s / max(self._drain_rate, 0.05)

    def _update_drain_rate(self, now: float, exec_s: float) -> None:
        """EWMA of the work estimate retired (the batch's credit) per second of wall time while
        work waited.

        A batch accounts for the time since it started or, if work was already waiting when the
        previous batch finished, since then: a device left waiting on the worker counts against
        the rate; a device left waiting for requests does not.
        """
        start = self._running_since
        if self._was_backlogged and self._last_done_at is not None:
            start = min(start, self._last_done_at)
        interval = max(now - start, exec_s, 1e-6)
        weight = 1.0 - 0.5 ** (interval / self._drain_halflife_s)
        sample = min(self._running_credit_s / interval, 1.0)
        self._drain_rate += weight * (sample - self._drain_rate)
        self._last_done_at = now
        self._was_backlogged = self.num_queued() > 0
