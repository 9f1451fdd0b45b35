"""`sluice top`: reading an exposition, the arithmetic on two scrapes, and the command against a real
server under load."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sluice.exposition import Scrape, histogram_quantile
from sluice.top import view
from tests.conftest import free_port


def test_histogram_quantile_interpolates_within_the_bucket_it_falls_in():
    buckets = {0.01: 10.0, 0.02: 30.0, 0.05: 40.0, math.inf: 40.0}
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.01)
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.015)  # rank 20: halfway through (0.01, 0.02]
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.004)  # first bucket starts at 0
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.02 + 0.03 * 9.6 / 10)


def test_histogram_quantile_beyond_the_last_bound_and_without_observations():
    assert histogram_quantile(0.99, {0.1: 1.0, math.inf: 10.0}) == 0.1
    assert histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.5, {}) is None


class _Server:
    """The series `sluice top` reads, in a registry of their own, as a server would expose them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("sluice_requests", "", ["model", "version", "outcome"], registry=r)
        self.duration = Histogram("sluice_request_duration_seconds", "", ["model", "version", "outcome"],
                                  buckets=(0.01, 0.02, 0.05, 0.1), registry=r)
        self.batch = Histogram("sluice_batch_size", "", ["model", "version"], buckets=(1, 4, 16, 32), registry=r)
        self.execution = Histogram("sluice_batch_execution_seconds", "", ["model", "version"], registry=r)
        self.busy = Counter("sluice_device_busy_seconds", "", ["worker"], registry=r)
        self.depth = Gauge("sluice_queue_depth", "", ["model", "version"], registry=r)
        self.lookups = Counter("sluice_cache_lookups", "", ["model", "result"], registry=r)
        self.share = Gauge("sluice_traffic_share", "", ["model", "version"], registry=r)
        self.admitted = Counter("sluice_tenant_admitted", "", ["tenant", "class"], registry=r)
        self.rejected = Counter("sluice_tenant_rejected", "", ["tenant", "class", "reason"], registry=r)
        self.device = Counter("sluice_tenant_device_seconds", "", ["tenant", "class"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "", ["model_name"], registry=r)
        self.output = Counter("sluice_generation_tokens", "", ["model"], registry=r)
        self.ttft = Histogram("sluice_time_to_first_token_seconds", "", ["model"], buckets=(0.1, 1.0), registry=r)

    def scrape(self, at_s: float) -> Scrape:
        return Scrape.parse(generate_latest(self.registry).decode(), at_s)


def test_a_view_is_what_happened_between_the_two_scrapes():
    server = _Server()
    server.requests.labels("emulated", "1", "ok").inc(1000)  # before the interval: not counted
    server.batch.labels("emulated", "1").observe(1)
    server.device.labels("a", "standard").inc(50)
    before = server.scrape(10.0)
    for _ in range(40):
        server.requests.labels("emulated", "1", "ok").inc()
        server.duration.labels("emulated", "1", "ok").observe(0.015)
    server.requests.labels("emulated", "1", "rejected").inc(8)
    server.requests.labels("emulated", "1", "unavailable").inc(2)
    for size in (8, 12):
        server.batch.labels("emulated", "1").observe(size)
        server.execution.labels("emulated", "1").observe(0.012)
    server.busy.labels("0").inc(1.5)
    server.depth.labels("emulated", "1").set(3)
    server.lookups.labels("emulated", "hit").inc(10)
    server.lookups.labels("emulated", "miss").inc(30)
    server.share.labels("emulated", "1").set(0.9)
    server.admitted.labels("a", "standard").inc(30)
    server.admitted.labels("b", "batch").inc(10)
    server.rejected.labels("b", "batch", "overloaded").inc(4)
    server.device.labels("a", "standard").inc(0.5)
    server.device.labels("b", "batch").inc(1.5)
    server.running.labels("tiny").set(5)
    server.output.labels("tiny").inc(400)
    server.ttft.labels("tiny").observe(0.5)
    now = view(before, server.scrape(12.0))

    assert now.seconds == 2.0
    assert now.busy_by_worker == {"0": 0.75}
    (row,) = now.models
    assert (row.model, row.version) == ("emulated", "1")
    assert (row.ok_per_s, row.refused_per_s, row.failed_per_s, row.expired_per_s) == (20.0, 4.0, 1.0, 0.0)
    assert 10 < row.p50_ms < 20 and 10 < row.p99_ms <= 20  # every answer took 15 ms: bucket (10, 20]
    assert row.batches_per_s == 1.0 and row.mean_batch == 10.0 and row.batch_ms == pytest.approx(12.0)
    assert row.queued == 3 and row.cache_hit == 0.25 and row.traffic_share == 0.9
    by_tenant = {(t.tenant, t.priority_class): t for t in now.tenants}
    assert by_tenant["a", "standard"].admitted_per_s == 15.0 and by_tenant["a", "standard"].refused_per_s == {}
    assert by_tenant["b", "batch"].refused_per_s == {"overloaded": 2.0}
    assert by_tenant["a", "standard"].device_share == 0.25 and by_tenant["b", "batch"].device_share == 0.75
    (generation,) = now.generation
    assert generation.model == "tiny" and generation.running == 5 and generation.output_tokens_per_s == 200.0
    assert 100 < generation.ttft_p50_ms < 1000


def test_internal_errors_are_shown_as_failures():
    """Answers counted as outcome `error` (a 500) were in no column of `sluice top`."""
    server = _Server()
    server.requests.labels("emulated", "1", "ok").inc()
    before = server.scrape(10.0)
    server.requests.labels("emulated", "1", "error").inc(6)
    server.requests.labels("emulated", "1", "failed").inc(2)
    (row,) = view(before, server.scrape(12.0)).models
    assert row.failed_per_s == 4.0


def test_a_clusters_gateway_shows_no_batches_or_queues_rather_than_zeros():
    """A cluster's gateway exports no worker's series (each worker has them on its own metrics
    port): its batches and queues are unknown there, shown as "-" with a line saying where they
    are, where they read 0.0 batches/s and 0 queued while the workers batched 400 requests a second."""
    from rich.console import Console

    from sluice.top import render

    server = _Server()
    before = server.scrape(0.0)
    server.requests.labels("emulated", "1", "ok").inc(800)
    now = view(before, server.scrape(2.0))
    (row,) = now.models
    assert row.ok_per_s == 400.0
    assert (row.batches_per_s, row.queued, row.queued_work_ms) == (None, None, None)
    console = Console(width=200, record=True)
    console.print(render("http://gateway", now))
    text = console.export_text()
    assert "no worker series here" in text and "--metrics-port" in text
    (line,) = [line for line in text.splitlines() if line.startswith("emulated v1")]
    assert line.split()[-6:-1] == ["-"] * 5, text  # batches/s, mean batch, batch ms, queued, queued ms


def test_a_restarted_server_counts_from_zero_not_backwards():
    server = _Server()
    server.requests.labels("emulated", "1", "ok").inc(500)
    before = server.scrape(0.0)
    restarted = _Server()
    restarted.requests.labels("emulated", "1", "ok").inc(6)
    assert view(before, restarted.scrape(2.0)).models[0].ok_per_s == 3.0


def _offer(url: str, seconds: float, concurrency: int) -> Callable[[], int]:
    """Keep `concurrency` requests in flight for `seconds`; returns a join giving the answers' count."""
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": list(range(16))}]}
    done: list[int] = []

    def client() -> None:
        answered = 0
        with httpx.Client(base_url=url, timeout=10, headers={"cache-control": "no-cache"}) as http:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                answered += http.post("/v2/models/emulated/infer", json=body).status_code == 200
        done.append(answered)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()

    def join() -> int:
        for thread in threads:
            thread.join()
        return sum(done)

    return join


def top_once(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`sluice top --once` of the server at `url`, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "sluice", "top", "--url", url, "--once", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_sluice_top_shows_requests_being_batched_on_a_real_server(make_server, emulated_repo):
    server = make_server(emulated_repo(alpha_ms=20.0, beta_ms=0.5))
    join = _offer(server.url, seconds=4.0, concurrency=16)
    time.sleep(1.0)
    shown = top_once(server.url, "--json", "--interval", "2")
    answered = join()
    assert shown.returncode == 0, shown.stderr
    now = json.loads(shown.stdout)
    (row,) = now["models"]
    assert row["model"] == "emulated" and row["ok_per_s"] > 0 and answered > 0
    assert row["mean_batch"] > 4  # 16 clients, 20 ms a batch: they share batches
    assert row["p50_ms"] is not None and row["p50_ms"] >= 20
    assert row["refused_per_s"] == 0 and row["failed_per_s"] == 0
    assert now["busy_by_worker"]["0"] > 0.5 and now["workers_ready"] == 1

    table = top_once(server.url, "--interval", "0.5")
    assert table.returncode == 0
    assert "emulated v1" in table.stdout and "mean" in table.stdout and "batch" in table.stdout


@pytest.mark.slow
def test_sluice_top_says_why_when_it_cannot_read_the_server():
    shown = top_once(f"http://127.0.0.1:{free_port()}", "--interval", "0.1")
    assert shown.returncode == 1 and "cannot reach http://127.0.0.1:" in shown.stderr


def test_live_sluice_top_exits_saying_why_when_its_first_reading_fails_rather_than_retrying_forever():
    """Nothing was ever read there (no server, a wrong URL): waiting cannot help. As typed, with
    no --once (stdout is a pipe here, so rich draws no live screen)."""
    url = f"http://127.0.0.1:{free_port()}"
    run = subprocess.run([sys.executable, "-m", "sluice", "top", "--url", url, "--interval", "0.1"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert f"Error: cannot reach {url}: " in run.stderr
