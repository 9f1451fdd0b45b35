"""Everything queued on one device, and the formation of the next batch from it.

`Backlog` owns the models' queues (`model_queue.py`), the queued requests' items, and the
tenants' and classes' fair-share standing (`fair.py`); the `Scheduler` decides what to admit and
drives it. See `batcher.py` for the order in which a batch is formed and its invariants.

Background items (a batch job's, `WorkItem.background`) are in the batch class but yield to online
work (any class) harder than the class's order alone makes them, because a batch cannot be
interrupted: a job batch that starts just before an online request arrives delays it by up to the
whole batch, and with a job always queued that happens to a large share of online requests (on the
emulated device at half its capacity, +40% on the online p99). So, while online work is active:

    device frees ─▶ online work queued? ──yes──▶ it heads the batch; background items ride along
                         │ no                    in its spare room (from its bucket or shorter
                         ▼                       ones, padded to its longest row), spending a
          fewer than `quiet_arrivals` online     device-time allowance that each online batch
          arrivals expected during a full        adds `ride_share` of its own time to
          background batch (at the decaying
          average online rate), or the batch   ──yes──▶ background heads a batch
          class owed `OWED_BATCHES` such
          batches of its minimum share?
                         │ no
                         ▼
          the device waits: `held_until` says when the rate will have decayed enough

So on a device kept busy by online work a job advances by riding, and online batches are
`ride_share` longer on average (2%: on the emulated device at half its capacity the online p99
grows 3-4% in `tests/scheduler/test_fair_simulate.py`; riding 5% of each batch's time cost 6-9%);
once online work has been quiet for a moment (the rate's half-life), a job runs full batches.
Riders are charged their padded row (the batch's longest), which pays most of the class's
minimum share while online batches have room; when they are full (an online overload) the share
comes due and background heads batches again: it is never starved past the class's bound
(`fair.ClassShares`) plus `OWED_BATCHES` full batches.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.priority import Priority
from sluice.scheduler.fair import ClassShares, FairShare
from sluice.scheduler.model_queue import Flow, ModelQueue, WorkItem

ModelKey = tuple[str, str]

__all__ = ["Backlog", "Batch", "ModelKey"]

OWED_BATCHES = 8
"""Held background work heads a batch anyway once its class is owed this many full background
batches of its minimum share: riding pays the share while online batches have room, and in
the gaps between riders the debt is only forgiven down to the last service (`fair.ClassShares`),
so a bound of one batch would let a head through every few seconds at moderate online load."""


@dataclass(frozen=True, slots=True)
class Batch:
    model: ModelKey
    items: tuple[WorkItem, ...]
    padded_cost: int
    predicted_s: float
    num_riders: int = 0
    """The last `num_riders` items are background items riding in an online batch (from its bucket
    or shorter ones), in rows padded to the batch's longest item."""

    def item_shares(self, exec_s: float) -> list[float]:
        """`exec_s` split among the batch's items by cost (a rider's: the longest), in item order."""
        if self.num_riders:
            longest = max(item.cost for item in self.items)
            num_own = len(self.items) - self.num_riders
            costs = [item.cost for item in self.items[:num_own]] + [longest] * self.num_riders
        else:
            costs = [item.cost for item in self.items]
        total = sum(costs)
        if total == 0:
            return [exec_s / len(self.items)] * len(self.items)
        return [exec_s * cost / total for cost in costs]

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

    def __init__(self, fair: FairShare, class_shares: ClassShares, *, ride_share: float = 0.02,
                 quiet_arrivals: float = 0.05, rate_halflife_s: float = 0.5) -> None:
        if not (ride_share >= 0.0 and quiet_arrivals >= 0.0 and rate_halflife_s > 0.0):
            raise ValueError("ride_share and quiet_arrivals must not be negative, rate_halflife_s must be positive")
        self.queues: dict[ModelKey, ModelQueue] = {}
        self.fair = fair
        """Read it for estimates; only the backlog changes it."""
        self._class_shares = class_shares
        self._requests: dict[int, _Request] = {}
        self._seq = itertools.count()
        self._ride_share = ride_share
        self._ride_allowance_s = 0.0
        """Device time background riders may still add to online batches (see `_add_riders`)."""
        self._quiet_arrivals = quiet_arrivals
        self._rate_tau_s = rate_halflife_s / math.log(2)
        self._online_rate = 0.0
        """Online (not background) items queued per second, decayed to `_online_at`."""
        self._online_at = -math.inf
        self._num_online = dict.fromkeys(Priority, 0)
        """Queued items that are not background, per class."""
        self._num_background = 0
        """Queued background items."""
        self.held_until: float | None = None
        """Set by `form` when it held background work back for online work's sake: when it may
        start if nothing else comes first (None: nothing held)."""

    def has_request(self, request_id: int) -> bool:
        return request_id in self._requests

    @property
    def is_empty(self) -> bool:
        return not self._requests

    def push(self, key: ModelKey, request_id: int, items: Sequence[WorkItem]) -> None:
        queue = self.queues[key]
        for item in items:
            self._count(item, 1)
            if not item.background:
                self._online_rate = self.online_rate(item.enqueued_at) + 1.0 / self._rate_tau_s
                self._online_at = max(self._online_at, item.enqueued_at)
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

    def lower_batches_s(self, priority: Priority, ahead_s: float) -> float:
        """Device time that backlogged classes below `priority` will take, in whole batches,
        before `ahead_s` of queued work ahead of a newcomer of `priority` has run: a lower class
        heads a batch once owed its minimum share (`fair.ClassShares`; background work only once
        owed `OWED_BATCHES` of them), its credit grows by its share of every batch that runs, and
        a batch cannot be interrupted, so admission must count those batches or the work it
        admits up to its deadline expires behind them."""
        total_s = 0.0
        for lower in self.backlogged_classes():
            share = self._class_shares.min_share(lower)
            if lower <= priority or share <= 0:
                continue
            batch_s = self._full_batch_s(lower)
            due_s = 0.0 if self._num_online[lower] else OWED_BATCHES * batch_s
            excess_s = self._class_shares.credit_s(lower) + share * ahead_s - due_s
            if excess_s > 0 and batch_s > 0:
                total_s += batch_s * (1 + int(excess_s / batch_s))
        return total_s

    def _full_batch_s(self, priority: Priority) -> float:
        """The predicted time of the longest full batch that class `priority`'s queued items make."""
        longest_s = 0.0
        for queue in self.queues.values():
            for key in queue.bucket_keys():
                if any(flow[0] == priority for flow in queue.flows(key)):
                    longest_s = max(longest_s, queue.full_batch_s(queue.bucket_state(key)[1]))
        return longest_s

    def backlogged_classes(self) -> list[Priority]:
        return [p for p in Priority if self.fair.is_backlogged(p)]

    def form(self, now: float, expired: list[WorkItem]) -> tuple[Batch, float] | None:
        """The next batch to run now and its credit (see `_fill`), or None when nothing can run;
        items expired on the way are appended to `expired`. Charges the members' predicted time."""
        self.held_until = None
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
                if head is not None and not (head.item.background and self._holds(head, now)):
                    self.fair.start(priority, tenant)
                    return head
        return None

    def online_rate(self, now: float) -> float:
        """Online items queued per second, an exponentially decaying average (`rate_halflife_s`)."""
        if now <= self._online_at:
            return self._online_rate
        return self._online_rate * math.exp((self._online_at - now) / self._rate_tau_s)

    def _holds(self, head: _Head, now: float) -> bool:
        """Whether background `head` must wait for online work to be quiet (see the module's
        diagram); if so, `held_until` says until when."""
        full_s = head.queue.full_batch_s(head.item.cost)
        if full_s <= 0 or self._class_shares.credit_s(head.item.priority) > OWED_BATCHES * full_s:
            return False  # (a batch predicted to take no time delays no one)
        rate = self.online_rate(now)
        quiet_rate = self._quiet_arrivals / full_s
        if rate <= quiet_rate:
            return False
        # at least a millisecond on: a wake-up computed to land exactly on the threshold must not
        # find the rate a rounding error above it and be held again for no time at all
        quiet_at = now + max(self._rate_tau_s * math.log(rate / quiet_rate), 0.001)
        self.held_until = quiet_at if self.held_until is None else min(self.held_until, quiet_at)
        return True

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
            if (queue.profile.is_provisional or item.request_id == queue.probe_id) and now < item.deadline:
                return item  # its prediction is in doubt (`Scheduler.admit`): it runs, and corrects it
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
        if num_before > 1:  # (at low load the head is often alone)
            classes = [head.item.priority, *(p for p in Priority if p != head.item.priority)]
            for priority in classes:
                flows = [flow for flow in queue.flows(bucket) if flow[0] == priority]
                self._fill_from(queue, bucket, flows, members, pending, now, expired, not head.item.background)
        credit_s = queue.credit_s(bucket, num_before, high_before, len(members))
        num_riders = 0
        if not head.item.background and self._ride_share > 0:
            num_riders, rider_credit_s = self._add_riders(queue, bucket, members, now)
            credit_s += rider_credit_s
        if len(expired) > num_expired_before:
            # a member's request may have expired through another of its items: none of it runs
            dead = {item.request_id for item in expired[num_expired_before:]}
            expired.extend(m for m in members if m.request_id in dead)
            kept = [m for m in members if m.request_id not in dead]
            num_riders -= sum(1 for m in members[len(members) - num_riders:] if m.request_id in dead)
            members = kept
            if not members:
                return None
        padded_cost = len(members) * max(m.cost for m in members)
        batch = Batch(head.key, tuple(members), padded_cost, queue.profile.predict(padded_cost), num_riders)
        return batch, credit_s

    def _add_riders(self, queue: ModelQueue, bucket: int, members: list[WorkItem], now: float) -> tuple[int, float]:
        """Background items of its bucket or shorter ones that join an online batch, padded to its
        longest row, within the ride allowance; returns how many joined and their credit (see
        `_fill`).

        The allowance is device time: each online batch adds `ride_share` of its predicted time,
        riders spend what they add to it, and it keeps at most `ride_share` of a full batch (or one
        rider's time, if that is more, so that a rider costlier than a batch's share can still
        come every few batches). So riders lengthen online batches by `ride_share` on average,
        many to a batch on a device whose batches cost little more for more rows, one every few
        batches on one whose cost grows with every row."""
        limits, profile = queue.batching, queue.profile
        longest = max(m.cost for m in members)
        earliest = min(m.deadline for m in members)
        base_s = profile.predict(len(members) * longest)
        cap_s = max(self._ride_share * profile.predict(limits.max_batch_size * longest),
                    profile.predict((len(members) + 1) * longest) - base_s)
        allowance_s = self._ride_allowance_s = min(self._ride_allowance_s + self._ride_share * base_s, cap_s)
        if not self._num_background or len(members) >= limits.max_batch_size:
            return 0, 0.0
        limit_s = base_s + allowance_s
        num_riders, credit_s = 0, 0.0
        for key in sorted((k for k in queue.bucket_keys() if k <= bucket), reverse=True):
            num_before, high_before = queue.bucket_state(key)
            num_taken, is_full = 0, False
            for flow in queue.flows(key):
                while not is_full and (candidate := queue.top(key, flow)) is not None and candidate.background:
                    padded = (len(members) + 1) * max(longest, candidate.cost)
                    seconds = profile.predict(padded)
                    if now + seconds > min(earliest, candidate.deadline):
                        break  # this flow's next item is past saving in this batch; another's may fit
                    is_full = (len(members) >= limits.max_batch_size or padded > limits.max_batch_cost
                               or seconds > limit_s)
                    if not is_full:
                        members.append(self._take(queue, key, flow))
                        longest = max(longest, candidate.cost)
                        num_taken += 1
            if num_taken:
                num_riders += num_taken
                credit_s += queue.credit_s(key, num_before, high_before, num_taken)
            if is_full:
                break
        if num_riders:
            self._ride_allowance_s -= profile.predict(len(members) * longest) - base_s
        return num_riders, credit_s

    def _fill_from(self, queue: ModelQueue, bucket: int, flows: list[Flow], members: list[WorkItem],
                   pending: dict[Flow, float], now: float, expired: list[WorkItem], is_online: bool) -> None:
        """Add items of `flows` to `members`, the flow with the smallest tag (counting `pending`
        charges) first, until the batch is full; a flow whose next item does not fit drops out, and
        so does one whose next item is background when the batch `is_online` (it may ride later)."""
        limits, profile = queue.batching, queue.profile
        longest = max(m.cost for m in members)
        earliest = min(m.deadline for m in members)
        while flows and len(members) < limits.max_batch_size:
            flow = min(flows, key=lambda f: self.fair.tag(*f) + pending.get(f, 0.0))
            candidate = queue.top(bucket, flow)
            if candidate is None or (is_online and candidate.background):
                flows.remove(flow)
                continue
            is_probe = candidate.request_id == queue.probe_id  # its siblings run with it, whatever predicted
            if now + profile.predict(candidate.cost) > candidate.deadline and not is_probe:
                self._expire(self._take(queue, bucket, flow), expired)
                continue
            padded = (len(members) + 1) * max(longest, candidate.cost)
            finish = now + profile.predict(padded)
            if is_probe and padded <= limits.max_batch_cost:
                finish = min(finish, earliest, candidate.deadline)
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
        self._count(item, -1)
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
        self._count(item, -1)

    def _count(self, item: WorkItem, delta: int) -> None:
        if item.background:
            self._num_background += delta
        else:
            self._num_online[item.priority] += delta

    def _expire(self, item: WorkItem, expired: list[WorkItem]) -> None:
        """Expire a taken item and, with it, the items of its request still queued."""
        expired.append(item)
        request = self._requests.pop(item.request_id, None)
        if request is not None:
            for sibling in request.items.values():
                self._withdraw(request.queue, sibling)
                expired.append(sibling)
