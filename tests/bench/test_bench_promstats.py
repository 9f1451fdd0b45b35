"""Server-side statistics from two Prometheus text expositions."""

from __future__ import annotations

import pytest

from sluice.bench.promstats import ServerSnapshot, parse_snapshot, server_delta


def _exposition(batches: dict[str, tuple[float, float]], busy_s: dict[str, float]) -> str:
    """A /metrics text like sluice's: batch-size histograms per model, busy counters per worker."""
    lines = ["# HELP sluice_batch_size Items per executed batch.", "# TYPE sluice_batch_size histogram"]
    for model, (total, count) in batches.items():
        labels = f'model="{model}",version="1"'
        lines += [f'sluice_batch_size_bucket{{le="1.0",{labels}}} 0.0',
                  f'sluice_batch_size_bucket{{le="+Inf",{labels}}} {count}',
                  f"sluice_batch_size_count{{{labels}}} {count}",
                  f"sluice_batch_size_sum{{{labels}}} {total}"]
    lines += ["# HELP sluice_device_busy_seconds_total Seconds the device spent executing batches.",
              "# TYPE sluice_device_busy_seconds_total counter"]
    lines += [f'sluice_device_busy_seconds_total{{worker="{w}"}} {s}' for w, s in busy_s.items()]
    lines += ["# HELP sluice_device_busy_ratio Fraction busy.", "# TYPE sluice_device_busy_ratio gauge",
              'sluice_device_busy_ratio{pid="12",worker="0"} 0.5',
              "# HELP sluice_requests_total Requests.", "# TYPE sluice_requests_total counter",
              'sluice_requests_total{model="a",outcome="ok",version="1"} 7.0']
    return "\n".join(lines) + "\n"


def test_mean_batch_size_and_busy_ratio_come_from_the_deltas() -> None:
    before = parse_snapshot(_exposition({"a": (100, 50), "b": (10, 10)}, {"0": 3.0, "1": 4.0}), taken_at_s=100.0)
    after = parse_snapshot(_exposition({"a": (400, 100), "b": (30, 20)}, {"0": 8.0, "1": 6.0}), taken_at_s=110.0)
    stats = server_delta(before, after)
    # (300 + 20) items over (50 + 10) batches; (5 + 2) busy seconds over 10 s x 2 workers.
    assert stats.num_batches == 60
    assert stats.mean_batch_size == pytest.approx(320 / 60)
    assert stats.num_workers == 2
    assert stats.busy_ratio == pytest.approx(7 / 20)
    assert stats.wall_s == pytest.approx(10)


def test_model_filter_keeps_only_that_models_batches() -> None:
    text_before = _exposition({"a": (100, 50), "b": (10, 10)}, {"0": 0.0})
    text_after = _exposition({"a": (400, 100), "b": (30, 20)}, {"0": 1.0})
    stats = server_delta(parse_snapshot(text_before, 0.0, model="a"), parse_snapshot(text_after, 2.0, model="a"))
    assert stats.mean_batch_size == pytest.approx(300 / 50)
    assert stats.busy_ratio == pytest.approx(0.5)  # the busy counter has no model label: never filtered


def test_a_quiet_window_has_no_mean_batch_size() -> None:
    text = _exposition({"a": (100, 50)}, {"0": 3.0})
    stats = server_delta(parse_snapshot(text, 1.0), parse_snapshot(text, 3.0))
    assert stats.mean_batch_size is None and stats.num_batches == 0
    assert stats.busy_ratio == 0.0


def test_a_worker_seen_only_afterwards_counts_from_zero() -> None:
    before = ServerSnapshot(0.0, 0.0, 0.0, {"0": 1.0})
    after = ServerSnapshot(4.0, 8.0, 2.0, {"0": 3.0, "1": 2.0})
    stats = server_delta(before, after)
    assert stats.num_workers == 2 and stats.busy_ratio == pytest.approx((2 + 2) / (4 * 2))


def test_no_workers_means_no_busy_ratio_and_snapshots_must_be_ordered() -> None:
    empty = parse_snapshot("", 1.0)
    assert server_delta(empty, ServerSnapshot(2.0, 0, 0)).busy_ratio is None
    with pytest.raises(ValueError, match="later"):
        server_delta(ServerSnapshot(2.0, 0, 0), empty)
