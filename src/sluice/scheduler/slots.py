"""Bounded concurrency in front of an upstream server, pure policy.

An upstream (another OpenAI-compatible server) does its own batching; what sluice controls is how
many calls it has in flight. `SlotQueue` holds at most `max_running` calls running; the rest wait
here, and when a slot frees the next call is chosen as the batcher chooses (`fair.py`):

    offer ─▶ waiting, per (class, tenant) ─▶ start_next, while num_running < max_running:
                                               1. class: strict priority; a waiting lower class
                                                  owed its minimum share goes first (ClassShares)
                                               2. tenant: smallest fair-queueing tag (FairShare)
                                               3. call: that tenant's earliest deadline, then oldest
    release / withdraw ─▶ a slot frees ─▶ the next waiting call starts

The work shared is slot time: a call is charged `call_s` (the caller's predicted call duration)
when it starts, replaced by the time it held its slot when it is released with `now`. A tenant
with nothing waiting banks no credit (`FairShare`), and a backlogged lower class gets its minimum
share of slot time (`ClassShares`: a class owed its share and with no call running jumps ahead,
one call at a time; its credit is settled when the call is released).

A waiting call whose deadline has passed is never started: `start_next` returns it as expired.
`waits_s` predicts, per class, how long a newcomer would wait for a slot, from the mean call
duration, so a gateway can route by it and refuse work that would miss its deadline.

No I/O and no clock of its own: the caller passes `now`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from sluice.priority import Priority
from sluice.scheduler.fair import DEFAULT_MIN_CLASS_SHARES, ClassShares, FairShare

__all__ = ["SlotDecision", "SlotQueue"]


@dataclass(frozen=True, slots=True)
class SlotDecision:
    """What `start_next` decided: calls to start now, and waiting calls whose deadline passed."""

    started: tuple[int, ...]
    expired: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Waiting:
    priority: Priority
    tenant: str
    deadline: float
    order: int


@dataclass(frozen=True, slots=True)
class _Running:
    priority: Priority
    tenant: str
    started_at: float
    charged_s: float


class SlotQueue:
    def __init__(self, max_running: int, max_waiting: int, *,
                 min_class_shares: Mapping[Priority, float] = DEFAULT_MIN_CLASS_SHARES) -> None:
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be at least 1 and max_waiting at least 0")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._waiting: dict[tuple[Priority, str], dict[int, _Waiting]] = {}
        self._running: dict[int, _Running] = {}
        self._fair = FairShare()
        self._class_shares = ClassShares(min_class_shares)
        self._order = itertools.count()

    def set_tenant_weights(self, weights: Mapping[str, float], *, default_weight: float = 1.0) -> None:
        """Tenants' fair-share weights; tenants not named get `default_weight`."""
        self._fair.set_weights(weights, default_weight=default_weight)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return sum(len(flow) for flow in self._waiting.values())

    @property
    def is_idle(self) -> bool:
        return not self._running and self.num_waiting == 0

    def offer(self, call_id: int, priority: Priority, deadline: float, tenant: str = "") -> bool:
        """Queue a call; False (refused) when `max_waiting` calls already wait."""
        if call_id in self._running or any(call_id in flow for flow in self._waiting.values()):
            raise ValueError(f"call {call_id} is already queued or running")
        if self.num_waiting >= self.max_waiting and self.num_running >= self.max_running:
            return False
        priority = Priority(priority)
        self._waiting.setdefault((priority, tenant), {})[call_id] = _Waiting(priority, tenant, deadline,
                                                                             next(self._order))
        self._fair.enqueue(priority, tenant, 0.0)
        return True

    def start_next(self, now: float, call_s: float = 1.0) -> SlotDecision:
        """Fill free slots in fair order (see the module's diagram), charging each call started
        `call_s`; drop expired waiters."""
        started: list[int] = []
        expired: list[int] = []
        while len(self._running) < self.max_running and (chosen := self._next()) is not None:
            call_id, waiting = chosen
            self._withdraw(call_id, waiting)
            if waiting.deadline <= now:
                expired.append(call_id)
                continue
            self._fair.start(waiting.priority, waiting.tenant)
            self._fair.charge(waiting.priority, waiting.tenant, call_s)
            self._running[call_id] = _Running(waiting.priority, waiting.tenant, now, call_s)
            started.append(call_id)
        return SlotDecision(tuple(started), tuple(expired))

    def expire(self, now: float) -> tuple[int, ...]:
        """Remove and return waiting calls whose deadline has passed."""
        late = [(call_id, waiting) for flow in self._waiting.values() for call_id, waiting in flow.items()
                if waiting.deadline <= now]
        for call_id, waiting in late:
            self._withdraw(call_id, waiting)
        return tuple(call_id for call_id, _ in late)

    def release(self, call_id: int, now: float | None = None) -> bool:
        """A call ended (finished, failed or cancelled): its slot or its place in line is freed.
        A running call is charged the time it held its slot (`now` less its start; without `now`,
        what it was charged at the start). False if it was not here."""
        running = self._running.pop(call_id, None)
        if running is not None:
            held_s = running.charged_s if now is None else max(now - running.started_at, 0.0)
            self._fair.account(running.priority, running.tenant, running.charged_s, held_s)
            backlogged = [priority for priority, _ in self._waiting]
            self._class_shares.record(held_s, {running.priority: held_s}, backlogged)
            return True
        for flow in self._waiting.values():
            waiting = flow.get(call_id)
            if waiting is not None:
                self._withdraw(call_id, waiting)
                return True
        return False

    def num_ahead(self, priority: Priority) -> int:
        """Calls that a newcomer of `priority` would wait behind: those waiting in its class and
        above (an upper bound: fair queueing may start a newcomer's call before other tenants')."""
        return sum(len(flow) for (p, _), flow in self._waiting.items() if p <= priority)

    def waits_s(self, call_s: float) -> list[float]:
        """Predicted wait for a slot, per class (index = Priority), for a newcomer: the calls
        ahead of it, plus the running ones, drain `max_running` at a time every `call_s`."""
        waits = []
        for priority in Priority:
            excess = self.num_ahead(priority) + self.num_running - self.max_running + 1
            waits.append(max(excess, 0) * call_s / self.max_running)
        return waits

    def _next(self) -> tuple[int, _Waiting] | None:
        """The waiting call whose turn it is."""
        classes = sorted({priority for priority, _ in self._waiting})
        if not classes:
            return None
        priority = self._class_shares.order(classes)[0]
        if any(running.priority == priority for running in self._running.values()):
            priority = classes[0]  # a class with a call running is being served: it is owed nothing more yet
        tenant = self._fair.backlogged(priority)[0]
        flow = self._waiting[(priority, tenant)]
        call_id = min(flow, key=lambda c: (flow[c].deadline, flow[c].order))
        return call_id, flow[call_id]

    def _withdraw(self, call_id: int, waiting: _Waiting) -> None:
        key = (waiting.priority, waiting.tenant)
        flow = self._waiting[key]
        del flow[call_id]
        if not flow:
            del self._waiting[key]
        self._fair.dequeue(waiting.priority, waiting.tenant, 0.0)
