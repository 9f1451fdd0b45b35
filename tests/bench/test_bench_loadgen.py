"""The arrival process and the sender, against the null server (no sluice server needed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sluice.bench.loadgen import LoadConfig, LoadGenerator, poisson_schedule
from sluice.bench.selftest import null_server
from sluice.bench.stats import TRANSPORT_ERROR, summarize
from sluice.bench.workloads import Endpoint, InputSpec, build_workload
from tests.bench.conftest import ScriptedServer


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


@pytest.mark.parametrize(("path", "status", "has_retry_after"), [
    ("/busy", 503, True), ("/reject", 429, False), ("/close", 200, False),
    ("/stall", TRANSPORT_ERROR, False), ("/drop", TRANSPORT_ERROR, False), ("/garbage", TRANSPORT_ERROR, False),
])
async def test_every_request_is_accounted_for_whatever_the_server_does(
        scripted_server: ScriptedServer, path: str, status: int, has_retry_after: bool) -> None:
    workload = build_workload(Endpoint.EMBEDDINGS, f"http://127.0.0.1:{scripted_server.port}", "m", 4, None)
    workload = dataclasses.replace(workload, url=scripted_server.url(path))
    generator = LoadGenerator(workload, request_timeout_s=0.3, max_connections=8)
    samples = await generator.run(LoadConfig(150.0, 0.6, warmup_s=0.1, seed=1))
    assert samples.sent_s.size == samples.scheduled_s.size > 0
    assert np.all(np.isfinite(samples.sent_s)) and np.all(np.isfinite(samples.latency_s))
    assert samples.status.tolist() == [status] * samples.status.size
    assert samples.has_retry_after.tolist() == [has_retry_after] * samples.status.size
    if path == "/stall":  # each one failed at its timeout, give or take a sweep
        assert np.all(samples.latency_s >= 0.3) and np.all(samples.latency_s < 0.6)
    assert summarize(samples).num_scheduled == samples.scheduled_s.size


async def test_the_connection_cap_holds_and_the_run_says_it_was_connection_limited(
        scripted_server: ScriptedServer) -> None:
    workload = build_workload(Endpoint.EMBEDDINGS, f"http://127.0.0.1:{scripted_server.port}", "m", 4, None)
    workload = dataclasses.replace(workload, url=scripted_server.url("/slow"))
    # 300 req/s of 50 ms answers needs ~15 connections; with 3, requests queue in the client.
    samples = await LoadGenerator(workload, request_timeout_s=10, max_connections=3).run(LoadConfig(300.0, 0.5))
    assert scripted_server.peak_open == 3
    assert samples.status.tolist() == [200] * samples.status.size
    result = summarize(samples)
    assert samples.max_connections == 3 and samples.peak_in_flight > 3 and result.is_connection_limited
    assert result.latency is not None and result.latency.p99_ms > 100  # the wait for a connection counts


async def test_streams_to_different_paths_share_one_run(scripted_server: ScriptedServer) -> None:
    base = build_workload(Endpoint.EMBEDDINGS, f"http://127.0.0.1:{scripted_server.port}", "m", 4, None)
    workloads = [dataclasses.replace(base, url=scripted_server.url(path)) for path in ("/ok", "/busy")]
    ok, busy = await LoadGenerator(workloads, request_timeout_s=5).run_streams(
        (200.0, 100.0), LoadConfig(0.0, 0.5, seed=2))
    assert ok.status.tolist() == [200] * ok.status.size and ok.status.size > 0
    assert busy.status.tolist() == [503] * busy.status.size and busy.status.size > 0
    assert busy.has_retry_after.all() and not ok.has_retry_after.any()


def test_a_generator_sends_to_one_server_with_valid_limits() -> None:
    a = build_workload(Endpoint.EMBEDDINGS, "http://127.0.0.1:8000", "m", 4, None)
    b = build_workload(Endpoint.EMBEDDINGS, "http://127.0.0.1:8001", "m", 4, None)
    with pytest.raises(ValueError, match="one server"):
        LoadGenerator([a, b], request_timeout_s=1)
    with pytest.raises(ValueError, match="max_connections"):
        LoadGenerator(a, request_timeout_s=1, max_connections=-1)
