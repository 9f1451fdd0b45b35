"""The device scheduler: which queued items run together next, decided when the device frees.

    admit(request) ──▶ per-model queue (heap by deadline) ──▶ next_batch() ──▶ device
                        │                                      │
                        └─ Rejected(retry_after_s) when the     └─ expired items come back in
                           work ahead would miss the deadline       Decision.expired (answered 504)

Invariants:
- a lone request at an idle device starts at once: there is no batching window;
- a batch holds items of one model version and one length bucket (costs within a factor of two,
  so padding wastes under half the batch), at most `max_batch_size` items and `max_batch_cost`
  padded cost, and is never so large that its predicted time misses a member's deadline;
- an item whose deadline cannot be met by running it alone, now, never reaches the device;
- queued work is bounded in device-seconds: admission refuses a request whose predicted
  completion (work ahead + its own) is past its deadline.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sluice.clock import Clock
from sluice.repository import BatchingConfig
from sluice.scheduler.profile import LatencyProfile

ModelKey = tuple[str, str]


@dataclass(slots=True, eq=False)
class WorkItem:
    """One row of a request, queued for the device."""

    request_id: int
    index: int
    cost: int
    deadline: float
    enqueued_at: float
    is_cancelled: bool = False


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
class _ModelQueue:
    batching: BatchingConfig
    profile: LatencyProfile
    heap: list[tuple[float, int, WorkItem]] = field(default_factory=list)
    num_items: int = 0
    total_cost: int = 0

    def work_s(self) -> float:
        if self.num_items == 0:
            return 0.0
        num_batches = math.ceil(self.num_items / self.batching.max_batch_size)
        return num_batches * self.profile.alpha_s + self.profile.beta_s * self.total_cost


class Scheduler:
    """Queues and batch formation for one device. Not thread-safe: one event loop owns it."""

    def __init__(self, clock: Clock, *, drain_halflife_s: float = 2.0) -> None:
        self._clock = clock
        self._queues: dict[ModelKey, _ModelQueue] = {}
        self._by_request: dict[int, list[WorkItem]] = {}
        self._seq = itertools.count()
        self._running: Batch | None = None
        self._running_since = 0.0
        self._drain_halflife_s = drain_halflife_s
        self._drain_rate = 1.0
        self._last_done_at: float | None = None

    # -- configuration -------------------------------------------------------------------------

    def add_model(self, key: ModelKey, batching: BatchingConfig, profile: LatencyProfile) -> None:
        self._queues[key] = _ModelQueue(batching, profile)

    def profile(self, key: ModelKey) -> LatencyProfile:
        return self._queues[key].profile

    def models(self) -> list[ModelKey]:
        return list(self._queues)

    # -- admission -----------------------------------------------------------------------------

    def admit(self, key: ModelKey, request_id: int, costs: Sequence[int], deadline: float) -> Admitted | Rejected:
        """Queue every item of a request, or none of them."""
        queue = self._queues[key]
        now = self._clock.now()
        if len(costs) == 0:
            return Admitted(())
        if queue.num_items + len(costs) > queue.batching.max_queue_items:
            return Rejected(RejectReason.QUEUE_FULL, self._retry_after(queue.work_s()))
        own_s = self._work_of(queue, costs)
        if now + own_s > deadline:
            return Rejected(RejectReason.DEADLINE_UNREACHABLE, 0.0)
        finish = now + self.work_ahead_s() + own_s
        if finish > deadline:
            return Rejected(RejectReason.OVERLOADED, self._retry_after(finish - deadline))
        items = tuple(WorkItem(request_id, i, int(c), deadline, now) for i, c in enumerate(costs))
        for item in items:
            heapq.heappush(queue.heap, (deadline, next(self._seq), item))
        queue.num_items += len(items)
        queue.total_cost += sum(int(c) for c in costs)
        self._by_request[request_id] = list(items)
        return Admitted(items)

    def cancel(self, request_id: int) -> int:
        """Withdraw a request's queued items; returns how many were still queued."""
        items = self._by_request.pop(request_id, None)
        if items is None:
            return 0
        num_removed = 0
        for item in items:
            if not item.is_cancelled:
                item.is_cancelled = True
                num_removed += 1
        return num_removed

    # -- batch formation -----------------------------------------------------------------------

    def next_batch(self) -> Decision:
        """Form the next batch for a device that is free now."""
        if self._running is not None:
            raise RuntimeError("next_batch() called while a batch is running")
        now = self._clock.now()
        expired: list[WorkItem] = []
        best: tuple[float, ModelKey] | None = None
        for key, queue in self._queues.items():
            self._drop_dead_heads(queue, now, expired)
            if queue.heap and (best is None or queue.heap[0][0] < best[0]):
                best = (queue.heap[0][0], key)
        if best is None:
            return Decision(None, tuple(expired))
        key = best[1]
        batch = self._fill(key, self._queues[key], now, expired)
        self._running = batch
        self._running_since = now
        return Decision(batch, tuple(expired))

    def batch_done(self, batch: Batch, exec_s: float) -> None:
        """Record that the running batch finished after `exec_s` seconds on the device."""
        if batch is not self._running:
            raise RuntimeError("batch_done() for a batch that is not running")
        self._running = None
        now = self._clock.now()
        queue = self._queues[batch.model]
        queue.profile.observe(batch.padded_cost, exec_s)
        for item in batch.items:
            remaining = self._by_request.get(item.request_id)
            if remaining is not None:
                remaining.remove(item)
                if not remaining:
                    del self._by_request[item.request_id]
        self._update_drain_rate(now, exec_s)

    # -- state for routing and admission -------------------------------------------------------

    @property
    def is_idle(self) -> bool:
        return self._running is None

    def work_ahead_s(self) -> float:
        """Device-seconds of work before a newly admitted item could start."""
        running_left = 0.0
        if self._running is not None:
            elapsed = self._clock.now() - self._running_since
            running_left = max(self._running.predicted_s - elapsed, 0.0)
        return running_left + sum(q.work_s() for q in self._queues.values())

    def queue_state(self, key: ModelKey) -> tuple[int, float]:
        queue = self._queues[key]
        return queue.num_items, queue.work_s()

    def num_queued(self) -> int:
        return sum(q.num_items for q in self._queues.values())

    @property
    def drain_rate(self) -> float:
        return self._drain_rate

    # -- internals -----------------------------------------------------------------------------

    def _work_of(self, queue: _ModelQueue, costs: Iterable[int]) -> float:
        costs = list(costs)
        num_batches = math.ceil(len(costs) / queue.batching.max_batch_size)
        return num_batches * queue.profile.alpha_s + queue.profile.beta_s * sum(costs)

    def _retry_after(self, excess_s: float) -> float:
        return max(excess_s / max(self._drain_rate, 0.05), 0.001)

    def _pop(self, queue: _ModelQueue) -> WorkItem | None:
        while queue.heap:
            _, _, item = heapq.heappop(queue.heap)
            if item.is_cancelled:
                queue.num_items -= 1
                queue.total_cost -= item.cost
                continue
            return item
        return None

    def _push_back(self, queue: _ModelQueue, item: WorkItem) -> None:
        heapq.heappush(queue.heap, (item.deadline, next(self._seq), item))

    def _take(self, queue: _ModelQueue, item: WorkItem) -> None:
        queue.num_items -= 1
        queue.total_cost -= item.cost

    def _drop_dead_heads(self, queue: _ModelQueue, now: float, expired: list[WorkItem]) -> None:
        while queue.heap:
            _, _, head = queue.heap[0]
            if head.is_cancelled:
                self._pop(queue)
                continue
            if now + queue.profile.predict(head.cost) <= head.deadline:
                return
            heapq.heappop(queue.heap)
            self._take(queue, head)
            self._expire(head, expired)

    def _expire(self, item: WorkItem, expired: list[WorkItem]) -> None:
        expired.append(item)
        items = self._by_request.pop(item.request_id, None)
        for sibling in items or ():
            sibling.is_cancelled = True

    def _fill(self, key: ModelKey, queue: _ModelQueue, now: float, expired: list[WorkItem]) -> Batch:
        limits = queue.batching
        head = self._pop(queue)
        assert head is not None, "the caller checked the queue is not empty"
        self._take(queue, head)
        members = [head]
        bucket = head.cost.bit_length()
        max_cost = head.cost
        earliest_deadline = head.deadline
        skipped: list[WorkItem] = []
        scan_budget = 4 * limits.max_batch_size
        while len(members) < limits.max_batch_size and scan_budget > 0:
            scan_budget -= 1
            candidate = self._pop(queue)
            if candidate is None:
                break
            if candidate.is_cancelled:
                continue
            if now + queue.profile.predict(candidate.cost) > candidate.deadline:
                self._take(queue, candidate)
                self._expire(candidate, expired)
                continue
            if candidate.cost.bit_length() != bucket:
                skipped.append(candidate)
                continue
            new_max = max(max_cost, candidate.cost)
            padded = (len(members) + 1) * new_max
            deadline = min(earliest_deadline, candidate.deadline)
            if padded > limits.max_batch_cost or now + queue.profile.predict(padded) > deadline:
                skipped.append(candidate)
                break
            self._take(queue, candidate)
            members.append(candidate)
            max_cost, earliest_deadline = new_max, deadline
        for item in skipped:
            self._push_back(queue, item)
        padded_cost = len(members) * max_cost
        return Batch(key, tuple(members), padded_cost, queue.profile.predict(padded_cost))

    def _update_drain_rate(self, now: float, exec_s: float) -> None:
        """EWMA of device-seconds retired per wall second, over the last few seconds."""
        if self._last_done_at is not None:
            interval = max(now - self._last_done_at, exec_s, 1e-6)
            weight = 1.0 - 0.5 ** (interval / self._drain_halflife_s)
            sample = min(exec_s / interval, 1.0)
            self._drain_rate += weight * (sample - self._drain_rate)
        self._last_done_at = now
