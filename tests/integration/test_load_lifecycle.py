"""A worker's loads as clients see them: a worker listens before it loads (its other models serve
while a slow one loads, and the slow one is reported `LOADING`), it loads a few versions at once
(`--load-concurrency`), a load that hangs is given up after its `[loading] timeout_s`, loads at
once within a memory budget cannot overfill it, and neither can the versions it starts with, and
a version removed from the repository is forgotten (404, not 503 forever). Real processes, real
clients (`tritonclient`, `openai`, httpx)."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import tritonclient.http as triton

from tests.conftest import eventually, free_port, start_server, stop_all, write_emulated_model, write_two_versions
from tests.user_models import add_gated_version

pytestmark = pytest.mark.slow

X = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
ROW = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


def _index(url: str) -> dict[tuple[str, str], tuple[str, str]]:
    answer = httpx.post(f"{url}/v2/repository/index", json={})
    return {(e["name"], e["version"]): (e["state"], e["reason"]) for e in answer.json()}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[str, Path, list[subprocess.Popen[bytes]]]]:
    """A `sluice worker` of a repository with an emulated model and a `gated` one whose load
    waits for the file `gate`, and a `sluice gateway` in front of it: (gateway url, gate, processes)."""
    repo = write_emulated_model(tmp_path / "models", alpha_ms=1.0, beta_ms=0.1)
    gate = tmp_path / "gate"
    add_gated_version(repo / "gated", "1", gate)
    address, port = f"ipc://{tmp_path}/worker.sock", free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with (tmp_path / "worker.log").open("wb") as worker_log, (tmp_path / "gateway.log").open("wb") as gateway_log:
        processes = [
            subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--bind", address, "--models", str(repo)],
                             stdout=worker_log, stderr=subprocess.STDOUT, env=env),
            subprocess.Popen([sys.executable, "-m", "sluice", "gateway", "--worker", address, "--port", str(port)],
                             stdout=gateway_log, stderr=subprocess.STDOUT, env=env),
        ]
    try:
        yield f"http://127.0.0.1:{port}", gate, processes
    finally:
        gate.touch()
        stop_all(processes)


def test_a_worker_serves_its_other_models_while_one_loads_and_reports_it_loading(cluster):
    url, gate, processes = cluster
    eventually(lambda: (gate.parent / "gate.started").exists(), "the worker loading the gated model", 60)
    # it listens before it loads: the gateway sees it, and what it is loading
    eventually(lambda: _index(url).get(("gated", "1")) == ("LOADING", ""), "gated v1 reported LOADING", 30)
    eventually(lambda: httpx.post(f"{url}/v2/models/emulated/infer", json=ROW).status_code == 200,
               "the emulated model served while the other loads", 30)
    assert _index(url)[("emulated", "1")] == ("READY", "")
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    assert not client.is_model_ready("gated") and not client.is_server_ready()
    infer = httpx.post(f"{url}/v2/models/gated/infer", json=X)
    assert infer.status_code == 503 and infer.headers["retry-after"] == "1"
    assert "model 'gated' is being loaded" in infer.json()["error"]
    with pytest.raises(openai.APIStatusError) as not_ready:  # as KServe's metadata: 503, not 404
        openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0).models.retrieve("gated")
    assert not_ready.value.status_code == 503 and not_ready.value.code == "model_not_ready"
    assert not_ready.value.response.headers["retry-after"] == "1"

    gate.touch()
    eventually(lambda: client.is_model_ready("gated"), "gated v1 ready once loaded", 30)
    assert httpx.post(f"{url}/v2/models/gated/infer", json=X).json()["outputs"][0]["data"] == [1.0]
    assert _index(url)[("gated", "1")] == ("READY", "") and client.is_server_ready()
    processes[0].send_signal(signal.SIGTERM)
    assert processes[0].wait(timeout=30) == 0


def _worker_and_gateway(tmp_path: Path, repo: Path, *worker_args: str) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """A `sluice worker` of `repo` and a `sluice gateway` in front of it, not waited for: (gateway url, processes)."""
    address, port = f"ipc://{tmp_path}/worker.sock", free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with (tmp_path / "worker.log").open("wb") as worker_log, (tmp_path / "gateway.log").open("wb") as gateway_log:
        processes = [
            subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--bind", address, "--models", str(repo),
                              *worker_args], stdout=worker_log, stderr=subprocess.STDOUT, env=env),
            subprocess.Popen([sys.executable, "-m", "sluice", "gateway", "--worker", address, "--port", str(port)],
                             stdout=gateway_log, stderr=subprocess.STDOUT, env=env),
        ]
    return f"http://127.0.0.1:{port}", processes


def test_a_worker_loads_its_models_two_at_once_each_served_when_ready(tmp_path):
    repo = tmp_path / "models"
    gate_a, gate_b = tmp_path / "gate-a", tmp_path / "gate-b"
    add_gated_version(repo / "a", "1", gate_a)  # loaded first: one at a time, b would wait for it
    add_gated_version(repo / "b", "1", gate_b)
    url, processes = _worker_and_gateway(tmp_path, repo)
    try:
        # both loads under way at once, both reported LOADING at the same moment
        eventually(lambda: (tmp_path / "gate-a.started").exists() and (tmp_path / "gate-b.started").exists(),
                   "both models' loads started while neither had finished", 60)
        eventually(lambda: _index(url) == {("a", "1"): ("LOADING", ""), ("b", "1"): ("LOADING", "")},
                   "a and b reported LOADING together", 30)
        gate_b.touch()  # the second one finishes first: served while the first still loads
        eventually(lambda: httpx.post(f"{url}/v2/models/b/infer", json=X).status_code == 200, "b served", 30)
        assert _index(url) == {("a", "1"): ("LOADING", ""), ("b", "1"): ("READY", "")}
        infer = httpx.post(f"{url}/v2/models/a/infer", json=X)
        assert infer.status_code == 503 and infer.headers["retry-after"] == "1"
        assert "model 'a' is being loaded" in infer.json()["error"]
        gate_a.touch()
        eventually(lambda: httpx.post(f"{url}/v2/models/a/infer", json=X).status_code == 200, "a served", 30)
        assert httpx.get(f"{url}/v2/health/ready").json() == {"ready": True}
    finally:
        gate_a.touch()
        gate_b.touch()
        stop_all(processes)


def test_a_load_concurrency_of_one_loads_the_versions_one_after_another(tmp_path):
    repo = tmp_path / "models"
    gate_a, gate_b = tmp_path / "gate-a", tmp_path / "gate-b"
    add_gated_version(repo / "a", "1", gate_a)
    add_gated_version(repo / "b", "1", gate_b)
    gate_b.touch()  # b loads at once when its turn comes
    url, processes = _worker_and_gateway(tmp_path, repo, "--load-concurrency", "1")
    try:
        eventually(lambda: (tmp_path / "gate-a.started").exists(), "a's load started", 60)
        eventually(lambda: _index(url) == {("a", "1"): ("LOADING", ""), ("b", "1"): ("LOADING", "")},
                   "a and b reported LOADING", 30)
        assert not (tmp_path / "gate-b.started").exists()  # b waits for a's load to end
        gate_a.touch()
        eventually(lambda: _index(url) == {("a", "1"): ("READY", ""), ("b", "1"): ("READY", "")}, "both ready", 30)
    finally:
        gate_a.touch()
        stop_all(processes)


def test_the_versions_a_worker_starts_with_are_kept_within_its_memory_budget(make_server, tmp_path):
    repo = write_emulated_model(tmp_path / "models", alpha_ms=1.0, beta_ms=0.1)
    gate = tmp_path / "gate"
    gate.touch()
    for version in ("1", "2"):  # about 0.6 MB each: one fits in the budget, not both
        add_gated_version(repo / "big", version, gate, blob_bytes=600 * 1024)
    server = make_server(repo, "--model-memory-mb", "1")  # ready: the version that does not fit is refused
    index = _index(server.url)
    assert index[("emulated", "1")] == ("READY", "") and index[("big", "2")] == ("READY", "")  # the newest first
    state, reason = index[("big", "1")]
    assert state == "UNAVAILABLE"
    assert reason.startswith("not loaded at start: it takes about 0.6 MB and the versions loaded before it")
    assert "of the worker's 1.0 MB model memory budget (--model-memory-mb)" in reason
    refused = httpx.post(f"{server.url}/v2/models/big/versions/1/infer", json=X)
    assert refused.status_code == 404 and "not loaded at start" in refused.json()["error"]
    assert httpx.post(f"{server.url}/v2/models/big/infer", json=X).json()["model_version"] == "2"
    assert "not loading big v1: not loaded at start" in server.log()
    assert httpx.get(f"{server.url}/v2/models/big/ready").status_code == 200


def test_a_load_that_hangs_is_given_up_after_its_timeout_and_the_others_load(tmp_path):
    repo = tmp_path / "models"
    stuck_gate = tmp_path / "stuck-gate"
    add_gated_version(repo / "stuck", "1", stuck_gate, loading="timeout_s = 1")  # before the others: loaded first
    write_emulated_model(repo, alpha_ms=1.0, beta_ms=0.1)
    server = start_server(repo, tmp_path, ready_timeout_s=60)  # ready: the hung model is refused, not waited for
    try:
        state, reason = _index(server.url)[("stuck", "1")]
        assert state == "UNAVAILABLE" and "did not finish within 1 s ([loading] timeout_s" in reason
        assert httpx.post(f"{server.url}/v2/models/emulated/infer", json=ROW).status_code == 200
        infer = httpx.post(f"{server.url}/v2/models/stuck/infer", json=X)
        assert infer.status_code == 404 and "did not finish within 1 s" in infer.json()["error"]
        # its thread still runs (it cannot be stopped): loading it again is refused, saying so
        again = httpx.post(f"{server.url}/v2/repository/models/stuck/load", timeout=60)
        assert again.status_code == 400 and "still running on the worker" in again.json()["error"]

        stuck_gate.touch()  # the hung load ends: what it loaded is dropped, not served
        eventually(lambda: "finished loading" in server.log() and "dropped" in server.log(), "the late load dropped")
        late = httpx.get(f"{server.url}/v2/models/stuck/ready")  # still refused, for the reason it was
        assert late.status_code == 404 and "did not finish within 1 s" in late.json()["error"]
        loaded = httpx.post(f"{server.url}/v2/repository/models/stuck/load", timeout=60)
        assert loaded.json() == {"name": "stuck", "versions": ["1"]}
        assert httpx.post(f"{server.url}/v2/models/stuck/infer", json=X).status_code == 200
    finally:
        stuck_gate.touch()
        assert server.stop() == 0


def test_a_worker_exits_when_asked_although_a_load_given_up_on_still_runs(tmp_path):
    repo = tmp_path / "models"
    add_gated_version(repo / "stuck", "1", tmp_path / "never", loading="timeout_s = 1")
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--bind", f"ipc://{tmp_path}/w.sock",
                                   "--models", str(repo)], stdout=log, stderr=subprocess.STDOUT)
    try:
        eventually(lambda: "giving up loading stuck v1" in log_path.read_text(), "the load given up on", 60)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0  # the hung load's thread does not hold the exit up
    finally:
        stop_all([worker])


def test_loads_at_once_within_a_memory_budget_cannot_overfill_it(make_server, tmp_path):
    repo = write_emulated_model(tmp_path / "models", alpha_ms=1.0, beta_ms=0.1)
    server = make_server(repo, "--model-memory-mb", "1")
    gate = tmp_path / "gate"
    for name in ("big-a", "big-b"):  # about 0.6 MB each: one fits in the budget, not both
        add_gated_version(repo / name, "1", gate, blob_bytes=600 * 1024)

    def load(name: str) -> httpx.Response:
        return httpx.post(f"{server.url}/v2/repository/models/{name}/load", timeout=120)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        loads = [pool.submit(load, name) for name in ("big-a", "big-b")]
        eventually(lambda: (tmp_path / "gate.started").exists(), "a load started")
        gate.touch()
        answers = [future.result() for future in loads]
    assert sorted(answer.status_code for answer in answers) == [200, 400]
    refused = next(answer for answer in answers if answer.status_code == 400).json()["error"]
    assert "budget" in refused
    ready = [name for name in ("big-a", "big-b")
             if httpx.get(f"{server.url}/v2/models/{name}/ready").status_code == 200]
    assert len(ready) == 1


def test_a_version_removed_from_the_repository_is_forgotten_once_its_worker_restarts(make_server, tmp_path):
    repo = write_two_versions(tmp_path / "models")
    write_emulated_model(repo, name="other", alpha_ms=1.0, beta_ms=0.1)
    server = make_server(repo)
    assert httpx.post(f"{server.url}/v2/models/emulated/versions/2/infer", json=ROW).status_code == 200
    shutil.rmtree(repo / "emulated" / "2")
    shutil.rmtree(repo / "other")
    (worker,) = server.worker_pids()
    os.kill(worker, signal.SIGKILL)  # restarted by the supervisor, with the repository as it is now
    eventually(lambda: server.worker_pids() not in ([], [worker]) and
               httpx.get(f"{server.url}/v2/models/emulated/versions/1/ready").status_code == 200,
               "the restarted worker serving version 1", 60)
    eventually(lambda: httpx.post(f"{server.url}/v2/models/emulated/versions/2/infer", json=ROW).status_code == 404,
               "version 2 answered 404 (not 503 forever)", 10)
    assert "has no version '2'" in httpx.post(f"{server.url}/v2/models/emulated/versions/2/infer",
                                              json=ROW).json()["error"]
    assert httpx.post(f"{server.url}/v2/models/other/infer", json=ROW).status_code == 404
    index = _index(server.url)
    assert ("emulated", "2") not in index and ("other", "1") not in index
    assert httpx.get(f"{server.url}/v2/health/ready").json() == {"ready": True}
