"""Cluster mode end to end: two `sluice gateway`s and a `sluice worker` that find each other in a
real Redis. Sharing one PostgreSQL job store, a batch job submitted through one gateway is run by
both gateways' executors, each item exactly once, and read back through the other; online
requests go through either. The second gateway is configured only through the environment
(`SLUICE_GATEWAY_*`), as a Kubernetes Secret would set it. Traffic splits and canaries set
through one gateway apply on both; a canary whose gateway dies is rolled back by the other."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tests.conftest import (
    eventually,
    free_port,
    metric_total,
    stop_all,
    write_emulated_model,
    write_tiny_lm_model,
    write_two_versions,
)

pytestmark = pytest.mark.slow

ITEMS = 4000


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready").status_code == 200
    except httpx.HTTPError:
        return False


def _items_done(url: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
               if line.startswith('sluice_batch_items_total{outcome="ok"}'))


def test_two_gateways_share_workers_and_jobs(tmp_path: Path, redis_url: str, postgres_dsn: str) -> None:
    registry = redis_url.rsplit("/", 1)[0] + "/7"
    redis.Redis.from_url(registry).flushdb()
    repo = write_emulated_model(tmp_path / "models", alpha_ms=2, beta_ms=0.1)
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    worker_address = f"tcp://127.0.0.1:{free_port()}"
    processes = [
        subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--id", "w0", "--bind", worker_address,
                          "--models", str(repo), "--registry", registry]),
        subprocess.Popen([sys.executable, "-m", "sluice", "gateway", "--registry", registry, "--port", str(ports[0]),
                          "--jobs-db", postgres_dsn]),
        subprocess.Popen([sys.executable, "-m", "sluice", "gateway"],
                         env={**os.environ, "SLUICE_GATEWAY_REGISTRY": registry, "SLUICE_GATEWAY_PORT": str(ports[1]),
                              "SLUICE_GATEWAY_JOBS_DB": postgres_dsn}),
    ]
    try:
        deadline = time.monotonic() + 90
        while not all(_ready(url) for url in urls):
            assert time.monotonic() < deadline, "the gateways did not become ready"
            assert all(p.poll() is None for p in processes), [p.returncode for p in processes]
            time.sleep(0.2)
        for url in urls:  # online requests through either gateway reach the registered worker
            body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}
            assert httpx.post(f"{url}/v2/models/emulated/infer", json=body).json()["outputs"][0]["data"] == [3.0]

        lines = [{"custom_id": f"item-{i}", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "emulated", "input": "x" * (1 + i % 7)}} for i in range(ITEMS)]
        content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        first, second = (openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) for url in urls)
        uploaded = first.files.create(file=("in.jsonl", content), purpose="batch")
        batch = first.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")

        deadline = time.monotonic() + 120
        while (seen := second.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, seen
            time.sleep(0.2)
        assert seen.status == "completed", seen
        assert seen.request_counts.completed == ITEMS and seen.request_counts.failed == 0
        assert seen.output_file_id is not None
        rows = [json.loads(line) for line in second.files.content(seen.output_file_id).content.splitlines()]
        assert [row["custom_id"] for row in rows] == [f"item-{i}" for i in range(ITEMS)]
        assert all(row["response"]["status_code"] == 200 for row in rows)

        done = [_items_done(url) for url in urls]  # each item ran once, and both executors took part
        assert sum(done) == ITEMS, done
        assert min(done) > 0, done
    finally:
        stop_all(processes)


def _state(client: httpx.Client, url: str) -> dict:
    return client.get(f"{url}/admin/models/emulated").json()


def _versions_served(client: httpx.Client, url: str, n: int = 20) -> set[str]:
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}
    return {client.post(f"{url}/v2/models/emulated/infer", json=body, headers={"Cache-Control": "no-store"}
                        ).json()["model_version"] for _ in range(n)}


follows = functools.partial(eventually, timeout_s=10.0)  # gateways read the shared state every 0.5 s


def test_gateways_share_traffic_splits_and_canaries(tmp_path: Path, redis_url: str) -> None:
    registry = redis_url.rsplit("/", 1)[0] + "/9"
    redis.Redis.from_url(registry).flushdb()
    repo = write_two_versions(tmp_path / "models")
    ports = [free_port(), free_port()]
    a, b = (f"http://127.0.0.1:{port}" for port in ports)
    processes = [subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--bind",
                                   f"tcp://127.0.0.1:{free_port()}", "--models", str(repo), "--registry", registry])]
    processes += [subprocess.Popen([sys.executable, "-m", "sluice", "gateway", "--registry", registry,
                                    "--port", str(port)]) for port in ports]
    try:
        eventually(lambda: _ready(a) and _ready(b), "the gateways", timeout_s=90)
        with httpx.Client(timeout=30) as client:
            assert _versions_served(client, b) == {"2"}  # the newest, with no split set anywhere
            moved = client.put(f"{a}/admin/models/emulated/traffic", json={"traffic": {"1": 100}})
            assert moved.status_code == 200, moved.text
            follows(lambda: _state(client, b)["split_source"] == "operator", "gateway b to follow the split")
            assert _versions_served(client, b) == {"1"}

            started = client.post(f"{b}/admin/models/emulated/canary",
                                  json={"version": "2", "steps": [50], "step_seconds": 600})
            assert started.status_code == 201, started.text
            follows(lambda: _state(client, a)["split_source"] == "canary", "gateway a to follow the canary")
            followed = _state(client, a)
            assert followed["canary"]["version"] == "2" and followed["canary"]["owner"]
            assert {v["version"]: v["traffic_percent"] for v in followed["versions"]} == {"1": 50.0, "2": 50.0}
            assert _versions_served(client, a, 60) == {"1", "2"}
            again = client.post(f"{a}/admin/models/emulated/canary", json={"version": "2"})
            assert again.status_code == 409 and "already running on gateway" in again.text

            rolled_back = client.post(f"{a}/admin/models/emulated/rollback")  # handed to gateway b, which runs it
            assert rolled_back.status_code == 200, rolled_back.text
            assert rolled_back.json()["split_source"] == "canary result"
            assert _state(client, b)["canary"]["status"] == "rolled_back"
            assert _versions_served(client, a) == _versions_served(client, b) == {"1"}

            started = client.post(f"{a}/admin/models/emulated/canary", json={"version": "2", "steps": [50]})
            assert started.status_code == 201, started.text
            follows(lambda: _state(client, b)["split_source"] == "canary", "gateway b to follow a's canary")
            processes[1].kill()  # gateway a dies while its canary runs
            follows(lambda: _state(client, b)["split_source"] == "rollback", "the orphaned canary's rollback")
            assert _versions_served(client, b) == {"1"}
    finally:
        stop_all(processes)


def test_a_background_response_is_cancelled_through_the_other_gateway(tmp_path: Path, redis_url: str,
                                                                      postgres_dsn: str) -> None:
    """Gateway a runs it; b reads it while it runs and cancels it; a stops its generation at its
    next lease renewal (every second), before it would have finished, and writes no answer."""
    registry = redis_url.rsplit("/", 1)[0] + "/10"
    redis.Redis.from_url(registry).flushdb()
    repo = write_tiny_lm_model(tmp_path / "models", "tiny")
    worker_metrics = free_port()
    ports = [free_port(), free_port()]
    a, b = (f"http://127.0.0.1:{port}" for port in ports)
    processes = [subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--bind", f"tcp://127.0.0.1:{free_port()}",
                                   "--models", str(repo), "--registry", registry,
                                   "--metrics-port", str(worker_metrics)],
                                  env={**os.environ, "SLUICE_CACHE_DIR": str(tmp_path / "cache")})]
    processes += [subprocess.Popen([sys.executable, "-m", "sluice", "gateway", "--registry", registry,
                                    "--port", str(port), "--jobs-db", postgres_dsn]) for port in ports]

    def running() -> float:
        return metric_total(f"http://127.0.0.1:{worker_metrics}", "vllm:num_requests_running")

    try:
        eventually(lambda: _ready(a) and _ready(b), "the gateways", timeout_s=90)
        first, second = (openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) for url in (a, b))
        eventually(lambda: httpx.get(f"http://127.0.0.1:{worker_metrics}/metrics").status_code == 200,
                   "the worker's metrics endpoint", timeout_s=30)
        queued = first.responses.create(model="tiny", input="Tell me a long story", max_output_tokens=900,
                                        temperature=0, background=True)  # greedy: never an early end of text
        eventually(lambda: second.responses.retrieve(queued.id).status == "in_progress",
                   "gateway b to see the response in progress", timeout_s=30)
        eventually(lambda: running() == 1, "the background response to be generating", timeout_s=30)
        assert second.responses.cancel(queued.id).status == "cancelled"
        eventually(lambda: running() == 0, "gateway a to stop the cancelled generation", timeout_s=20)
        eventually(lambda: metric_total(a, "sluice_requests_total", model="tiny", outcome="cancelled") == 1,
                   "gateway a to count the generation withdrawn")
        assert metric_total(a, "sluice_requests_total", model="tiny", outcome="ok") == 0, "not finished"
        time.sleep(0.5)
        assert first.responses.retrieve(queued.id).status == "cancelled"
    finally:
        stop_all(processes)
