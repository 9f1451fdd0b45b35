"""Bounded concurrency in front of an upstream server, pure policy.

An upstream (another OpenAI-compatible server) does its own batching; what sluice controls is how
many calls it has in flight. `SlotQueue` holds at most `max_running` calls running; the rest wait
here, by class and then by arrival:

    offer ─▶ waiting[INTERACTIVE] ─┐
             waiting[STANDARD]    ─┼─▶ start (highest class first, FIFO within a class)
             waiting[BATCH]       ─┘        while num_running < max_running
    release / withdraw ─▶ a slot frees ─▶ the next waiting call starts

A waiting call whose deadline has passed is never started: `start_next` returns it as expired.
`waits_s` predicts, per class, how long a newcomer would wait for a slot, from the mean call
duration, so a gateway can route by it and refuse work that would miss its deadline.

No I/O and no clock of its own: the caller passes `now`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from sluice.priority import Priority

__all__ = ["SlotDecision", "SlotQueue"]


@dataclass(frozen=True, slots=True)
class SlotDecision:
    """What `start_next` decided: calls to start now, and waiting calls whose deadline passed."""

    started: tuple[int, ...]
    expired: tuple[int, ...]


class SlotQueue:
    def __init__(self, max_running: int, max_waiting: int) -> None:
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be at least 1 and max_waiting at least 0")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._waiting: dict[Priority, OrderedDict[int, float]] = {p: OrderedDict() for p in Priority}
        self._running: set[int] = set()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    @property
    def is_idle(self) -> bool:
        return not self._running and self.num_waiting == 0

    def offer(self, call_id: int, priority: Priority, deadline: float) -> bool:
        """Queue a call; False (refused) when `max_waiting` calls already wait."""
        if call_id in self._running or any(call_id in queue for queue in self._waiting.values()):
            raise ValueError(f"call {call_id} is already queued or running")
        if self.num_waiting >= self.max_waiting and self.num_running >= self.max_running:
            return False
        self._waiting[priority][call_id] = deadline
        return True

    def start_next(self, now: float) -> SlotDecision:
        """Fill free slots from the highest class first, oldest first; drop expired waiters."""
        started: list[int] = []
        expired: list[int] = []
        for priority in Priority:
            queue = self._waiting[priority]
            while queue and len(self._running) < self.max_running:
                call_id, deadline = queue.popitem(last=False)
                if deadline <= now:
                    expired.append(call_id)
                    continue
                self._running.add(call_id)
                started.append(call_id)
        return SlotDecision(tuple(started), tuple(expired))

    def expire(self, now: float) -> tuple[int, ...]:
        """Remove and return waiting calls whose deadline has passed."""
        expired: list[int] = []
        for queue in self._waiting.values():
            late = [call_id for call_id, deadline in queue.items() if deadline <= now]
            for call_id in late:
                del queue[call_id]
            expired += late
        return tuple(expired)

    def release(self, call_id: int) -> bool:
        """A call ended (finished, failed or cancelled): its slot or its place in line is freed.
        False if it was not here."""
        if call_id in self._running:
            self._running.remove(call_id)
            return True
        return any(queue.pop(call_id, None) is not None for queue in self._waiting.values())

    def num_ahead(self, priority: Priority) -> int:
        """Calls that a newcomer of `priority` would wait behind: those waiting in its class and above."""
        return sum(len(self._waiting[p]) for p in Priority if p <= priority)

    def waits_s(self, call_s: float) -> list[float]:
        """Predicted wait for a slot, per class (index = Priority), for a newcomer: the calls
        ahead of it, plus the running ones, drain `max_running` at a time every `call_s`."""
        waits = []
        for priority in Priority:
            excess = self.num_ahead(priority) + self.num_running - self.max_running + 1
            waits.append(max(excess, 0) * call_s / self.max_running)
        return waits
