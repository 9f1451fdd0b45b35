"""Multi-tenant scenarios: merged arrival schedules, verdicts on hand-built results, and one real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sluice.bench.loadgen import LoadConfig, _merged_schedule
from sluice.bench.promstats import ServerStats
from sluice.bench.scenario_run import Device, write_setup
from sluice.bench.scenarios import SCENARIOS, Measured, PhaseResult
from sluice.bench.stats import LatencySummary, RateResult
from sluice.gateway.tenants import load_tenants
from sluice.priority import Priority


def test_streams_merge_into_one_sorted_schedule_with_each_streams_rate() -> None:
    config = LoadConfig(0.0, duration_s=20.0, warmup_s=2.0, seed=3)
    offsets, streams, num_warmup, measured = _merged_schedule((100.0, 300.0, 0.0), config)
    assert np.all(np.diff(offsets) >= 0)
    assert np.all(offsets[:num_warmup] < 2.0) and np.all(offsets[num_warmup:] >= 2.0)
    for stream, rate in enumerate((100.0, 300.0)):
        count = int(np.count_nonzero(streams[num_warmup:] == stream))
        assert count == measured[stream].size
        assert abs(count - rate * 20) < 4 * np.sqrt(rate * 20)
    assert measured[2].size == 0 and not np.any(streams == 2)
    # a single stream keeps the schedule it had before streams existed
    single, _, _, _ = _merged_schedule((100.0,), config)
    again, _, _, _ = _merged_schedule((100.0, 300.0), config)
    assert np.array_equal(single, again[np.isin(again, single)])


def test_a_schedule_needs_some_load() -> None:
    with pytest.raises(ValueError):
        _merged_schedule((0.0, 0.0), LoadConfig(0.0, 1.0))


def _result(tenant_rate: float, p99_ms: float, success: float = 1.0) -> RateResult:
    latency = LatencySummary(p99_ms / 2, p99_ms * 0.9, p99_ms, p99_ms / 2, p99_ms)
    return RateResult(
        offered_rate_per_s=tenant_rate, duration_s=10, num_scheduled=100, num_ok=int(100 * success),
        achieved_send_rate_per_s=tenant_rate, completed_per_s=tenant_rate * success, success_rate=success,
        latency=latency, status_counts={}, rejection_latency=None, num_rejections=0,
        num_rejections_with_retry_after=0, lag=None, is_behind_schedule=False, server=None)


def _server(shares: dict[str, float], busy: float = 0.99) -> ServerStats:
    return ServerStats(10.0, 100, 30.0, 1, busy, {t: 10.0 * s for t, s in shares.items()})


def test_weights_verdicts_follow_the_measured_device_shares() -> None:
    scenario = SCENARIOS["weights"]
    phase = scenario.phases[0]
    runs = {s.tenant: _result(400, 100) for s in phase.streams}
    fair = Measured({phase.name: PhaseResult(phase, runs, _server({"w1": 1 / 7, "w2": 2 / 7, "w4": 4 / 7}))},
                    capacity_per_s=444, slo_ms=270)
    assert all(check.passed for check in scenario.checks(fair))
    equal = Measured({phase.name: PhaseResult(phase, runs, _server({"w1": 1 / 3, "w2": 1 / 3, "w4": 1 / 3}))},
                     capacity_per_s=444, slo_ms=270)
    verdicts = {check.target: check.passed for check in scenario.checks(equal)}
    assert not verdicts["w1 device share 0.143 +-5%"] and verdicts["device busy >= 95%"]


def test_noisy_neighbour_compares_b_with_b_alone() -> None:
    scenario = SCENARIOS["noisy-neighbour"]
    alone_phase, mixed_phase = scenario.phases

    def verdicts(b_mixed_p99: float) -> dict[str, bool]:
        measured = Measured({
            alone_phase.name: PhaseResult(alone_phase, {"B": _result(111, 60)}, _server({"B": 1.0}, 0.5)),
            mixed_phase.name: PhaseResult(mixed_phase, {"A": _result(330, 200), "B": _result(111, b_mixed_p99)},
                                          _server({"A": 0.75, "B": 0.25})),
        }, capacity_per_s=444, slo_ms=270)
        return {check.target: check.passed for check in scenario.checks(measured)}

    assert verdicts(65.0)["B p99 within 10% of B alone"]
    assert not verdicts(70.0)["B p99 within 10% of B alone"]
    assert verdicts(70.0)["A gets the rest of the device"]


def test_scenario_setup_writes_a_tenants_file_sluice_loads(tmp_path: Path) -> None:
    scenario = SCENARIOS["priority-mix"]
    keys = write_setup(tmp_path, scenario, Device(3.0))
    tenants = load_tenants(tmp_path / "tenants.toml")
    online, offline = tenants.tenant_for_key(keys["online"]), tenants.tenant_for_key(keys["offline"])
    assert online is not None and online.priority is Priority.INTERACTIVE
    assert offline is not None and offline.priority is Priority.BATCH
    assert "alpha_ms = 24" in (tmp_path / "models" / "emulated" / "model.toml").read_text()
    assert Device(3.0).capacity_per_s == pytest.approx(32 / 0.072)


def test_weights_scenario_against_a_real_server(tmp_path: Path) -> None:
    out = tmp_path / "weights.json"
    done = subprocess.run(
        [sys.executable, "-m", "sluice", "bench", "--scenario", "weights", "--duration", "3", "--warmup", "1",
         "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    (phase,) = document["phases"]
    shares = phase["server"]["device_shares"]
    assert set(shares) == {"w1", "w2", "w4"}
    assert sum(shares.values()) == pytest.approx(1.0)
    # even a short run on a loaded machine orders the tenants by weight
    assert shares["w1"] < shares["w2"] < shares["w4"]
    assert shares["w4"] > 0.4
    for tenant in ("w1", "w2", "w4"):
        result = phase["by_tenant"][tenant]
        assert result["num_ok"] > 0 and result["num_rejections"] > 0  # each offered the whole device
    assert {check["target"] for check in document["checks"]} >= {"device busy >= 95%"}
