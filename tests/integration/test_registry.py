"""Cluster mode with the worker registry: `sluice worker --registry` and `sluice gateway --registry`
find each other through a real Redis; a worker that joins gets traffic, one that drains leaves
without failing a request."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from sluice.registry import PREFIX
from tests.conftest import eventually, free_port, stop_all, wait_workers_ready, write_emulated_model

pytestmark = pytest.mark.slow

BODY = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}


def _workers_ready(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("sluice_workers_ready"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_workers_join_and_leave_a_gateway_through_the_registry(tmp_path: Path, redis_url: str) -> None:
    registry = redis_url.rsplit("/", 1)[0] + "/6"
    redis.Redis.from_url(registry).flushdb()
    repo = write_emulated_model(tmp_path / "models", alpha_ms=2, beta_ms=0.1)
    processes: list[subprocess.Popen[bytes]] = []

    def worker(name: str) -> tuple[subprocess.Popen[bytes], str]:
        address = f"tcp://127.0.0.1:{free_port()}"
        process = subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--id", name, "--bind", address,
                                    "--models", str(repo), "--registry", registry])
        processes.append(process)
        return process, address

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        first, _ = worker("a")
        processes.append(subprocess.Popen([sys.executable, "-m", "sluice", "gateway", "--registry", registry,
                                           "--port", str(port)]))
        eventually(lambda: httpx.get(f"{url}/v2/health/ready").status_code == 200, "the gateway to be ready",
                   timeout_s=60.0)
        assert httpx.post(f"{url}/v2/models/emulated/infer", json=BODY).json()["outputs"][0]["data"] == [3.0]

        _, second_address = worker("b")
        # joined and serving: a worker registers once it listens and loads its models after, and
        # one still loading cannot take the requests of the worker that leaves
        wait_workers_ready(url, 2, model="emulated")

        statuses: list[int] = []
        failures: list[str] = []

        def send(offset: int) -> None:
            with httpx.Client(timeout=30) as client:
                for i in range(100):
                    body = {"inputs": [{**BODY["inputs"][0], "data": [float(offset + i), 1.0]}]}  # type: ignore[dict-item]
                    response = client.post(f"{url}/v2/models/emulated/infer", json=body)
                    statuses.append(response.status_code)
                    if response.status_code != 200:
                        failures.append(response.text)

        senders = [threading.Thread(target=send, args=(1000 * n,)) for n in range(4)]  # requests in flight
        for sender in senders:
            sender.start()
        time.sleep(0.3)
        first.send_signal(signal.SIGTERM)  # drains: leaves the registry, finishes its work, exits
        assert first.wait(timeout=30) == 0
        for sender in senders:
            sender.join()
        assert statuses == [200] * 400, failures  # nothing failed while the worker left
        keys = {key.decode() for key in redis.Redis.from_url(registry).keys(PREFIX + "*")}
        assert keys == {PREFIX + second_address}
        eventually(lambda: _workers_ready(url) == 1, "the gateway to drop the worker that left", timeout_s=60.0)
        assert httpx.post(f"{url}/v2/models/emulated/infer", json=BODY).status_code == 200
    finally:
        stop_all(processes)


def test_a_worker_the_registry_forgets_while_it_serves_keeps_serving(tmp_path: Path, redis_url: str) -> None:
    """Redis restarted without its data (or flushed) forgets every worker until each registers
    again (within 2 s): the gateway keeps a worker it still hears serving, where it used to drop
    it and answer 404 "model does not exist" meanwhile. The worker's entry is written here by hand
    (the worker itself does not register), so that it stays gone as long as the test wants; once
    the worker drains, the gateway lets it go."""
    registry = redis_url.rsplit("/", 1)[0] + "/11"
    client = redis.Redis.from_url(registry)
    client.flushdb()
    repo = write_emulated_model(tmp_path / "models", alpha_ms=2, beta_ms=0.1)
    address = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    worker = subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--id", "a", "--bind", address,
                               "--models", str(repo)])
    processes = [worker, subprocess.Popen([sys.executable, "-m", "sluice", "gateway", "--registry", registry,
                                           "--port", str(port)])]
    try:
        client.set(PREFIX + address, "a")
        eventually(lambda: httpx.get(f"{url}/v2/health/ready").status_code == 200, "the gateway to be ready",
                   timeout_s=60.0)
        client.flushdb()  # what a Redis restarted without persistence holds
        for _ in range(12):  # the gateway reads the registry every second
            time.sleep(0.25)
            assert _workers_ready(url) == 1
            response = httpx.post(f"{url}/v2/models/emulated/infer", json=BODY)
            assert response.status_code == 200, response.text
        worker.send_signal(signal.SIGTERM)  # draining and gone from the registry: it leaves
        assert worker.wait(timeout=30) == 0
        eventually(lambda: _workers_ready(url) == 0, "the gateway to drop the worker that drained", timeout_s=30.0)
    finally:
        stop_all(processes)


def test_a_gateway_whose_registry_cannot_be_reached_at_start_says_so() -> None:
    """Like the Redis of shared limits: an error naming the registry (its password left out) and
    exit status 1, where it used to be a traceback, "Application startup failed" and status 3."""
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        url = f"redis://:secret@127.0.0.1:{closed.getsockname()[1]}/0"
        done = subprocess.run([sys.executable, "-m", "sluice", "gateway", "--registry", url, "--port", "0"],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "Error: cannot reach the worker registry at redis://:***@127.0.0.1:" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "secret" not in done.stderr, done.stderr


def _index_states(url: str) -> dict[str, str]:
    return {entry["name"]: entry.get("state", "") for entry in httpx.post(f"{url}/v2/repository/index", json={}).json()}


def test_a_model_without_a_worker_for_now_is_503_not_404(tmp_path: Path, redis_url: str) -> None:
    """A gateway started before any worker, and one whose only worker left (a rolling restart):
    the model is 503 with Retry-After (which the openai SDK retries), where it was 404 "model does
    not exist" (which it does not)."""
    registry = redis_url.rsplit("/", 1)[0] + "/12"
    redis.Redis.from_url(registry).flushdb()
    repo = write_emulated_model(tmp_path / "models", alpha_ms=2, beta_ms=0.1)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    processes = [subprocess.Popen([sys.executable, "-m", "sluice", "gateway", "--registry", registry,
                                   "--port", str(port)])]
    try:
        eventually(lambda: httpx.get(f"{url}/v2/health/live").status_code == 200, "the gateway to listen",
                   timeout_s=60.0)
        before = httpx.post(f"{url}/v2/models/emulated/infer", json=BODY)
        assert before.status_code == 503 and before.headers["retry-after"] == "1", before.text
        worker = subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--bind",
                                   f"tcp://127.0.0.1:{free_port()}", "--models", str(repo), "--registry", registry])
        processes.append(worker)
        eventually(lambda: httpx.get(f"{url}/v2/health/ready").status_code == 200, "the worker to join",
                   timeout_s=60.0)
        assert httpx.post(f"{url}/v2/models/emulated/infer", json=BODY).status_code == 200
        missing = httpx.post(f"{url}/v2/models/nonesuch/infer", json=BODY)
        assert missing.status_code == 404, missing.text  # a model no worker ever served is still unknown
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
        # the gateway has dropped the worker: the model is no longer one a connection knows
        eventually(lambda: _index_states(url).get("emulated") in (None, "LOADING"), "the worker to be dropped",
                   timeout_s=30.0)
        after = httpx.post(f"{url}/v2/models/emulated/infer", json=BODY)
        assert after.status_code == 503 and "retry-after" in after.headers, after.text
        assert _index_states(url) == {"emulated": "LOADING"}
    finally:
        stop_all(processes)


def test_a_worker_named_with_worker_and_found_in_the_registry_is_connected_once(tmp_path: Path,
                                                                                redis_url: str) -> None:
    """`sluice gateway --worker ADDR --registry ...` where ADDR also registers (a cluster moving
    from named workers to the registry): one worker, where the gateway connected to it twice and
    counted, routed and reported it as two (`sluice_workers_ready` 2, Triton's instance count 2)."""
    registry = redis_url.rsplit("/", 1)[0] + "/13"
    redis.Redis.from_url(registry).flushdb()
    repo = write_emulated_model(tmp_path / "models", alpha_ms=2, beta_ms=0.1)
    address = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    processes = [subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--id", "a", "--bind", address,
                                   "--models", str(repo), "--registry", registry])]
    try:
        eventually(lambda: redis.Redis.from_url(registry).get(PREFIX + address) is not None,
                   "the worker to register", timeout_s=60.0)
        processes.append(subprocess.Popen([sys.executable, "-m", "sluice", "gateway", "--worker", address,
                                           "--registry", registry, "--port", str(port)]))
        eventually(lambda: httpx.get(f"{url}/v2/health/ready").status_code == 200, "the gateway to be ready",
                   timeout_s=60.0)
        time.sleep(1.5)  # the registry is read at start and every second after
        assert _workers_ready(url) == 1
        config = httpx.get(f"{url}/v2/models/emulated/config").json()
        assert config["instance_group"][0]["count"] == 1, config
        assert httpx.post(f"{url}/v2/models/emulated/infer", json=BODY).status_code == 200
    finally:
        stop_all(processes)


def test_the_gateways_banner_counts_the_workers_it_found_in_the_registry(tmp_path: Path, redis_url: str) -> None:
    registry = redis_url.rsplit("/", 1)[0] + "/7"
    redis.Redis.from_url(registry).flushdb()
    repo = write_emulated_model(tmp_path / "models", alpha_ms=2, beta_ms=0.1)
    processes = [subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--id", name, "--bind",
                                   f"tcp://127.0.0.1:{free_port()}", "--models", str(repo), "--registry", registry])
                 for name in ("a", "b")]
    log_path = tmp_path / "gateway.log"
    try:
        eventually(lambda: len(redis.Redis.from_url(registry).keys(f"{PREFIX}*")) >= 2, "both workers to register",
                   timeout_s=60.0)
        processes.append(subprocess.Popen([sys.executable, "-m", "sluice", "gateway", "--registry", registry,
                                           "--port", str(free_port())], stdout=log_path.open("wb"),
                                          stderr=subprocess.STDOUT))
        eventually(lambda: "listening on" in log_path.read_text(), "the banner", timeout_s=60.0)
        [line] = [line for line in log_path.read_text().splitlines() if "listening on" in line]
        assert "with 2 worker(s) on those registered in redis://" in line, line
    finally:
        stop_all(processes)
