"""Injected time. Policy code takes a `Clock` so tests can drive it with a `VirtualClock`."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic timeline; only differences are meaningful."""
        ...


class MonotonicClock:
    """The real clock: `time.monotonic()`, shared by every process on the host."""

    def now(self) -> float:
        return time.monotonic()


class WallClock:
    """Seconds since the epoch: for state shared between hosts (e.g. limits kept in Redis), where
    a monotonic clock's origin would differ from host to host."""

    def now(self) -> float:
        return time.time()


class VirtualClock:
    """A clock that moves only when told to. For tests and simulations."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s

    def now(self) -> float:
        return self._now

    def advance(self, delta_s: float) -> None:
        if delta_s < 0:
            raise ValueError("a clock cannot go backwards")
        self._now += delta_s

    def set(self, now_s: float) -> None:
        if now_s < self._now:
            raise ValueError("a clock cannot go backwards")
        self._now = now_s
