"""A circuit breaker: stop calling a dependency that keeps failing, and probe it now and then.

    CLOSED ──failure_threshold consecutive failures──▶ OPEN
      ▲                                                 │ open_s elapsed
      │ trial succeeds                                  ▼
      └──────────────────────────────────────────── HALF_OPEN ──trial fails──▶ OPEN (again)

While CLOSED every call is allowed. While OPEN every call is refused at once (the caller fails
fast instead of waiting on a dependency that is down). Once `open_s` has passed, the breaker lets
exactly one trial call through (HALF_OPEN); the others are still refused until the trial's
outcome is recorded.

Pure policy: no I/O, time from an injected `Clock`. Not thread-safe; use one breaker from one
thread (an event loop). A caller that is granted a call must record its outcome
(`record_success` / `record_failure`), or a half-open breaker stays waiting for its trial.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sluice.clock import Clock


class CircuitState(enum.StrEnum):
    CLOSED = "closed"
    """Calls flow; consecutive failures are counted."""
    OPEN = "open"
    """Calls are refused until `open_s` has passed since the circuit opened."""
    HALF_OPEN = "half_open"
    """One trial call may go; its outcome closes or re-opens the circuit."""


@dataclass(frozen=True, slots=True)
class CircuitConfig:
    failure_threshold: int = 5
    """Consecutive failures that open the circuit."""
    open_s: float = 5.0
    """How long the circuit stays open before a trial call is allowed."""

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        if not self.open_s > 0:
            raise ValueError("open_s must be positive")


class CircuitBreaker:
    def __init__(self, config: CircuitConfig, clock: Clock) -> None:
        self._config = config
        self._clock = clock
        self._state = CircuitState.CLOSED
        self._num_failures = 0
        self._opened_at = 0.0
        self._is_trial_out = False

    @property
    def state(self) -> CircuitState:
        """The state now: an OPEN circuit whose `open_s` has passed reads HALF_OPEN."""
        if self._state is CircuitState.OPEN and self._clock.now() >= self._opened_at + self._config.open_s:
            return CircuitState.HALF_OPEN
        return self._state

    def allow(self) -> bool:
        """May a call go now? True grants it; the caller then records its outcome."""
        state = self.state
        if state is CircuitState.CLOSED:
            return True
        if state is CircuitState.HALF_OPEN and not self._is_trial_out:
            self._state = CircuitState.HALF_OPEN
            self._is_trial_out = True
            return True
        return False

    def retry_after_s(self) -> float:
        """Seconds until the next trial call may go (0 when calls may go now)."""
        if self._state is CircuitState.CLOSED:
            return 0.0
        return max(self._opened_at + self._config.open_s - self._clock.now(), 0.0)

    def record_success(self) -> None:
        self._state = CircuitState.CLOSED
        self._num_failures = 0
        self._is_trial_out = False

    def record_failure(self) -> None:
        if self._state is CircuitState.HALF_OPEN:
            self._open()  # the trial failed
            return
        if self._state is CircuitState.OPEN:
            return  # a call granted before the circuit opened; it is open already
        self._num_failures += 1
        if self._num_failures >= self._config.failure_threshold:
            self._open()

    def _open(self) -> None:
        self._state = CircuitState.OPEN
        self._opened_at = self._clock.now()
        self._num_failures = 0
        self._is_trial_out = False
