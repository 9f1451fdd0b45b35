"""Pure summaries of load-generator runs: percentiles, per-rate results and SLO goodput.

Definitions (all over the measured requests of one rate, warm-up excluded):

    success rate         = answered 200 / scheduled
    achieved send rate   = sent / max(duration, time of the last send)
    completed throughput = answered 200 / max(duration, time of the last 200 answer)
    latency              = answer time - actual send time, of 200 answers only
    lag                  = actual send time - scheduled send time (the generator's own delay)

A run is *behind schedule* when its p99 lag is over a limit (`MAX_LAG_P99_MS` by default): the
generator could not
offer the load it claims, so such a run never counts towards goodput. A run is
*connection-limited* when more requests were outstanding than the client's connection cap:
the excess waited in the client (that wait is in their latency), so the server saw less
concurrency than an unbounded open-loop client would have given it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sluice.bench.promstats import ServerStats

TRANSPORT_ERROR = 0
"""The status recorded for a request that got no HTTP answer (refused, reset, client timeout)."""

MAX_LAG_P99_MS = 10.0
MIN_SUCCESS_RATE = 0.99
REJECTION_STATUSES = (429, 503)
STATUS_KEYS = ("200", "429", "503", "504", "other", "error")


@dataclass(frozen=True, slots=True)
class RunSamples:
    """What happened to each measured request. Times are seconds from the start of measurement.

    `latency_s` is NaN for a request that never finished; `status` is the HTTP status or
    `TRANSPORT_ERROR`.
    """

    rate_per_s: float
    duration_s: float
    scheduled_s: np.ndarray
    sent_s: np.ndarray
    latency_s: np.ndarray
    status: np.ndarray
    has_retry_after: np.ndarray
    server: ServerStats | None
    peak_in_flight: int = 0
    """The most requests outstanding at once, warm-up included."""
    max_connections: int = 0
    """The client's connection cap (0: none)."""
    generator_cpu_cores: float = 0.0
    """CPU the generator's process used over the whole run, in cores (1.0: one core, all the time)."""


@dataclass(frozen=True, slots=True)
class LatencySummary:
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float


@dataclass(frozen=True, slots=True)
class RateResult:
    offered_rate_per_s: float
    duration_s: float
    num_scheduled: int
    num_ok: int
    achieved_send_rate_per_s: float
    completed_per_s: float
    success_rate: float
    latency: LatencySummary | None
    status_counts: dict[str, int]
    rejection_latency: LatencySummary | None
    num_rejections: int
    num_rejections_with_retry_after: int
    lag: LatencySummary | None
    is_behind_schedule: bool
    server: ServerStats | None
    peak_in_flight: int = 0
    is_connection_limited: bool = False
    generator_cpu_cores: float = 0.0

    @property
    def rejections_carry_retry_after(self) -> bool | None:
        """Whether every 429/503 had a `Retry-After` header; `None` when there were none."""
        if self.num_rejections == 0:
            return None
        return self.num_rejections_with_retry_after == self.num_rejections


@dataclass(frozen=True, slots=True)
class Goodput:
    """The highest offered rate that met the SLO, and what the server completed there."""

    slo_ms: float
    offered_rate_per_s: float | None
    completed_per_s: float | None


def latency_summary(seconds: np.ndarray) -> LatencySummary | None:
    """Percentiles in milliseconds of the finite values, or `None` when there are none."""
    values = seconds[np.isfinite(seconds)] * 1000.0
    if values.size == 0:
        return None
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return LatencySummary(float(p50), float(p95), float(p99), float(values.mean()), float(values.max()))


def status_counts(status: np.ndarray) -> dict[str, int]:
    """Counts under `STATUS_KEYS`; each status counted as "other" also appears under its own code."""
    counts = dict.fromkeys(STATUS_KEYS, 0)
    for key in ("200", "429", "503", "504"):
        counts[key] = int(np.count_nonzero(status == int(key)))
    counts["error"] = int(np.count_nonzero(status == TRANSPORT_ERROR))
    counts["other"] = int(status.size) - sum(counts.values())
    if counts["other"]:
        known = np.isin(status, [200, 429, 503, 504, TRANSPORT_ERROR])
        codes, numbers = np.unique(status[~known], return_counts=True)
        counts.update({str(int(c)): int(n) for c, n in zip(codes, numbers, strict=True)})
    return counts


def summarize(samples: RunSamples, max_lag_p99_ms: float = MAX_LAG_P99_MS) -> RateResult:
    ok = samples.status == 200
    rejected = np.isin(samples.status, REJECTION_STATUSES)
    num_scheduled = int(samples.status.size)
    num_ok = int(np.count_nonzero(ok))
    sent = samples.sent_s[np.isfinite(samples.sent_s)]
    last_send_s = float(sent.max()) if sent.size else 0.0
    ok_done_s = (samples.sent_s + samples.latency_s)[ok]
    last_ok_s = float(ok_done_s.max()) if ok_done_s.size else 0.0
    lag = latency_summary(samples.sent_s - samples.scheduled_s)
    return RateResult(
        offered_rate_per_s=samples.rate_per_s,
        duration_s=samples.duration_s,
        num_scheduled=num_scheduled,
        num_ok=num_ok,
        achieved_send_rate_per_s=sent.size / max(samples.duration_s, last_send_s),
        completed_per_s=num_ok / max(samples.duration_s, last_ok_s),
        success_rate=num_ok / num_scheduled if num_scheduled else 0.0,
        latency=latency_summary(samples.latency_s[ok]),
        status_counts=status_counts(samples.status),
        rejection_latency=latency_summary(samples.latency_s[rejected]),
        num_rejections=int(np.count_nonzero(rejected)),
        num_rejections_with_retry_after=int(np.count_nonzero(samples.has_retry_after & rejected)),
        lag=lag,
        is_behind_schedule=lag is not None and lag.p99_ms > max_lag_p99_ms,
        server=samples.server,
        peak_in_flight=samples.peak_in_flight,
        is_connection_limited=0 < samples.max_connections < samples.peak_in_flight,
        generator_cpu_cores=samples.generator_cpu_cores,
    )


def meets_slo(result: RateResult, slo_ms: float, min_success_rate: float = MIN_SUCCESS_RATE) -> bool:
    return (result.latency is not None and result.latency.p99_ms <= slo_ms
            and result.success_rate >= min_success_rate and not result.is_behind_schedule)


def select_goodput(results: Sequence[RateResult], slo_ms: float,
                   min_success_rate: float = MIN_SUCCESS_RATE) -> Goodput:
    """The highest offered rate whose p99 ≤ SLO with success ≥ `min_success_rate`.

    Rates are judged one by one, so a passing rate above a failing one still counts (a sweep
    is not assumed to be monotonic); rates where the generator fell behind never count.
    """
    passing = [r for r in results if meets_slo(r, slo_ms, min_success_rate)]
    if not passing:
        return Goodput(slo_ms, None, None)
    best = max(passing, key=lambda r: r.offered_rate_per_s)
    return Goodput(slo_ms, best.offered_rate_per_s, best.completed_per_s)
