"""Pacing each tenant's batch items to the tenant's limits, learnt from the limiter's refusals.

A batch item runs under its tenant's limits like an online request. A 429 that says when to come
back (`retry-after-ms` / `Retry-After`) is not a failure of the item: the item waits that long and
returns to the queue with its attempts untouched, and the executor slows that tenant down:

    refusal ──▶ window = max(1, min(window, items in flight - 1))   the items the limiter let run
       │        rate or budget limit: no new item before the Retry-After (the tenant is paused)
       │        concurrency limit:    no pause (a slot frees when one of our items ends)
    answer  ──▶ window += 1 / window                                 probe upwards, gently
    not paused, no refusal for `forget_after_s` ──▶ unpaced again (its limits were raised)

`room(now)` is what the executor may start per paced tenant; other tenants are not bounded here.
Pure policy: no I/O, and time comes in as `now`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Refusal", "TenantPacer"]

@dataclass(frozen=True, slots=True)
class Refusal:
    """A limit refused an item: it may be tried again `retry_after_s` from now."""

    retry_after_s: float
    is_concurrency: bool
    """Refused for the tenant's concurrent-requests cap (no pause: a slot frees as items end)."""


class _Pace:
    __slots__ = ("last_refused_at", "num_in_flight", "paused_until", "window")

    def __init__(self) -> None:
        self.num_in_flight = 0
        self.window: float | None = None
        self.paused_until = 0.0
        self.last_refused_at = 0.0


class TenantPacer:
    def __init__(self, forget_after_s: float = 60.0) -> None:
        if forget_after_s <= 0:
            raise ValueError("forget_after_s must be > 0")
        self._forget_after_s = forget_after_s
        self._paces: dict[str, _Pace] = {}

    def room(self, now: float) -> dict[str, int]:
        """How many more items each paced tenant may start now (0 while it is paused)."""
        room: dict[str, int] = {}
        for owner, pace in list(self._paces.items()):
            if (pace.window is not None and now >= pace.paused_until
                    and now - pace.last_refused_at >= self._forget_after_s):
                pace.window = None
            if pace.window is None:
                self._drop_if_idle(owner, pace)
                continue
            room[owner] = 0 if now < pace.paused_until else max(0, math.floor(pace.window) - pace.num_in_flight)
        return room

    def started(self, owner: str) -> None:
        pace = self._paces.get(owner)
        if pace is None:
            pace = self._paces[owner] = _Pace()
        pace.num_in_flight += 1

    def answered(self, owner: str) -> None:
        """An item of `owner` got an answer (any but a limit's refusal)."""
        pace = self._ended(owner)
        if pace is not None and pace.window is not None:
            pace.window += 1.0 / pace.window

    def refused(self, owner: str, refusal: Refusal, now: float) -> None:
        pace = self._paces.get(owner)
        if pace is None:
            return
        window = pace.window if pace.window is not None else math.inf
        pace.window = float(max(1, min(window, pace.num_in_flight - 1)))
        pace.last_refused_at = now
        if not refusal.is_concurrency:
            pace.paused_until = max(pace.paused_until, now + refusal.retry_after_s)
        self._ended(owner)

    def abandoned(self, owner: str) -> None:
        """An item of `owner` was stopped before its answer (its batch was cancelled or expired)."""
        self._ended(owner)

    def _ended(self, owner: str) -> _Pace | None:
        pace = self._paces.get(owner)
        if pace is not None:
            pace.num_in_flight = max(0, pace.num_in_flight - 1)
            self._drop_if_idle(owner, pace)
        return pace

    def _drop_if_idle(self, owner: str, pace: _Pace) -> None:
        if pace.window is None and pace.num_in_flight == 0:
            del self._paces[owner]
