"""One model version's queue: per length bucket, a deadline-ordered heap per flow (a priority
class and a tenant), and running estimates of the device time the whole queue holds.

    bucket k  = costs in [2**(k-1), 2**k)     flow (class, tenant) -> heap of (deadline, seq, item)
    ┌──────────┬──────────────────────────────────────────────┐
    │ k = 4    │ (0, "a"): (0.31, 7, x) (0.52, 9, y)          │
    │          │ (2, "b"): (0.12, 8, z) ...                   │
    │ k = 7    │ (1, "a"): ...                                │
    └──────────┴──────────────────────────────────────────────┘

A batch is drawn from one bucket, so its longest member is under twice its shortest and padding
wastes under half the batch. Which flows' items join it is the scheduler's (fair) choice; within a
flow, the earliest deadline comes first. The estimates below are per bucket, over all its flows.

Removal is lazy: a cancelled or expired item stays in its heap, flagged `is_cancelled`, until it
surfaces or the heaps are compacted (once flagged entries outnumber live ones), so withdrawing is
O(1) per item and the heaps never hold much more than twice the live items.

Estimates, kept up to date in O(1) per change, as integer sums that never drift. Per bucket: n
live items and a high-water cost h (the largest cost queued since the bucket was last empty, so
h >= every live cost); per_batch = min(max_batch_size, max_batch_cost // h) of its items always
fit one batch.
- drain: the bucket empties in at most ceil(n / per_batch) batches of n * h padded cost in all.
  An upper bound (exact for items of one cost), so admission errs toward refusing rather than
  toward admitting work that will expire.
- fill room: the batch formed from the bucket's last items fills up with later arrivals; they add
  up to (-n mod per_batch) * h padded cost, and at light load no more than the bucket's next
  batch as it stands (few items arrive before it starts). See `fill_room_s`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from sluice.priority import Priority
from sluice.repository import BatchingConfig
from sluice.scheduler.profile import LatencyProfile


@dataclass(slots=True, eq=False)
class WorkItem:
    """One row of a request, queued for the device."""

    request_id: int
    index: int
    cost: int
    deadline: float
    enqueued_at: float
    tenant: str = ""
    priority: Priority = Priority.STANDARD
    work_s: float = 0.0
    """Its predicted share of a full batch's device time, fixed at admission: what its tenant's
    queued work counts for it, and its fair-queueing charge until the batch's time is measured."""
    is_cancelled: bool = False
    """Withdrawn (cancelled, or its request expired) while still in a heap; dropped when it surfaces."""
    background: bool = False
    """A batch job's item: it yields to online work harder than its class does (see `backlog.py`)."""

    @property
    def flow(self) -> Flow:
        return (self.priority, self.tenant)


Entry = tuple[float, int, WorkItem]
Flow = tuple[Priority, str]
"""Who queued an item: its priority class and its tenant."""

_MIN_DEAD_TO_COMPACT = 64


def length_bucket(cost: int) -> int:
    """Items share a batch only within one bucket: costs in [2**(k-1), 2**k) for bucket k."""
    return cost.bit_length()


def _plus(a: tuple[int, ...], b: tuple[int, ...]) -> _Terms:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], a[4] + b[4])


class Estimate(NamedTuple):
    """Predicted device-seconds, for admission, of queueing some items. Nothing is queued."""

    alone_s: float
    """To run just these items on an idle device."""
    added_s: float
    """How much the queue's `work_s()` would grow."""
    own_s: float
    """`added_s` widened to the fill room of the buckets they join, once joined: time for their
    own batches to fill up rather than be cut short by their deadline (on an idle device, just
    their own work)."""
    replaced_room_s: float
    """The fill room of those buckets as it is now, which `fill_room_s()` includes."""


# One bucket's share of the queue's sums: batches and padded cost to drain it, its next batch
# (0 or 1) and that batch's padded cost, and the padded cost still open in its last batch.
_Terms = tuple[int, int, int, int, int]
_NO_TERMS: _Terms = (0, 0, 0, 0, 0)


@dataclass(slots=True)
class _Bucket:
    heaps: dict[Flow, list[Entry]] = field(default_factory=dict)
    num_items: int = 0
    high_water_cost: int = 0
    terms: _Terms = _NO_TERMS


class ModelQueue:
    """Queued items of one model version. The scheduler owns it; items come and go through it."""

    def __init__(self, batching: BatchingConfig, profile: LatencyProfile) -> None:
        self.batching = batching
        self.profile = profile
        self.num_items = 0
        self.probe_id: int | None = None
        """A request admitted though the profile predicts it late (`Scheduler.admit`'s probe):
        it runs whatever the prediction says, while its deadline has not passed."""
        self.last_probe_at = -math.inf
        self._buckets: dict[int, _Bucket] = {}
        self._num_dead = 0
        self._sums: list[int] = [0, 0, 0, 0, 0]  # the buckets' terms, summed

    # -- estimates -----------------------------------------------------------------------------

    def work_s(self) -> float:
        """Predicted device-seconds to run every queued item."""
        if self.num_items == 0:
            return 0.0
        return self._seconds(self._sums[0], self._sums[1])

    def fill_room_s(self) -> float:
        """Device-seconds that later arrivals could add to batches formed from what is queued.

        A batch takes its bucket's earliest items; when fewer than a full batch are left, items
        that arrive later join it, work that no deadline queued before them counted on.
        """
        if self.num_items == 0:
            return 0.0
        return self._room_s(self._sums[2], self._sums[3], self._sums[4])

    def estimate(self, costs: Sequence[int]) -> Estimate:
        """What queueing items of these costs would mean, with the profile as it is now."""
        if len(costs) == 1:  # the common case, kept lean: admission runs on the event loop
            cost = costs[0]
            bucket = self._buckets.get(cost.bit_length())
            if bucket is None or bucket.num_items == 0:
                return self._estimate(self._seconds(1, cost), _NO_TERMS, self._terms(1, cost))
            after = self._terms(bucket.num_items + 1, max(bucket.high_water_cost, cost))
            return self._estimate(self._seconds(1, cost), bucket.terms, after)
        groups: dict[int, tuple[int, int]] = {}
        for cost in costs:
            num, high = groups.get(cost.bit_length(), (0, 0))
            groups[cost.bit_length()] = (num + 1, max(high, cost))
        alone_s = 0.0
        before = after = _NO_TERMS
        for key, (num, high) in groups.items():
            alone_s += self._seconds(-(-num // self._per_batch(high)), num * high)
            bucket = self._buckets.get(key)
            num_before, high_before = (bucket.num_items, bucket.high_water_cost) if bucket else (0, 0)
            before = _plus(before, bucket.terms if bucket else _NO_TERMS)
            after = _plus(after, self._terms(num_before + num, max(high_before, high)))
        return self._estimate(alone_s, before, after)

    def _estimate(self, alone_s: float, before: _Terms, after: _Terms) -> Estimate:
        alpha_s, beta_s = self.profile.alpha_s, self.profile.beta_s
        added_s = (after[0] - before[0]) * alpha_s + (after[1] - before[1]) * beta_s
        next_after_s = after[2] * alpha_s + after[3] * beta_s
        own_s = max(added_s, min(next_after_s, added_s + beta_s * after[4]))
        replaced_room_s = min(before[2] * alpha_s + before[3] * beta_s, before[4] * beta_s)
        return Estimate(alone_s, added_s, own_s, replaced_room_s)

    def item_work_s(self, cost: int) -> float:
        """An item's share of the device time of a full batch of items like it: what it adds to
        its tenant's queued work, and its fair-queueing charge until its batch is measured."""
        per_batch = max(1, min(self.batching.max_batch_size, self.batching.max_batch_cost // max(cost, 1)))
        return self.profile.alpha_s / per_batch + self.profile.beta_s * cost

    def credit_s(self, key: int, num_before: int, high_before: int, num_taken: int) -> float:
        """How much taking `num_taken` items from bucket `key`, which held `num_before` items up to
        `high_before`, took off `work_s()`: a full batch's worth for a full batch, less for one
        cut short, whose items the estimate expected to share a batch with more."""
        per_batch = self._per_batch(high_before)
        num_after = max(num_before - num_taken, 0)
        num_batches = -(-num_before // per_batch) - -(-num_after // per_batch)
        return self._seconds(num_batches, (num_before - num_after) * high_before)

    def full_batch_s(self, cost: int) -> float:
        """The predicted time of a full batch of items of `cost`."""
        return self._seconds(1, self._per_batch(cost) * max(cost, 1))

    def bucket_state(self, key: int) -> tuple[int, int]:
        bucket = self._buckets[key]
        return bucket.num_items, bucket.high_water_cost

    def _room_s(self, next_batches: int, next_padded: int, open_padded: int) -> float:
        return min(self._seconds(next_batches, next_padded), self.profile.beta_s * open_padded)

    def _seconds(self, num_batches: int, padded_cost: int) -> float:
        return num_batches * self.profile.alpha_s + self.profile.beta_s * padded_cost

    def _per_batch(self, high_water_cost: int) -> int:
        """Items of a bucket that always fit one batch, whatever their costs up to the high water."""
        if high_water_cost == 0:
            return self.batching.max_batch_size
        return max(1, min(self.batching.max_batch_size, self.batching.max_batch_cost // high_water_cost))

    def _terms(self, num_items: int, high_water_cost: int) -> _Terms:
        if num_items == 0:
            return _NO_TERMS
        per_batch = self._per_batch(high_water_cost)
        return (
            -(-num_items // per_batch),
            num_items * high_water_cost,
            1,
            min(num_items, per_batch) * high_water_cost,
            (-num_items % per_batch) * high_water_cost,
        )

    def _count(self, bucket: _Bucket, delta: int, cost: int) -> None:
        bucket.num_items += delta
        if bucket.num_items == 0:
            bucket.high_water_cost = 0
        elif cost > bucket.high_water_cost:
            bucket.high_water_cost = cost
        old, new = bucket.terms, self._terms(bucket.num_items, bucket.high_water_cost)
        bucket.terms = new
        sums = self._sums
        for i in range(5):
            sums[i] += new[i] - old[i]
        self.num_items += delta

    # -- items in and out ----------------------------------------------------------------------

    def push(self, entry: Entry) -> None:
        item = entry[2]
        key = length_bucket(item.cost)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        heap = bucket.heaps.get(item.flow)
        if heap is None:
            heap = bucket.heaps[item.flow] = []
        heapq.heappush(heap, entry)
        self._count(bucket, +1, item.cost)

    def bucket_keys(self) -> Iterator[int]:
        """Buckets holding live items. Buckets are never deleted: there are few (one per bit)."""
        return (key for key, bucket in self._buckets.items() if bucket.num_items)

    def flows(self, key: int) -> list[Flow]:
        """Flows with entries (perhaps only flagged ones) in bucket `key`."""
        bucket = self._buckets.get(key)
        return [flow for flow, heap in bucket.heaps.items() if heap] if bucket is not None else []

    def top(self, key: int, flow: Flow) -> WorkItem | None:
        """The live item of `flow` with the earliest deadline in bucket `key`, left in place."""
        bucket = self._buckets.get(key)
        heap = bucket.heaps.get(flow) if bucket is not None else None
        if heap is None:
            return None
        while heap and heap[0][2].is_cancelled:
            heapq.heappop(heap)
            self._num_dead -= 1
        return heap[0][2] if heap else None

    def take(self, key: int, flow: Flow) -> WorkItem:
        """Remove and return the top live item of `flow` in bucket `key` (the caller checked there
        is one)."""
        item = self.top(key, flow)
        assert item is not None, "take() from an empty heap"
        bucket = self._buckets[key]
        heapq.heappop(bucket.heaps[flow])
        self._count(bucket, -1, item.cost)
        return item

    def discard(self, item: WorkItem) -> None:
        """Uncount an item still in its heap that the caller has just flagged `is_cancelled`."""
        self._count(self._buckets[length_bucket(item.cost)], -1, item.cost)
        self._num_dead += 1
        if self._num_dead > _MIN_DEAD_TO_COMPACT and self._num_dead > self.num_items:
            self._compact()

    def num_entries(self) -> int:
        """Heap entries, live and flagged: what the queue holds in memory."""
        return sum(len(heap) for bucket in self._buckets.values() for heap in bucket.heaps.values())

    def _compact(self) -> None:
        for bucket in self._buckets.values():
            for flow, heap in list(bucket.heaps.items()):
                live = [entry for entry in heap if not entry[2].is_cancelled]
                if live:
                    heapq.heapify(live)
                    bucket.heaps[flow] = live
                else:
                    del bucket.heaps[flow]  # tenants come and go: keep no empty heaps
        self._num_dead = 0
