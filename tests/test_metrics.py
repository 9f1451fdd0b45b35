"""The histograms' buckets, read the way `sluice top` and Grafana read them: a percentile from
the buckets (`histogram_quantile`) must land near what was measured, for latencies from well
under a millisecond to minutes."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest

from sluice.exposition import Scrape, histogram_quantile
from sluice.metrics import GatewayMetrics, WorkerMetrics


class _Generation:
    num_prompt_tokens, num_cached_tokens, num_output_tokens = 100, 0, 2000


def _median(name: str, **labels: str) -> float | None:
    scrape = Scrape.parse(generate_latest(REGISTRY).decode(), 0.0)
    buckets = scrape.grouped(f"{name}_bucket", ("le",), **labels)
    return histogram_quantile(0.5, {float(le): count for (le,), count in buckets.items()})


def test_a_generation_of_minutes_reads_as_minutes_not_the_last_bucket() -> None:
    """Seen: every generation longer than 30 s read as p50 = 30 s (the last bound), under a
    60 s default SLO for generative models and an upstream's 600 s call timeout."""
    metrics = GatewayMetrics()
    for _ in range(3):
        metrics.first_token("bucket-test-long", 95.0)
        metrics.generation_done("bucket-test-long", _Generation(), e2e_s=150.0, ttft_s=95.0)
        metrics.request_done("bucket-test-long", "1", "ok", 150.0)
    assert 120.0 <= (_median("sluice_generation_duration_seconds", model="bucket-test-long") or 0) <= 300.0
    assert 120.0 <= (_median("sluice_request_duration_seconds", model="bucket-test-long") or 0) <= 300.0
    assert 60.0 <= (_median("sluice_time_to_first_token_seconds", model="bucket-test-long") or 0) <= 120.0


def test_waits_and_batches_under_a_millisecond_read_as_such() -> None:
    """Seen: a 0.1 ms queue wait read as p50 = 0.5 ms (half the first bound, 1 ms)."""
    metrics = WorkerMetrics("bucket-test")
    for _ in range(4):
        metrics.batch_done("bucket-test-fast", "1", 1, 0.0002, [0.0001])
    assert (_median("sluice_queue_wait_seconds", model="bucket-test-fast") or 1.0) <= 0.0001
    assert (_median("sluice_batch_execution_seconds", model="bucket-test-fast") or 1.0) <= 0.00025
