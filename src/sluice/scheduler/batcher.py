"""The device scheduler: which queued items run together next, decided when the device frees.

    admit(request) ──▶ per-model queue (a deadline heap per length bucket) ──▶ next_batch() ──▶ device
                        │                                                     │
                        └─ Rejected(retry_after_s) when the work ahead        └─ expired items come back
                           would make the request miss its deadline              in Decision.expired (504)

Invariants:
- a lone request at an idle device starts at once: there is no batching window;
- a batch holds items of one model version and one length bucket (costs within a factor of two,
  so padding wastes under half the batch), at most `max_batch_size` items and `max_batch_cost`
  padded cost (an item costlier than that alone runs alone), and is never so large that its
  predicted time misses its earliest member's deadline;
- an item whose deadline cannot be met by running it alone, now, never reaches the device, and
  neither does any other item of its request: they all come back in `Decision.expired`;
- every admitted item leaves exactly once: in a batch, in `Decision.expired`, or by `cancel()`;
- queued work is bounded in device-seconds: admission refuses, at once, a request whose
  predicted completion behind all the work ahead is past its deadline (see `admit`), so
  `now + work_ahead_s() <= deadline` for every request right after it is admitted;
- nothing grows without bound: queues by that rule and `max_queue_items`, heaps by compaction.

Under overload the device stays busy with full batches and the excess is refused early: the
simulation tests (`tests/scheduler/test_simulate.py`) hold goodput at 2x capacity to >= 90%.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.clock import Clock
from sluice.repository import BatchingConfig
from sluice.scheduler.model_queue import ModelQueue, WorkItem
from sluice.scheduler.profile import LatencyProfile

ModelKey = tuple[str, str]

__all__ = ["Admitted", "Batch", "Decision", "ModelKey", "RejectReason", "Rejected", "Scheduler", "WorkItem"]


@dataclass(frozen=True, slots=True)
class Admitted:
    items: tuple[WorkItem, ...]


class RejectReason(enum.StrEnum):
    OVERLOADED = "overloaded"
    """The work queued ahead would make the request miss its deadline."""
    QUEUE_FULL = "queue_full"
    """The model's queue holds its maximum number of items."""
    DEADLINE_UNREACHABLE = "deadline_unreachable"
    """Even alone on an idle device the request would finish after its deadline."""


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: RejectReason
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class Batch:
    model: ModelKey
    items: tuple[WorkItem, ...]
    padded_cost: int
    predicted_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    batch: Batch | None
    expired: tuple[WorkItem, ...] = ()


@dataclass(slots=True)
class _Request:
    """The items of one request still waiting in a queue, by index."""

    queue: ModelQueue
    items: dict[int, WorkItem]


class Scheduler:
    """Queues and batch formation for one device. Not thread-safe: one event loop owns it."""

    def __init__(self, clock: Clock, *, drain_halflife_s: float = 2.0) -> None:
        self._clock = clock
        self._queues: dict[ModelKey, ModelQueue] = {}
        self._requests: dict[int, _Request] = {}
        self._seq = itertools.count()
        self._running: Batch | None = None
        self._running_since = 0.0
        self._running_credit_s = 0.0
        self._drain_halflife_s = drain_halflife_s
        self._drain_rate = 1.0
        self._last_done_at: float | None = None
        self._was_backlogged = False

    # -- configuration -------------------------------------------------------------------------

    def add_model(self, key: ModelKey, batching: BatchingConfig, profile: LatencyProfile) -> None:
        if key in self._queues:
            raise ValueError(f"model {key[0]} v{key[1]} is already scheduled")
        self._queues[key] = ModelQueue(batching, profile)

    def profile(self, key: ModelKey) -> LatencyProfile:
        return self._queues[key].profile

    def models(self) -> list[ModelKey]:
        return list(self._queues)

    # -- admission -----------------------------------------------------------------------------

    def admit(self, key: ModelKey, request_id: int, costs: Sequence[int], deadline: float) -> Admitted | Rejected:
        """Queue every item of a request, or none of them.

        Refused, checked in this order:
        - DEADLINE_UNREACHABLE: alone on an idle device it would still finish after `deadline`;
        - QUEUE_FULL: the model's queue would hold more than `max_queue_items`;
        - OVERLOADED: it would finish late behind the work ahead, predicted as the running
          batch's remainder, then (all queued work + the other buckets' fill room) at the
          measured drain rate, then its own work with room for its batch to fill up.
          Counting all queued work, not only what earliest-deadline-first would run first, means
          a newcomer never pushes an earlier admission past its deadline; dividing by the drain
          rate means a queue that drains slower than predicted (a slow device, batches cut short
          by their deadlines) admits less until it has caught up. `retry_after_s` is how long
          until the same request would fit, if nothing else arrived.
        """
        queue = self._queues[key]
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already queued")
        if len(costs) == 0:
            return Admitted(())
        costs = [int(cost) for cost in costs]
        if min(costs) < 0:
            raise ValueError("item costs must not be negative")
        now = self._clock.now()
        estimate = queue.estimate(costs)
        if math.isnan(deadline) or now + estimate.alone_s > deadline:
            return Rejected(RejectReason.DEADLINE_UNREACHABLE, 0.0)
        num_over = queue.num_items + len(costs) - queue.batching.max_queue_items
        if num_over > 0:
            share = min(num_over / max(queue.num_items, 1), 1.0)
            return Rejected(RejectReason.QUEUE_FULL, self._retry_after(share * queue.work_s()))
        finish = now + self._wait_s(now, estimate.replaced_room_s) + estimate.own_s
        if finish > deadline:
            return Rejected(RejectReason.OVERLOADED, max(finish - deadline, 0.001))
        items = tuple(WorkItem(request_id, i, cost, deadline, now) for i, cost in enumerate(costs))
        for item in items:
            queue.push((deadline, next(self._seq), item))
        self._requests[request_id] = _Request(queue, {item.index: item for item in items})
        return Admitted(items)

    def cancel(self, request_id: int) -> int:
        """Withdraw a request's queued items, with their work; returns how many were still queued.

        Items already in a running batch are not touched: the worker discards their results.
        """
        request = self._requests.pop(request_id, None)
        if request is None:
            return 0
        for item in request.items.values():
            item.is_cancelled = True
            request.queue.discard(item)
        return len(request.items)

    # -- batch formation -----------------------------------------------------------------------

    def next_batch(self) -> Decision:
        """Form the next batch for a device that is free now.

        The batch comes from the bucket holding the earliest deadline of any queue: that bucket's
        earliest items, as many as the limits and the earliest member's deadline allow.
        """
        if self._running is not None:
            raise RuntimeError("next_batch() called while a batch is running")
        now = self._clock.now()
        expired: list[WorkItem] = []
        while (head := self._earliest_head(now, expired)) is not None:
            filled = self._fill(*head, now, expired)
            if filled is not None:
                self._running, self._running_credit_s = filled
                self._running_since = now
                return Decision(self._running, tuple(expired))
        self._was_backlogged = False
        return Decision(None, tuple(expired))

    def batch_done(self, batch: Batch, exec_s: float) -> None:
        """Record that the running batch finished after `exec_s` seconds on the device."""
        if batch is not self._running:
            raise RuntimeError("batch_done() for a batch that is not running")
        self._running = None
        self._queues[batch.model].profile.observe(batch.padded_cost, exec_s)
        self._update_drain_rate(self._clock.now(), exec_s)

    # -- state for routing and admission -------------------------------------------------------

    @property
    def is_idle(self) -> bool:
        return self._running is None

    def work_ahead_s(self) -> float:
        """Device-seconds of work before a newly admitted item could start: the running batch's
        predicted remainder and every queue's estimate (see `model_queue`)."""
        return self._running_left_s(self._clock.now()) + sum(q.work_s() for q in self._queues.values())

    def queue_state(self, key: ModelKey) -> tuple[int, float]:
        queue = self._queues[key]
        return queue.num_items, queue.work_s()

    def num_queued(self) -> int:
        return sum(q.num_items for q in self._queues.values())

    @property
    def drain_rate(self) -> float:
        """Queued work, in `work_ahead_s()` seconds, retired per second of wall time while work waits.

        1.0 when batches run back to back, as full and as fast as predicted. It falls when the
        device waits on the worker between batches, runs slower than predicted, or runs batches cut
        short by their deadlines; `work_ahead_s() / drain_rate` is how long the queue takes to drain.
        """
        return self._drain_rate

    # -- internals -----------------------------------------------------------------------------

    def _retry_after(self, excess_s: float) -> float:
        return max(excess_s / max(self._drain_rate, 0.05), 0.001)

    def _running_left_s(self, now: float) -> float:
        if self._running is None:
            return 0.0
        return max(self._running.predicted_s - (now - self._running_since), 0.0)

    def _wait_s(self, now: float, replaced_room_s: float) -> float:
        """Wall seconds before a request joining buckets whose fill room is `replaced_room_s` would
        get to run: the running batch, then every queued item and the room left for other buckets'
        batches to fill up (`ModelQueue.fill_room_s`), at the measured drain rate."""
        queued_s = room_s = 0.0
        for queue in self._queues.values():
            queued_s += queue.work_s()
            room_s += queue.fill_room_s()
        room_s = max(room_s - replaced_room_s, 0.0)
        return self._running_left_s(now) + (queued_s + room_s) / max(self._drain_rate, 0.05)

    def _earliest_head(self, now: float, expired: list[WorkItem]) -> tuple[ModelKey, ModelQueue, int, WorkItem] | None:
        """The live item with the earliest deadline of all buckets of all queues, expiring on the
        way every bucket head that could no longer finish in time."""
        best: tuple[ModelKey, ModelQueue, int, WorkItem] | None = None
        for key, queue in self._queues.items():
            if queue.num_items == 0:
                continue
            for bucket in list(queue.bucket_keys()):
                item = self._live_top(queue, bucket, now, expired)
                if item is not None and (best is None or item.deadline < best[3].deadline):
                    best = (key, queue, bucket, item)
        return best

    def _live_top(self, queue: ModelQueue, bucket: int, now: float, expired: list[WorkItem]) -> WorkItem | None:
        while (item := queue.top(bucket)) is not None:
            if now + queue.profile.predict(item.cost) <= item.deadline:
                return item
            self._expire(self._take(queue, bucket), expired)
        return None

    def _fill(
        self, key: ModelKey, queue: ModelQueue, bucket: int, head: WorkItem, now: float, expired: list[WorkItem]
    ) -> tuple[Batch, float] | None:
        """The batch headed by `head`, and its credit: how much it takes off the queue's work
        estimate (less than its predicted time when the batch is cut short by its deadline)."""
        if queue.top(bucket) is not head:
            return None  # the head left while other heads were expired: look again
        limits, profile = queue.batching, queue.profile
        num_expired_before = len(expired)
        num_before, high_before = queue.bucket_state(bucket)
        members = [self._take(queue, bucket)]
        longest = head.cost
        while len(members) < limits.max_batch_size and (candidate := queue.top(bucket)) is not None:
            if now + profile.predict(candidate.cost) > candidate.deadline:
                self._expire(self._take(queue, bucket), expired)
                continue
            # heap order: no candidate's deadline is earlier than the head's
            padded = (len(members) + 1) * max(longest, candidate.cost)
            if padded > limits.max_batch_cost or now + profile.predict(padded) > head.deadline:
                break
            members.append(self._take(queue, bucket))
            longest = max(longest, candidate.cost)
        if len(expired) > num_expired_before:
            # a member's request may have expired through another of its items: none of it runs
            dead = {item.request_id for item in expired[num_expired_before:]}
            expired.extend(m for m in members if m.request_id in dead)
            members = [m for m in members if m.request_id not in dead]
            if not members:
                return None
            longest = max(m.cost for m in members)
        padded_cost = len(members) * longest
        batch = Batch(key, tuple(members), padded_cost, profile.predict(padded_cost))
        return batch, queue.credit_s(bucket, num_before, high_before, len(members))

    def _take(self, queue: ModelQueue, bucket: int) -> WorkItem:
        item = queue.take(bucket)
        request = self._requests[item.request_id]
        del request.items[item.index]
        if not request.items:
            del self._requests[item.request_id]
        return item

    def _expire(self, item: WorkItem, expired: list[WorkItem]) -> None:
        """Expire a taken item and, with it, the items of its request still queued."""
        expired.append(item)
        request = self._requests.pop(item.request_id, None)
        if request is not None:
            for sibling in request.items.values():
                sibling.is_cancelled = True
                request.queue.discard(sibling)
                expired.append(sibling)

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
