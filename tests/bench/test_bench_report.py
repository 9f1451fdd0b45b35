"""The JSON document and the plot, from hand-built results."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from rich.console import Console

from sluice.bench import report
from sluice.bench.promstats import ServerStats
from sluice.bench.stats import Goodput, LatencySummary, RateResult


def _result(rate: float, p99_ms: float) -> RateResult:
    return RateResult(
        offered_rate_per_s=rate, duration_s=10, num_scheduled=int(rate * 10), num_ok=int(rate * 10) - 3,
        achieved_send_rate_per_s=rate, completed_per_s=rate * 0.99, success_rate=0.99,
        latency=LatencySummary(p99_ms / 3, p99_ms / 2, p99_ms, p99_ms / 3, p99_ms * 2),
        status_counts={"200": int(rate * 10) - 3, "429": 0, "503": 3, "504": 0, "other": 0, "error": 0},
        rejection_latency=LatencySummary(1, 1, 2, 1, 2), num_rejections=3, num_rejections_with_retry_after=3,
        lag=LatencySummary(0.1, 0.2, 0.5, 0.1, 1.0), is_behind_schedule=rate > 1000,
        server=ServerStats(10.0, 200, 7.5, 1, 0.6),
    )


def test_result_document_is_json_with_config_results_and_goodput(tmp_path: Path) -> None:
    results = [_result(200, 20), _result(800, 60)]
    document = report.result_document({"model": "m"}, results, Goodput(100, 800, 792),
                                      now=dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC))
    path = tmp_path / "deep" / "run.json"
    report.write_json(path, document)
    loaded = json.loads(path.read_text())
    assert loaded["format"] == report.FORMAT and loaded["created_at"] == "2025-01-02T03:04:05+00:00"
    assert [r["offered_rate_per_s"] for r in loaded["results"]] == [200, 800]
    assert loaded["results"][1]["latency"]["p99_ms"] == 60
    assert loaded["results"][1]["server"]["mean_batch_size"] == 7.5
    assert loaded["results"][0]["rejections_carry_retry_after"] is True
    assert loaded["goodput"] == {"slo_ms": 100, "offered_rate_per_s": 800, "completed_per_s": 792}


def test_default_paths_are_timestamped_under_benchmarks_results() -> None:
    path = report.default_out_path(dt.datetime(2025, 6, 7, 8, 9, 10))
    assert path == Path("benchmarks/results/20250607-080910.json")


def test_plot_is_drawn_for_a_sweep_and_for_a_single_rate(tmp_path: Path) -> None:
    sweep = [_result(200, 20), _result(800, 60), _result(1600, 400)]
    report.plot(tmp_path / "sweep.png", sweep, Goodput(100, 800, 792), "sweep")
    report.plot(tmp_path / "single.png", sweep[:1], Goodput(100, None, None), "single")
    for name in ("sweep.png", "single.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


def test_summary_fits_an_80_column_terminal_and_names_the_goodput() -> None:
    console = Console(width=80, record=True)
    report.print_summary(console, [_result(200, 20), _result(1600, 400)], Goodput(100, 200, 198), "t")
    text = console.export_text()
    assert "…" not in text  # nothing truncated
    assert "200 req/s offered" in text
    assert "fell behind" in text  # the 1600/s run was behind schedule
