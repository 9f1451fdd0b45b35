"""Cluster mode end to end: two `sluice gateway`s and a `sluice worker` that find each other in a
real Redis, sharing one PostgreSQL job store. A batch job submitted through one gateway is run by
both gateways' executors, each item exactly once, and read back through the other; online
requests go through either. The second gateway is configured only through the environment
(`SLUICE_GATEWAY_*`), as a Kubernetes Secret would set it."""

from __future__ import annotations

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

from tests.conftest import free_port, stop_all, write_emulated_model

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
