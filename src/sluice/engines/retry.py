"""Retrying calls to an upstream server: which answers are worth retrying, and how long to wait.

Shared by the runners that call external servers (`http-single`, `openai-upstream`). Pure: no
I/O; the jitter source is passed in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from sluice.circuit import CircuitConfig
from sluice.errors import ConfigError

__all__ = ["RETRYABLE_4XX", "RetryConfig", "backoff_delay_s", "parse_retry"]

RETRYABLE_4XX = frozenset({408, 429})
"""The upstream asks us to come back later; other 4xx are final (the request itself is wrong)."""


@dataclass(frozen=True, slots=True)
class RetryConfig:
    max_attempts: int = 3
    backoff_s: float = 0.05
    """Base of the exponential backoff with full jitter: attempt k waits U(0, backoff_s * 2**(k-1))."""
    max_backoff_s: float = 2.0
    circuit: CircuitConfig = field(default_factory=CircuitConfig)

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        return backoff_delay_s(attempt, self.backoff_s, self.max_backoff_s, rng)


def backoff_delay_s(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2**(attempt - 1))] after failed attempt `attempt`."""
    return rng.uniform(0.0, min(cap_s, base_s * 2 ** (attempt - 1)))


def parse_retry(params: dict[str, Any], where: str) -> RetryConfig:
    """`max_attempts`, `backoff_ms`, `max_backoff_ms`, `failure_threshold`, `open_s` from a model's
    settings; ConfigError naming `where` for a wrong type or range."""
    try:
        config = RetryConfig(
            max_attempts=int(params.get("max_attempts", 3)),
            backoff_s=float(params.get("backoff_ms", 50)) / 1000,
            max_backoff_s=float(params.get("max_backoff_ms", 2000)) / 1000,
            circuit=CircuitConfig(int(params.get("failure_threshold", 5)), float(params.get("open_s", 5.0))),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: bad retry setting: {exc}") from exc
    if config.max_attempts < 1 or config.backoff_s < 0 or config.max_backoff_s < 0:
        raise ConfigError(f"{where}: max_attempts must be at least 1 and backoff_ms, max_backoff_ms >= 0")
    return config
