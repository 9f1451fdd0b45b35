"""Per-model inference statistics in the shape of Triton's statistics extension.

    Ticket ends / early refusal ──▶ InferenceStatistics.record(...) ──▶ snapshot(name, version)
                                                                        GET /v2/models/.../stats
                                                                        gRPC ModelStatistics

What Triton users (and `tritonclient`'s `get_inference_statistics`) read: cumulative counts and
durations since the server started, per model version. They are this gateway's view: every
request it answered for the version, and the batches its requests ran in.

- `success` / `fail`: requests answered ok / otherwise (refused for overload, expired, failed,
  cancelled), with their durations from arrival at the gateway to the answer.
- `queue`: successful requests' wait at the worker before their batch started.
- `compute_infer`: successful requests' batch execution time (each request counts its whole
  batch's time, as Triton does). The worker does not time input and output preparation apart
  from the batch, so `compute_input` and `compute_output` count the requests with 0 ns.
- `cache_hit`: requests answered from the result cache (their durations); `cache_miss`: the
  version's other successful requests when its results may be cached (lookup time not measured).
- `inference_count`: items computed (a request of n rows counts n); `execution_count` and
  `batch_stats`: batch executions, each of a batch's n items counting 1/n of it, so a batch is
  counted once when all its items came through this gateway (always, embedded) and shared out
  between gateways otherwise. A request whose items ran in several batches is counted at its
  largest batch.

Pure bookkeeping: no I/O, and the time of the last inference comes from an injected wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.clock import Clock


@dataclass(slots=True)
class _Duration:
    count: int = 0
    seconds: float = 0.0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.seconds += max(seconds, 0.0)

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": round(self.seconds * 1e9)}


@dataclass(slots=True)
class _BatchSize:
    executions: float = 0.0
    seconds: float = 0.0


@dataclass(slots=True)
class _Version:
    last_inference_ms: int = 0
    inference_count: int = 0
    executions: float = 0.0
    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    cache_hit: _Duration = field(default_factory=_Duration)
    cache_miss: _Duration = field(default_factory=_Duration)
    batches: dict[int, _BatchSize] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Ran:
    """What the worker reported for a successful request that ran (not answered from the cache)."""

    num_items: int
    queue_s: float
    exec_s: float
    batch_size: int


class InferenceStatistics:
    def __init__(self, wall_clock: Clock) -> None:
        self._wall_clock = wall_clock
        self._versions: dict[tuple[str, str], _Version] = {}

    def failed(self, name: str, version: str, duration_s: float) -> None:
        self._stats(name, version).fail.add(duration_s)

    def succeeded(self, name: str, version: str, duration_s: float, ran: Ran | None, *,
                  is_cacheable: bool) -> None:
        """A request answered ok: by the device (`ran`), or from the result cache (`ran` None)."""
        stats = self._stats(name, version)
        stats.success.add(duration_s)
        stats.last_inference_ms = round(self._wall_clock.now() * 1000)
        if ran is None:
            stats.cache_hit.add(duration_s)
            return
        if is_cacheable:
            stats.cache_miss.add(0.0)
        stats.inference_count += ran.num_items
        stats.queue.add(ran.queue_s)
        stats.compute_infer.add(ran.exec_s)
        if ran.batch_size > 0:
            share = ran.num_items / ran.batch_size
            stats.executions += share
            batch = stats.batches.setdefault(ran.batch_size, _BatchSize())
            batch.executions += share
            batch.seconds += ran.exec_s * share

    def versions(self) -> list[tuple[str, str]]:
        """The (model, version) pairs with any request recorded, sorted."""
        return sorted(self._versions)

    def snapshot(self, name: str, version: str) -> dict[str, Any]:
        """One version's statistics as Triton's `ModelStatistics` (JSON field names); zeros if
        nothing was recorded for it yet."""
        stats = self._versions.get((name, version)) or _Version()
        successes = stats.success.count - stats.cache_hit.count
        unmeasured = {"count": successes, "ns": 0}
        return {
            "name": name,
            "version": version,
            "last_inference": stats.last_inference_ms,
            "inference_count": stats.inference_count,
            "execution_count": round(stats.executions),
            "inference_stats": {
                "success": stats.success.as_dict(),
                "fail": stats.fail.as_dict(),
                "queue": stats.queue.as_dict(),
                "compute_input": unmeasured,
                "compute_infer": stats.compute_infer.as_dict(),
                "compute_output": unmeasured,
                "cache_hit": stats.cache_hit.as_dict(),
                "cache_miss": stats.cache_miss.as_dict(),
            },
            "batch_stats": [_batch_entry(size, batch) for size, batch in sorted(stats.batches.items())
                            if round(batch.executions) > 0],
            "memory_usage": [],
        }

    def _stats(self, name: str, version: str) -> _Version:
        stats = self._versions.get((name, version))
        if stats is None:
            stats = self._versions[(name, version)] = _Version()
        return stats


def _batch_entry(size: int, batch: _BatchSize) -> dict[str, Any]:
    count = round(batch.executions)
    return {
        "batch_size": size,
        "compute_input": {"count": count, "ns": 0},
        "compute_infer": {"count": count, "ns": round(batch.seconds * 1e9)},
        "compute_output": {"count": count, "ns": 0},
    }
