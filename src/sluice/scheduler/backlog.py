"""Everything queued on one device, and the formation of the next batch from it.

`Backlog` owns the models' queues (`model_queue.py`), the queued requests' items, and the
tenants' and classes' fair-share standing (`fair.py`); the `Scheduler` decides what to admit and
drives it. See `batcher.py` for the order in which a batch is formed and its invariants.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.priority import Priority
from sluice.scheduler.fair import ClassShares, FairShare
from sluice.scheduler.model_queue import Flow, ModelQueue, WorkItem

ModelKey = tuple[str, str]

__all__ = ["Backlog", "Batch", "ModelKey"]


@dataclass(frozen=True, slots=True)
class Batch:
    model: ModelKey
    items: tuple[WorkItem, ...]
    padded_cost: int
    predicted_s: float

    def item_shares(self, exec_s: float) -> list[float]:
        """`exec_s` split among the batch's items by cost, in item order."""
        total = sum(item.cost for item in self.items)
        if total == 0:
            return [exec_s / len(self.items)] * len(self.items)
        return [exec_s * item.cost / total for item in self.items]

    def device_shares(self, exec_s: float) -> dict[int, float]:
        """`exec_s` split among the batch's items by cost, summed per request id."""
        shares: dict[int, float] = {}
        for item, share_s in zip(self.items, self.item_shares(exec_s), strict=True):
            shares[item.request_id] = shares.get(item.request_id, 0.0) + share_s
        return shares


@dataclass(slots=True)
class _Request:
    """The items of one request still waiting in a queue, by index."""

    queue: ModelQueue
    items: dict[int, WorkItem]


@dataclass(slots=True)
class _Head:
    """The item chosen to head the next batch, and where it waits."""

    key: ModelKey
    queue: ModelQueue
    bucket: int
    item: WorkItem


class Backlog:
    """Queued items, by model, bucket and flow, with their requests and tenants' standing."""

    def __init__(self, fair: FairShare, class_shares: ClassShares) -> None:
        self.queues: dict[ModelKey, ModelQueue] = {}
        self.fair = fair
        """Read it for estimates; only the backlog changes it."""
        self._class_shares = class_shares
        self._requests: dict[int, _Request] = {}
        self._seq = itertools.count()

    def has_request(self, request_id: int) -> bool:
        return request_id in self._requests

    def push(self, key: ModelKey, request_id: int, items: Sequence[WorkItem]) -> None:
        queue = self.queues[key]
        for item in items:
            queue.push((item.deadline, next(self._seq), item))
            self.fair.enqueue(item.priority, item.tenant, item.work_s)
        self._requests[request_id] = _Request(queue, {item.index: item for item in items})

    def cancel(self, request_id: int) -> int:
        request = self._requests.pop(request_id, None)
        if request is None:
            return 0
        for item in request.items.values():
            self._withdraw(request.queue, item)
        return len(request.items)

    def backlogged_classes(self) -> list[Priority]:
        return [p for p in Priority if self.fair.is_backlogged(p)]

    def form(self, now: float, expired: list[WorkItem]) -> tuple[Batch, float] | None:
        """The next batch to run now and its credit (see `_fill`), or None when nothing can run;
        items expired on the way are appended to `expired`. Charges the members' predicted time."""
        while (head := self._choose_head(now, expired)) is not None:
            filled = self._fill(head, now, expired)
            if filled is not None:
                for item in filled[0].items:
                    self.fair.charge(item.priority, item.tenant, item.work_s)
                return filled
        return None

    def account(self, batch: Batch, exec_s: float) -> None:
        """A batch took `exec_s` device-seconds: split it by cost, charge it to tenants (replacing
        the predicted charges) and to classes."""
        shares = batch.item_shares(exec_s)
        served: dict[Priority, float] = {}
        for item, share_s in zip(batch.items, shares, strict=True):
            self.fair.account(item.priority, item.tenant, item.work_s, share_s)
            served[item.priority] = served.get(item.priority, 0.0) + share_s
        self._class_shares.record(exec_s, served, self.backlogged_classes())

    def _choose_head(self, now: float, expired: list[WorkItem]) -> _Head | None:
        """The item to head the next batch: the class (`ClassShares.order`), its backlogged
        tenant with the smallest tag, that tenant's live item with the earliest deadline (of any
        model and bucket); unmeetable items met on the way are expired."""
        for priority in self._class_shares.order(self.backlogged_classes()):
            for tenant in self.fair.backlogged(priority):
                head = self._earliest_of((priority, tenant), now, expired)
                if head is not None:
                    self.fair.start(priority, tenant)
                    return head
        return None

    def _earliest_of(self, flow: Flow, now: float, expired: list[WorkItem]) -> _Head | None:
        best: _Head | None = None
        for key, queue in self.queues.items():
            if queue.num_items == 0:
                continue
            for bucket in list(queue.bucket_keys()):
                item = self._live_top(queue, bucket, flow, now, expired)
                if item is not None and (best is None or item.deadline < best.item.deadline):
                    best = _Head(key, queue, bucket, item)
        return best

    def _live_top(self, queue: ModelQueue, bucket: int, flow: Flow, now: float,
                  expired: list[WorkItem]) -> WorkItem | None:
        while (item := queue.top(bucket, flow)) is not None:
            if now + queue.profile.predict(item.cost) <= item.deadline:
                return item
            self._expire(self._take(queue, bucket, flow), expired)
        return None

    def _fill(self, head: _Head, now: float, expired: list[WorkItem]) -> tuple[Batch, float] | None:
        """The batch headed by `head`, and its credit: how much it takes off the queue's work
        estimate (less than its predicted time when the batch is cut short by its deadline).

        After the head, items of its bucket join in fair order: its class's flows by tag (each
        taken item advancing its flow's tag as it will be charged), then the other classes'.
        """
        queue, bucket = head.queue, head.bucket
        if queue.top(bucket, head.item.flow) is not head.item:
            return None  # the head left while other heads were expired: look again
        num_expired_before = len(expired)
        num_before, high_before = queue.bucket_state(bucket)
        members = [self._take(queue, bucket, head.item.flow)]
        pending = {head.item.flow: head.item.work_s / self.fair.weight(head.item.tenant)}
        classes = [head.item.priority, *(p for p in Priority if p != head.item.priority)]
        for priority in classes:
            flows = [flow for flow in queue.flows(bucket) if flow[0] == priority]
            self._fill_from(queue, bucket, flows, members, pending, now, expired)
        if len(expired) > num_expired_before:
            # a member's request may have expired through another of its items: none of it runs
            dead = {item.request_id for item in expired[num_expired_before:]}
            expired.extend(m for m in members if m.request_id in dead)
            members = [m for m in members if m.request_id not in dead]
            if not members:
                return None
        padded_cost = len(members) * max(m.cost for m in members)
        batch = Batch(head.key, tuple(members), padded_cost, queue.profile.predict(padded_cost))
        return batch, queue.credit_s(bucket, num_before, high_before, len(members))

    def _fill_from(self, queue: ModelQueue, bucket: int, flows: list[Flow], members: list[WorkItem],
                   pending: dict[Flow, float], now: float, expired: list[WorkItem]) -> None:
        """Add items of `flows` to `members`, the flow with the smallest tag (counting `pending`
        charges) first, until the batch is full; a flow whose next item does not fit drops out."""
        limits, profile = queue.batching, queue.profile
        longest = max(m.cost for m in members)
        earliest = min(m.deadline for m in members)
        while flows and len(members) < limits.max_batch_size:
            flow = min(flows, key=lambda f: self.fair.tag(*f) + pending.get(f, 0.0))
            candidate = queue.top(bucket, flow)
            if candidate is None:
                flows.remove(flow)
                continue
            if now + profile.predict(candidate.cost) > candidate.deadline:
                self._expire(self._take(queue, bucket, flow), expired)
                continue
            padded = (len(members) + 1) * max(longest, candidate.cost)
            finish = now + profile.predict(padded)
            if padded > limits.max_batch_cost or finish > earliest:
                flows.remove(flow)
                continue
            if finish > candidate.deadline:
                # Too late in a batch one larger than this one, so in any later batch too (each
                # costs alpha again): it is lost either way, and keeping the batch small to spare
                # it would cost every item behind it. Expire it; its flow's next item may fit.
                self._expire(self._take(queue, bucket, flow), expired)
                continue
            members.append(self._take(queue, bucket, flow))
            longest, earliest = max(longest, candidate.cost), min(earliest, candidate.deadline)
            pending[flow] = pending.get(flow, 0.0) + candidate.work_s / self.fair.weight(flow[1])

    def _take(self, queue: ModelQueue, bucket: int, flow: Flow) -> WorkItem:
        item = queue.take(bucket, flow)
        self.fair.dequeue(item.priority, item.tenant, item.work_s)
        request = self._requests[item.request_id]
        del request.items[item.index]
        if not request.items:
            del self._requests[item.request_id]
        return item

    def _withdraw(self, queue: ModelQueue, item: WorkItem) -> None:
        """Flag a queued item removed and uncount it (it leaves its heap lazily)."""
        item.is_cancelled = True
        queue.discard(item)
        self.fair.dequeue(item.priority, item.tenant, item.work_s)

    def _expire(self, item: WorkItem, expired: list[WorkItem]) -> None:
        """Expire a taken item and, with it, the items of its request still queued."""
        expired.append(item)
        request = self._requests.pop(item.request_id, None)
        if request is not None:
            for sibling in request.items.values():
                self._withdraw(request.queue, sibling)
                expired.append(sibling)
