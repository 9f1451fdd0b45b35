"""The arrival process and the sender, against the null server (no sluice server needed)."""

from __future__ import annotations

import numpy as np
import pytest

from sluice.bench.loadgen import LoadConfig, LoadGenerator, poisson_schedule
from sluice.bench.selftest import null_server
from sluice.bench.stats import summarize
from sluice.bench.workloads import Endpoint, InputSpec, build_workload


def test_poisson_schedule_has_the_offered_mean_rate() -> None:
    rate_per_s, duration_s = 2000.0, 50.0
    offsets = poisson_schedule(rate_per_s, duration_s, np.random.default_rng(7))
    expected = rate_per_s * duration_s
    # A Poisson count has standard deviation sqrt(expected): 4 sigma is about 1.3% here.
    assert abs(offsets.size - expected) < 4 * np.sqrt(expected)
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(1 / rate_per_s, rel=0.02)
    # Exponential gaps: the standard deviation equals the mean (coefficient of variation 1).
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)


def test_poisson_schedule_is_sorted_within_the_window_and_repeatable() -> None:
    first = poisson_schedule(300.0, 2.0, np.random.default_rng(1))
    again = poisson_schedule(300.0, 2.0, np.random.default_rng(1))
    assert np.array_equal(first, again)
    assert np.all(np.diff(first) >= 0)
    assert first[0] >= 0 and first[-1] < 2.0


def test_poisson_schedule_counts_stay_right_over_seeds() -> None:
    counts = [poisson_schedule(100.0, 1.0, np.random.default_rng(seed)).size for seed in range(400)]
    assert np.mean(counts) == pytest.approx(100, rel=0.03)
    assert np.var(counts) == pytest.approx(100, rel=0.25)  # Poisson: variance equals mean


@pytest.mark.parametrize(("rate", "duration"), [(0, 1), (-5, 1), (10, 0)])
def test_poisson_schedule_rejects_non_positive_rate_or_duration(rate: float, duration: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        poisson_schedule(rate, duration, np.random.default_rng(0))


async def test_generator_sends_every_scheduled_request_and_records_each_answer() -> None:
    async with null_server() as url:
        workload = build_workload(Endpoint.KSERVE, url, "null", 4, None, InputSpec("INPUT0", "FP32"))
        samples = await LoadGenerator(workload, request_timeout_s=10).run(LoadConfig(200.0, 1.0, warmup_s=0.3, seed=3))
    expected = poisson_schedule(200.0, 1.0, _rng_after_warmup(200.0, 0.3, seed=3))
    assert np.allclose(samples.scheduled_s, expected)
    assert samples.status.tolist() == [200] * expected.size
    assert np.all(np.isfinite(samples.latency_s)) and np.all(samples.latency_s > 0)
    result = summarize(samples)
    assert result.success_rate == 1.0
    assert result.num_scheduled == expected.size
    assert result.server is None  # no snapshotter given
    assert 1 <= samples.peak_in_flight < expected.size and not result.is_connection_limited


async def test_generator_counts_refused_connections_as_errors() -> None:
    workload = build_workload(Endpoint.EMBEDDINGS, "http://127.0.0.1:9", "m", 4, None)  # port 9: nothing there
    samples = await LoadGenerator(workload, request_timeout_s=5).run(LoadConfig(100.0, 0.3))
    result = summarize(samples)
    assert result.status_counts["error"] == result.num_scheduled > 0
    assert result.success_rate == 0.0 and result.latency is None


def _rng_after_warmup(rate_per_s: float, warmup_s: float, seed: int) -> np.random.Generator:
    rng = np.random.default_rng(seed)
    poisson_schedule(rate_per_s, warmup_s, rng)
    return rng
