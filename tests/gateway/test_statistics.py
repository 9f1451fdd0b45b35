"""Triton-style statistics: requests as this gateway answered them, batches as the workers ran them."""

from __future__ import annotations

from sluice import wire
from sluice.clock import VirtualClock
from sluice.gateway.statistics import InferenceStatistics, Ran


def test_requests_count_items_queue_and_compute_and_cached_answers_are_hits():
    statistics = InferenceStatistics(VirtualClock(1_700_000_000.0))
    for _ in range(4):  # four one-item requests that ran together in one batch (10 ms)
        statistics.succeeded("m", "1", 0.020, Ran(num_items=1, queue_s=0.004, exec_s=0.010), is_cacheable=True)
    statistics.succeeded("m", "1", 0.030, Ran(num_items=3, queue_s=0.0, exec_s=0.012), is_cacheable=True)
    statistics.succeeded("m", "1", 0.001, None, is_cacheable=True)  # from the cache
    statistics.failed("m", "1", 0.002)

    stats = statistics.snapshot("m", "1")
    assert stats["last_inference"] == 1_700_000_000_000
    assert stats["inference_count"] == 7
    inference = stats["inference_stats"]
    assert inference["success"] == {"count": 6, "ns": 111_000_000}
    assert inference["fail"] == {"count": 1, "ns": 2_000_000}
    assert inference["queue"] == {"count": 5, "ns": 16_000_000}
    assert inference["compute_infer"] == {"count": 5, "ns": 52_000_000}  # each request counts its batch's time
    assert (inference["cache_hit"], inference["cache_miss"]) == ({"count": 1, "ns": 1_000_000}, {"count": 5, "ns": 0})


def _report(worker: str, incarnation: str, *counts: tuple[int, int, float]) -> wire.BatchStats:
    return wire.BatchStats(worker, incarnation, [wire.BatchCount("m", "1", size, n, s) for size, n, s in counts])


def test_batches_are_the_workers_cumulative_counts_across_reports_workers_and_restarts():
    statistics = InferenceStatistics(VirtualClock())
    statistics.executions(_report("w0", "a", (4, 1, 0.010)))
    statistics.executions(_report("w0", "a", (4, 2, 0.021), (3, 1, 0.012)))  # cumulative: one more of 4
    statistics.executions(_report("w0", "a", (4, 2, 0.021), (3, 1, 0.012)))  # repeated: nothing new
    statistics.executions(_report("w1", "x", (4, 1, 0.009)))  # another worker
    statistics.executions(_report("w0", "b", (4, 1, 0.008)))  # w0 restarted: counts from zero again
    stats = statistics.snapshot("m", "1")
    assert stats["execution_count"] == 5
    assert [(b["batch_size"], b["compute_infer"]) for b in stats["batch_stats"]] == \
        [(3, {"count": 1, "ns": 12_000_000}), (4, {"count": 4, "ns": 38_000_000})]


def test_unrecorded_versions_read_as_zeros():
    statistics = InferenceStatistics(VirtualClock())
    stats = statistics.snapshot("m", "2")
    assert (stats["name"], stats["version"], stats["execution_count"], stats["batch_stats"]) == ("m", "2", 0, [])
    assert statistics.versions() == []


def test_two_workers_started_with_the_same_id_are_counted_apart() -> None:
    """Two `sluice worker`s left at the default `--id 0` behind one gateway: each report looked
    like a restart of the other, so every report's whole cumulative count was added again
    (Triton's execution_count grew without end while nothing ran)."""
    import asyncio

    from sluice.gateway.gateway import Gateway
    from sluice.metrics import GatewayMetrics

    async def scenario() -> dict:
        gateway = Gateway(VirtualClock(), GatewayMetrics())
        for name in ("0@tcp://10.0.0.1:7000", "0@tcp://10.0.0.2:7000"):  # nothing listens: never connected
            await gateway.add_worker(name, "ipc:///nonexistent/sluice-statistics-test.sock")
        first, second = gateway._connections.values()
        for _ in range(3):  # the same cumulative reports, every half second
            first._on_message(_report("0", "a", (4, 2, 0.020)))
            second._on_message(_report("0", "b", (4, 1, 0.010)))
        await gateway.aclose()
        return gateway.statistics.snapshot("m", "1")

    stats = asyncio.run(scenario())
    assert stats["execution_count"] == 3
    assert [(b["batch_size"], b["compute_infer"]) for b in stats["batch_stats"]] == \
        [(4, {"count": 3, "ns": 30_000_000})]
