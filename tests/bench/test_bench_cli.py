"""`sluice bench` end to end: a real server on loopback, the real CLI, the files it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from sluice.cli import main
from tests.conftest import metric_total


@pytest.mark.slow
def test_bench_against_a_real_server_writes_sensible_json_and_a_plot(make_server, emulated_repo,
                                                                      tmp_path: Path) -> None:
    server = make_server(emulated_repo(alpha_ms=2, beta_ms=0.1))
    out = tmp_path / "run.json"
    result = CliRunner().invoke(main, [
        "bench", "--url", server.url, "--rate", "50", "--duration", "2", "--warmup", "0.5",
        "--timeout-ms", "5000", "--slo-ms", "1000", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["config"]["is_emulated"] is True
    [run] = document["results"]
    assert run["offered_rate_per_s"] == 50
    assert run["num_scheduled"] > 50  # about 100 expected in 2 s
    assert run["success_rate"] == 1.0
    assert run["status_counts"]["200"] == run["num_ok"] == run["num_scheduled"]
    assert 0 < run["latency"]["p50_ms"] <= run["latency"]["p95_ms"] <= run["latency"]["p99_ms"] < 1000
    assert run["completed_per_s"] == pytest.approx(run["achieved_send_rate_per_s"], rel=0.1)
    assert run["server"]["mean_batch_size"] >= 1
    assert run["server"]["num_workers"] == 1
    assert 0 < run["server"]["busy_ratio"] <= 1
    assert document["goodput"]["slo_ms"] == 1000
    assert out.with_suffix(".png").stat().st_size > 0
    assert "goodput" in result.output


@pytest.mark.slow
def test_no_rate_and_no_run_is_answered_from_the_result_cache(make_server, emulated_repo, tmp_path: Path) -> None:
    """A sweep's rates, and a second run against the same server, send bodies of their own: a
    cached answer would measure the cache, not the device path."""
    server = make_server(emulated_repo(alpha_ms=1, beta_ms=0.1))
    for run in range(2):
        result = CliRunner().invoke(main, [
            "bench", "--url", server.url, "--rates", "50,60", "--duration", "1", "--warmup", "0.2",
            "--out", str(tmp_path / f"run{run}.json"),
        ])
        assert result.exit_code == 0, result.output
    assert metric_total(server, "sluice_cache_lookups_total", model="emulated", result="miss") > 200
    assert metric_total(server, "sluice_cache_lookups_total", model="emulated", result="hit") == 0


def test_bench_needs_exactly_one_of_rate_and_rates() -> None:
    runner = CliRunner()
    assert runner.invoke(main, ["bench"]).exit_code == 2
    both = runner.invoke(main, ["bench", "--rate", "10", "--rates", "10,20"])
    assert both.exit_code == 2 and "not both" in both.output
    bad = runner.invoke(main, ["bench", "--rates", "10,abc"])
    assert bad.exit_code == 2


def test_bench_reports_an_unreachable_server_as_an_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["bench", "--url", "http://127.0.0.1:9", "--rate", "10",
                                       "--out", str(tmp_path / "x.json")])
    assert result.exit_code == 1
    assert "cannot reach" in result.output
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_self_test_measures_the_generator_against_a_null_server(tmp_path: Path) -> None:
    out = tmp_path / "self.json"
    result = CliRunner().invoke(main, ["bench", "--self-test", "--duration", "1", "--concurrency", "8",
                                       "--rate", "100", "--out", str(out)])
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["closed_loop_requests_per_s"] > 100  # far more on any machine; this is a sanity floor
    assert document["closed_loop"]["num_errors"] == 0
    [open_loop] = document["open_loop"]
    assert open_loop["success_rate"] == 1.0


def test_cli_connection_cap_default_matches_the_generator() -> None:
    from sluice.bench.cli import bench
    from sluice.bench.loadgen import DEFAULT_MAX_CONNECTIONS

    [option] = [p for p in bench.params if p.name == "max_connections"]
    assert option.default == DEFAULT_MAX_CONNECTIONS


@pytest.mark.slow
@pytest.mark.parametrize("how", ["flag", "SLUICE_BENCH_API_KEY", "SLUICE_API_KEY", "OPENAI_API_KEY"])
def test_bench_sends_the_api_key_to_a_server_with_tenants(make_server, emulated_repo, tmp_path: Path,
                                                          how: str) -> None:
    from sluice.gateway.tenants import hash_key, new_key

    key = new_key()
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.bench]\napi_keys = ["{hash_key(key)}"]\n')
    server = make_server(emulated_repo(alpha_ms=2, beta_ms=0.1), "--tenants", str(tenants))
    out = tmp_path / "run.json"
    args = ["bench", "--url", server.url, "--rate", "20", "--duration", "1", "--warmup", "0",
            "--timeout-ms", "5000", "--slo-ms", "1000", "--out", str(out)]
    env = {"SLUICE_BENCH_API_KEY": None, "SLUICE_API_KEY": None, "OPENAI_API_KEY": None}
    if how == "flag":
        args += ["--api-key", key]
    else:
        env[how] = key
    result = CliRunner(env=env).invoke(main, args)
    assert result.exit_code == 0, result.output
    [run] = json.loads(out.read_text())["results"]
    assert run["status_counts"]["200"] == run["num_ok"] == run["num_scheduled"] > 0
    assert run["server"]["mean_batch_size"] >= 1  # /metrics was read too
    assert key not in out.read_text()
    assert json.loads(out.read_text())["config"]["api_key"] == "(set)"
