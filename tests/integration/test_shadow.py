"""Shadow traffic through a real server: copies of the requests routed to one version go to the
shadow version as well, measured and compared, while every client is answered as before."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from sluice.cli import main
from tests.conftest import ServerProcess, eventually, metric_total, write_two_versions

pytestmark = pytest.mark.slow

_values = itertools.count(1)


def _infer(client: httpx.Client, server: ServerProcess, path: str = "/v2/models/emulated/infer") -> str:
    value = float(next(_values))  # a new input each time: no answer comes from the result cache
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [value, 1.0]}]}
    answer = client.post(f"{server.url}{path}", json=body)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["model_version"])


def _embed(client: httpx.Client, server: ServerProcess) -> str:
    answer = client.post(f"{server.url}/v1/embeddings", json={"model": "emulated", "input": [f"text {next(_values)}"]})
    assert answer.status_code == 200, answer.text
    return answer.headers["x-sluice-model-version"]


def _shadow(server: ServerProcess, version: str, outcome: str) -> float:
    return metric_total(server, "sluice_shadow_requests_total", model="emulated", version=version, outcome=outcome)


def _compared(server: ServerProcess, result: str) -> float:
    return metric_total(server, "sluice_shadow_comparisons_total", model="emulated", version="2", result=result)


def test_a_shadow_version_gets_copies_that_are_measured_and_never_answered(
        make_server: Callable[..., ServerProcess], tmp_path: Path) -> None:
    # version 2 makes embeddings of 8 dimensions (1's have 16): its embeddings differ, its tensor answers not
    server = make_server(write_two_versions(tmp_path / "repo", v2_params="dims = 8"))
    admin = f"{server.url}/admin/models/emulated"
    runner = CliRunner()
    with httpx.Client(timeout=30) as client:
        assert client.put(f"{admin}/shadow", json={"version": "2"}).status_code == 409  # the newest has all the traffic
        assert client.put(f"{admin}/traffic", json={"traffic": {"1": 100}}).status_code == 200
        assert client.put(f"{admin}/shadow", json={"version": "7"}).status_code == 404
        assert client.put(f"{admin}/shadow", json={"version": "2", "share": 1.5}).status_code == 400
        assert client.put(f"{admin}/shadow", json={"version": "1"}).status_code == 409  # where they go anyway
        started = runner.invoke(main, ["models", "shadow", "emulated", "2", "--url", server.url])
        assert started.exit_code == 0, started.output
        assert "shadow: version 2 gets a copy of 100% of the requests" in started.output
        assert client.get(admin).json()["shadow"] == {"version": "2", "share": 1.0}

        assert {_infer(client, server) for _ in range(10)} == {"1"}  # answered by the routed version, as before
        assert _infer(client, server, "/v2/models/emulated/versions/1/infer") == "1"  # named its version: no copy
        eventually(lambda: _shadow(server, "2", "ok") == 10, "the ten copies answered by version 2")
        eventually(lambda: _compared(server, "same") == 10, "the copies' answers compared")
        assert {_embed(client, server) for _ in range(3)} == {"1"}
        eventually(lambda: _compared(server, "different") == 3, "the copied embeddings found different")
        assert _shadow(server, "2", "ok") == 13 and _compared(server, "same") == 10

        # the copies count nowhere but in the shadow's metrics: not as requests, nor against the tenant
        assert metric_total(server, "sluice_requests_total", model="emulated", version="2") == 0
        assert metric_total(server, "sluice_requests_total", model="emulated", version="1") == 14
        assert metric_total(server, "sluice_tenant_admitted_total") == 14
        assert metric_total(server, "sluice_shadow_latency_seconds_count", model="emulated", version="2") == 13

        stopped = runner.invoke(main, ["models", "shadow", "emulated", "--stop", "--url", server.url])
        assert stopped.exit_code == 0 and "shadow:" not in stopped.output, stopped.output
        assert client.get(admin).json()["shadow"] is None
        assert {_infer(client, server) for _ in range(5)} == {"1"}
        time.sleep(0.5)  # a copy would have been sent beside its original, answered by now
        assert _shadow(server, "2", "ok") == 13
        assert metric_total(server, "sluice_requests_total", model="emulated", version="2") == 0
        usage = runner.invoke(main, ["models", "shadow", "emulated", "--url", server.url])
        assert usage.exit_code == 2, usage.output
