"""Per-rate summaries and goodput selection, on hand-built samples."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sluice.bench.promstats import ServerStats
from sluice.bench.stats import (
    MAX_LAG_P99_MS,
    TRANSPORT_ERROR,
    LatencySummary,
    RateResult,
    RunSamples,
    latency_summary,
    select_goodput,
    summarize,
)


def _samples(status: list[int], latency_ms: list[float], retry_after: list[bool] | None = None,
             lag_ms: float = 0.0, duration_s: float = 1.0) -> RunSamples:
    n = len(status)
    scheduled = np.linspace(0, duration_s, n, endpoint=False)
    return RunSamples(
        rate_per_s=n / duration_s, duration_s=duration_s, scheduled_s=scheduled,
        sent_s=scheduled + lag_ms / 1000, latency_s=np.array(latency_ms) / 1000,
        status=np.array(status, dtype=np.int16),
        has_retry_after=np.array(retry_after or [False] * n, dtype=bool), server=None,
    )


def test_summary_counts_statuses_and_keeps_latency_of_successes_only() -> None:
    status = [200] * 90 + [429] * 4 + [503] * 3 + [504, 500, TRANSPORT_ERROR]
    latency = [10.0] * 90 + [1.0] * 7 + [50.0, 2.0, float("nan")]
    retry_after = [False] * 90 + [True] * 6 + [False] + [False] * 3
    result = summarize(_samples(status, latency, retry_after))
    assert result.status_counts == {"200": 90, "429": 4, "503": 3, "504": 1, "other": 1, "error": 1, "500": 1}
    assert result.num_ok == 90 and result.success_rate == pytest.approx(0.9)
    assert result.latency is not None and result.latency.p99_ms == pytest.approx(10.0)
    assert result.rejection_latency is not None and result.rejection_latency.p50_ms == pytest.approx(1.0)
    assert result.num_rejections == 7 and result.num_rejections_with_retry_after == 6
    assert result.rejections_carry_retry_after is False


def test_rates_come_from_the_measured_window() -> None:
    result = summarize(_samples([200] * 500, [5.0] * 500, duration_s=2.0))
    assert result.achieved_send_rate_per_s == pytest.approx(250, rel=0.01)
    assert result.completed_per_s == pytest.approx(250, rel=0.01)
    assert result.rejections_carry_retry_after is None


def test_late_sends_are_reported_as_lag_and_mark_the_run_behind() -> None:
    on_time = summarize(_samples([200] * 100, [5.0] * 100, lag_ms=0.5))
    late = summarize(_samples([200] * 100, [5.0] * 100, lag_ms=MAX_LAG_P99_MS * 3))
    assert on_time.lag is not None and on_time.lag.p99_ms == pytest.approx(0.5)
    assert not on_time.is_behind_schedule
    assert late.is_behind_schedule


def test_latency_summary_is_none_without_finite_values() -> None:
    assert latency_summary(np.array([])) is None
    assert latency_summary(np.array([np.nan])) is None
    summary = latency_summary(np.arange(1, 101) / 1000)
    assert summary is not None and summary.p50_ms == pytest.approx(50.5) and summary.max_ms == pytest.approx(100)


def _result(rate: float, p99_ms: float | None, success_rate: float = 1.0, behind: bool = False) -> RateResult:
    latency = None if p99_ms is None else LatencySummary(p99_ms / 2, p99_ms * 0.9, p99_ms, p99_ms / 2, p99_ms)
    return RateResult(
        offered_rate_per_s=rate, duration_s=10, num_scheduled=int(rate * 10), num_ok=int(rate * 10 * success_rate),
        achieved_send_rate_per_s=rate, completed_per_s=rate * success_rate, success_rate=success_rate,
        latency=latency, status_counts={}, rejection_latency=None, num_rejections=0,
        num_rejections_with_retry_after=0, lag=None, is_behind_schedule=behind,
        server=ServerStats(10, 100, 4.0, 1, 0.5),
    )


def test_goodput_is_the_highest_rate_meeting_latency_and_success() -> None:
    sweep = [_result(200, 20), _result(400, 40), _result(800, 95), _result(1200, 250), _result(1600, 900)]
    goodput = select_goodput(sweep, slo_ms=100)
    assert goodput.offered_rate_per_s == 800 and goodput.completed_per_s == 800


def test_goodput_skips_rates_with_too_many_failures_or_a_lagging_generator() -> None:
    sweep = [_result(200, 20), _result(400, 30, success_rate=0.98), _result(600, 30, behind=True)]
    assert select_goodput(sweep, slo_ms=100).offered_rate_per_s == 200


def test_goodput_judges_each_rate_on_its_own() -> None:
    # A noisy sweep: 400 misses, 600 passes. The highest passing rate wins.
    sweep = [_result(600, 90), _result(200, 20), _result(400, 120)]
    assert select_goodput(sweep, slo_ms=100).offered_rate_per_s == 600


def test_no_goodput_when_nothing_meets_the_slo() -> None:
    sweep = [_result(200, 150), _result(400, None, success_rate=0.0)]
    goodput = select_goodput(sweep, slo_ms=100)
    assert goodput.offered_rate_per_s is None and goodput.completed_per_s is None
    assert dataclasses.asdict(goodput)["slo_ms"] == 100


def test_a_run_with_more_outstanding_requests_than_connections_is_connection_limited() -> None:
    samples = _samples([200] * 10, [5.0] * 10)
    capped = dataclasses.replace(samples, peak_in_flight=50, max_connections=10)
    uncapped = dataclasses.replace(samples, peak_in_flight=50, max_connections=0)
    within = dataclasses.replace(samples, peak_in_flight=10, max_connections=10)
    assert summarize(capped).is_connection_limited
    assert not summarize(uncapped).is_connection_limited
    assert not summarize(within).is_connection_limited
    assert summarize(capped).peak_in_flight == 50
