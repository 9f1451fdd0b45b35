"""Per-model inference statistics in the shape of Triton's statistics extension.

    Ticket ends / early refusal ──▶ succeeded() / failed() ──┐
    worker's wire.BatchStats (every 0.5 s) ──▶ executions() ──┴─▶ snapshot(name, version)
                                                                 GET /v2/models/.../stats
                                                                 gRPC ModelStatistics

What Triton users (and `tritonclient`'s `get_inference_statistics`) read: cumulative counts and
durations since the server started, per model version: the requests this gateway answered, and
the batches the workers ran.

- `success` / `fail`: requests answered ok / otherwise (refused for overload, expired, failed,
  cancelled), with their durations from arrival at the gateway to the answer.
- `queue`: successful requests' wait at the worker before their batch started.
- `compute_infer`: successful requests' batch execution time (each request counts its whole
  batch's time, as Triton does). The worker does not time input and output preparation apart
  from the batch, so `compute_input` and `compute_output` count the requests with 0 ns.
- `cache_hit`: requests answered from the result cache (their durations); `cache_miss`: the
  version's other successful requests when its results may be cached (lookup time not measured).
- `inference_count`: items this gateway's requests computed (a request of n rows counts n; an
  answer from the cache counts none);
- `execution_count` and `batch_stats`: the batches the workers ran for the version, by size, as
  each worker counts them (whichever gateway sent their items) and reports them every half
  second: up to half a second behind. A worker that restarts starts counting again from zero;
  what it had reported stays counted here.

Pure bookkeeping: no I/O, and the time of the last inference comes from an injected wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice import wire
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
class _Version:
    last_inference_ms: int = 0
    inference_count: int = 0
    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    cache_hit: _Duration = field(default_factory=_Duration)
    cache_miss: _Duration = field(default_factory=_Duration)
    batches: dict[int, _Duration] = field(default_factory=dict)
    """Batch size -> batches run and their time."""


@dataclass(frozen=True, slots=True)
class Ran:
    """What the worker reported for a successful request that ran (not answered from the cache)."""

    num_items: int
    queue_s: float
    exec_s: float


class InferenceStatistics:
    def __init__(self, wall_clock: Clock) -> None:
        self._wall_clock = wall_clock
        self._versions: dict[tuple[str, str], _Version] = {}
        self._reported: dict[str, tuple[str, dict[tuple[str, str, int], tuple[int, float]]]] = {}
        """worker id -> (its incarnation, what it last reported): reports are cumulative."""

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

    def executions(self, report: wire.BatchStats, source: str | None = None) -> None:
        """A worker's cumulative batch counts: what is new since its previous report is added (all
        of it, from a new incarnation of the worker: a restart counts from zero). `source` names
        the worker as the gateway knows it (its connection); the report's own `worker_id` is
        `sluice worker --id`, which two workers may share (its default, 0)."""
        source = report.worker_id if source is None else source
        incarnation, previous = self._reported.get(source, ("", {}))
        if incarnation != report.incarnation:
            previous = {}
        latest = {}
        for count in report.counts:
            key = (count.model, count.version, count.batch_size)
            latest[key] = (count.count, count.exec_s)
            seen_count, seen_s = previous.get(key, (0, 0.0))
            if count.count > seen_count:
                batches = self._stats(count.model, count.version).batches
                batches.setdefault(count.batch_size, _Duration()).add(count.exec_s - seen_s, count.count - seen_count)
        self._reported[source] = (report.incarnation, latest)

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
            "execution_count": sum(batch.count for batch in stats.batches.values()),
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
            "batch_stats": [_batch_entry(size, batch) for size, batch in sorted(stats.batches.items())],
            "memory_usage": [],
        }

    def _stats(self, name: str, version: str) -> _Version:
        stats = self._versions.get((name, version))
        if stats is None:
            stats = self._versions[(name, version)] = _Version()
        return stats


def _batch_entry(size: int, batch: _Duration) -> dict[str, Any]:
    return {
        "batch_size": size,
        "compute_input": {"count": batch.count, "ns": 0},
        "compute_infer": batch.as_dict(),
        "compute_output": {"count": batch.count, "ns": 0},
    }
