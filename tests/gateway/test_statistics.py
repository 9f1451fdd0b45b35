"""Triton-style statistics: a batch shared by several requests is one execution, counted once."""

from __future__ import annotations

from sluice.clock import VirtualClock
from sluice.gateway.statistics import InferenceStatistics, Ran


def test_a_batch_shared_by_requests_is_one_execution_and_cached_answers_are_not_executions():
    statistics = InferenceStatistics(VirtualClock(1_700_000_000.0))
    for _ in range(4):  # four one-item requests that ran together in one batch of 4 (10 ms)
        statistics.succeeded("m", "1", 0.020, Ran(num_items=1, queue_s=0.004, exec_s=0.010, batch_size=4),
                             is_cacheable=True)
    statistics.succeeded("m", "1", 0.030, Ran(num_items=3, queue_s=0.0, exec_s=0.012, batch_size=3),
                         is_cacheable=True)
    statistics.succeeded("m", "1", 0.001, None, is_cacheable=True)  # from the cache
    statistics.failed("m", "1", 0.002)

    stats = statistics.snapshot("m", "1")
    assert stats["last_inference"] == 1_700_000_000_000
    assert (stats["inference_count"], stats["execution_count"]) == (7, 2)
    inference = stats["inference_stats"]
    assert inference["success"] == {"count": 6, "ns": 111_000_000}
    assert inference["fail"] == {"count": 1, "ns": 2_000_000}
    assert inference["queue"] == {"count": 5, "ns": 16_000_000}
    assert inference["compute_infer"] == {"count": 5, "ns": 52_000_000}  # each request counts its batch's time
    assert (inference["cache_hit"], inference["cache_miss"]) == ({"count": 1, "ns": 1_000_000}, {"count": 5, "ns": 0})
    assert [(b["batch_size"], b["compute_infer"]) for b in stats["batch_stats"]] == \
        [(3, {"count": 1, "ns": 12_000_000}), (4, {"count": 1, "ns": 10_000_000})]


def test_unrecorded_versions_read_as_zeros():
    statistics = InferenceStatistics(VirtualClock())
    stats = statistics.snapshot("m", "2")
    assert (stats["name"], stats["version"], stats["execution_count"], stats["batch_stats"]) == ("m", "2", 0, [])
    assert statistics.versions() == []
