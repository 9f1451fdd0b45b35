"""Capacity planning (`scheduler.plan`, `sluice plan`): the formula's estimate, the simulation's
verdict per device count, and the profile read from a running server's /metrics."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from click.testing import CliRunner

from sluice.cli import main
from sluice.exposition import Scrape
from sluice.plan_cli import profile_from
from sluice.scheduler.plan import Load, capacity_per_device, largest_batch, plan

DEMO = {"alpha_s": 0.008, "beta_s": 0.0005, "slo_s": 0.1}
"""The demo `emulated` model: a batch of n rows of 16 values takes 8 ms + 0.5 ms per row."""


def test_the_formula_takes_the_largest_batch_a_request_can_wait_out_and_ride_within_its_slo():
    assert largest_batch(Load(1000, **DEMO)) == 32  # 2 x (8 + 0.5 n) <= 100 ms up to n = 84: the size cap
    assert capacity_per_device(Load(1000, **DEMO)) == pytest.approx(32 / 0.024)
    tight = Load(1000, **{**DEMO, "slo_s": 0.020})
    assert largest_batch(tight) == 4 and capacity_per_device(tight) == pytest.approx(400)
    assert largest_batch(Load(1000, **DEMO, max_batch_cost=48, cost_per_item=16)) == 3
    assert largest_batch(Load(1000, **{**DEMO, "slo_s": 0.016})) == 0  # a batch of one takes 8.5 ms
    with pytest.raises(ValueError):
        Load(0, **DEMO)


def test_the_plan_is_the_fewest_devices_whose_simulation_meets_the_target():
    result = plan(Load(2000, **DEMO), duration_s=10)
    assert result.formula_devices == 2  # 2,000 requests/s over 1,333 a device
    one, two = result.tried
    assert one.devices == 1 and not one.meets(result.load), "1.5 times one device's capacity"
    assert one.rejected_ratio > 0.2 and one.busy_ratio > 0.99 and one.mean_batch_size == pytest.approx(32, abs=0.5)
    assert two.meets(result.load) and two.on_time_ratio >= 0.99 and two.rejected_ratio == 0
    assert result.devices == 2


def test_one_device_short_of_the_formulas_estimate_refuses_what_it_cannot_answer_in_time():
    result = plan(Load(10_000, **DEMO), duration_s=10)
    assert result.formula_devices == 8 and result.tried[0].devices == 7
    short = result.tried[0]  # 1,429 requests/s on a device that serves 1,333: refused at once, not late
    assert short.rejected_ratio > 0.03 and short.on_time_ratio + short.rejected_ratio == pytest.approx(1, abs=0.002)
    assert result.devices is not None and result.devices >= 8


def test_a_device_too_slow_for_the_slo_is_said_so_without_simulating():
    result = plan(Load(100, **{**DEMO, "slo_s": 0.016}))
    assert result.formula_devices is None and result.devices is None and result.tried == ()


def test_the_command_prints_the_plan_and_its_json():
    runner = CliRunner()
    args = ["plan", "--rpm", "120000", "--slo-ms", "100", "--alpha-ms", "8", "--beta-ms", "0.03125", "--cost", "16",
            "--duration", "10"]
    text = runner.invoke(main, args)
    assert text.exit_code == 0, text.output
    assert "about 2 devices" in text.output and "plan: 2 devices" in text.output
    as_json = runner.invoke(main, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    found = json.loads(as_json.output)
    assert found["devices"] == 2 and found["load"]["rate_per_s"] == pytest.approx(2000)
    assert [tried["devices"] for tried in found["tried"]] == [1, 2]
    for wrong in (["plan", "--slo-ms", "100", "--alpha-ms", "8", "--beta-ms", "0.5"],  # no load
                  ["plan", "--rate", "10", "--slo-ms", "100"],  # no device
                  ["plan", "--rate", "10", "--slo-ms", "100", "--url", "http://127.0.0.1:1"]):  # no --model
        refused = runner.invoke(main, wrong)
        assert refused.exit_code == 2, refused.output


def test_the_profile_read_from_metrics_is_the_slowest_workers_of_the_newest_version():
    scrape = Scrape.parse("\n".join([
        'sluice_latency_profile_alpha_seconds{model="m",version="2",worker="0"} 0.008',
        'sluice_latency_profile_alpha_seconds{model="m",version="2",worker="1"} 0.010',
        'sluice_latency_profile_alpha_seconds{model="m",version="10",worker="0"} 0.004',
        'sluice_latency_profile_beta_seconds{model="m",version="2",worker="0"} 0.0005',
        'sluice_latency_profile_beta_seconds{model="m",version="2",worker="1"} 0.0004',
        'sluice_latency_profile_beta_seconds{model="m",version="10",worker="0"} 0.0002',
        'sluice_latency_profile_alpha_seconds{model="other",version="1",worker="0"} 0.1',
        'sluice_latency_profile_beta_seconds{model="other",version="1",worker="0"} 0.1', ""]), 0.0)
    assert profile_from(scrape, "m", None) == ("10", 0.004, 0.0002)
    assert profile_from(scrape, "m", "2") == ("2", 0.010, 0.0005)
    with pytest.raises(ValueError, match="versions: 2, 10"):
        profile_from(scrape, "m", "3")
    with pytest.raises(ValueError, match="it has: m, other"):
        profile_from(scrape, "nope", None)


@pytest.mark.slow
def test_the_command_reads_a_running_servers_learned_profile(demo_server):
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sluice", "plan", "--url", demo_server.url, *args],
                              capture_output=True, text=True, timeout=120)

    done = run("--model", "emulated", "--rate", "500", "--slo-ms", "100", "--cost", "16", "--duration", "5", "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert 0 < found["load"]["alpha_s"] < 1 and 0 < found["load"]["beta_s"] < 1
    assert found["devices"] is not None and math.isfinite(found["capacity_per_device"])
    unknown = run("--model", "nope", "--rate", "500", "--slo-ms", "100")
    assert unknown.returncode == 1 and "no latency profile of model 'nope'" in unknown.stderr
    assert "emulated" in unknown.stderr


def test_below_the_estimate_fewer_devices_are_tried_while_they_still_meet_the_target():
    result = plan(Load(4800, **{**DEMO, "slo_s": 0.05}, on_time_target=0.5), duration_s=10)
    assert result.formula_devices == 4
    assert [tried.devices for tried in result.tried] == [1, 2, 3]  # 3 met half on time, then 2 did, 1 did not
    assert result.devices == 2 and not result.tried[0].meets(result.load)
