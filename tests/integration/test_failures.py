"""Worker crashes and shutdown: nothing accepted is left hanging, and service recovers."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sluice.exposition import Scrape
from tests.conftest import eventually, metric_total, wait_workers_ready, write_emulated_model

BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]}


async def _fire(url: str, count: int, spacing_s: float, timeout_s: float = 30.0) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=200)) as client:
        async def one(i: int) -> httpx.Response:
            await asyncio.sleep(i * spacing_s)
            return await client.post(f"{url}/v2/models/emulated/infer", json=BODY)

        return await asyncio.gather(*(one(i) for i in range(count)))


async def _kill_later(pid: int, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    os.kill(pid, signal.SIGKILL)


def _fire_while_killing(
    url: str, victim: int, kill_after_s: float, count: int, spacing_s: float
) -> list[httpx.Response]:
    """Send `count` requests `spacing_s` apart and SIGKILL `victim` `kill_after_s` into the stream."""

    async def scenario() -> list[httpx.Response]:
        killer = asyncio.create_task(_kill_later(victim, kill_after_s))
        responses = await _fire(url, count, spacing_s)
        await killer
        return responses

    return asyncio.run(scenario())


def _fire_while_stopping(server, count: int, stop_after_s: float) -> list[httpx.Response]:
    """Send `count` requests at once and SIGTERM the server `stop_after_s` into them."""

    async def scenario() -> list[httpx.Response]:
        async def stop_later() -> None:
            await asyncio.sleep(stop_after_s)
            server.process.send_signal(signal.SIGTERM)

        stopper = asyncio.create_task(stop_later())
        responses = await _fire(server.url, count, 0.0)
        await stopper
        return responses

    return asyncio.run(scenario())


def test_kill_9_worker_under_load_every_request_answered_and_service_recovers(make_server, tmp_path):
    repo = write_emulated_model(tmp_path / "models", slo_ms=5000, alpha_ms=20, beta_ms=1)
    server = make_server(repo, "--workers", "2")
    wait_workers_ready(server.url, 2, model="emulated")
    responses = _fire_while_killing(server.url, server.worker_pids()[0], 0.5, 300, 0.005)
    statuses = [r.status_code for r in responses]
    assert len(responses) == 300, "every request got an answer"
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= 250, "requests not yet started were re-dispatched, not failed"
    for response in responses:
        if response.status_code == 503:
            message = response.json()["error"]  # in user terms: which model, what it means, what to do
            assert message.startswith("the worker serving model 'emulated' (version 1) stopped"), message
            assert "it was not charged: retry it" in message, message
            assert "retry-after" in response.headers
    wait_workers_ready(server.url, 2, model="emulated")
    assert len(server.worker_pids()) == 2, "the supervisor restarted the killed worker"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "sluice_worker_restarts_total 1.0" in metrics
    after = asyncio.run(_fire(server.url, 20, 0.0))
    assert [r.status_code for r in after] == [200] * 20


def test_single_worker_killed_requests_wait_for_the_restart_when_their_deadline_allows(make_server, tmp_path):
    repo = write_emulated_model(tmp_path / "models", slo_ms=20000, alpha_ms=50, beta_ms=1)
    server = make_server(repo)
    responses = _fire_while_killing(server.url, server.worker_pids()[0], 0.3, 60, 0.01)
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}
    # at most the one batch that was executing is lost; the rest (queued, or arriving while the
    # worker restarted) ran on the restarted worker
    assert statuses.count(503) <= 32, collections.Counter(r.text[:80] for r in responses)
    assert statuses.count(200) >= 28
    for response in responses:
        if response.status_code == 503:
            assert "while running this request, which did not complete" in response.json()["error"]


def test_sigterm_drains_in_flight_requests_then_exits(make_server, tmp_path):
    repo = write_emulated_model(tmp_path / "models", slo_ms=10000, alpha_ms=400, beta_ms=1, max_batch_size=4)

    server = make_server(repo)

    responses = _fire_while_stopping(server, 8, 0.3)
    assert [r.status_code for r in responses] == [200] * 8, "in-flight work finished during the drain"
    assert server.process.wait(timeout=30) == 0
    try:
        httpx.get(f"{server.url}/v2/health/live", timeout=1)
        raise AssertionError("the server still accepts connections after draining")
    except httpx.ConnectError:
        pass


@contextlib.contextmanager
def _cluster(*repos: Path) -> Iterator[str]:
    """`sluice worker --bind tcp://...` for each repository (ids w0, w1, ...) and one `sluice gateway
    --worker ...` in front of them, ready; yields its URL; SIGTERMs them all after, and checks that
    each exits 0."""
    import subprocess
    import sys

    from tests.conftest import free_port

    ports, http_port = [free_port() for _ in repos], free_port()
    processes = [subprocess.Popen([sys.executable, "-m", "sluice", "worker", "--id", f"w{i}",
                                   "--bind", f"tcp://127.0.0.1:{port}", "--models", str(repo)])
                 for i, (port, repo) in enumerate(zip(ports, repos, strict=True))]
    addresses = [arg for port in ports for arg in ("--worker", f"tcp://127.0.0.1:{port}")]
    processes.insert(0, subprocess.Popen([sys.executable, "-m", "sluice", "gateway", *addresses,
                                          "--port", str(http_port)]))
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the gateway listening, then every worker ready
            with contextlib.suppress(httpx.ConnectError):
                if httpx.get(f"{url}/v2/health/ready").status_code == 200:
                    break
            time.sleep(0.1)
        wait_workers_ready(url, len(repos))
        yield url
    finally:
        for process in processes:  # the gateway first
            process.send_signal(signal.SIGTERM)
        assert [process.wait(timeout=30) for process in processes] == [0] * len(processes)


def test_gateway_in_front_of_a_separately_started_worker(tmp_path):
    """Cluster mode: `sluice worker --bind tcp://...` and `sluice gateway --worker tcp://...`."""
    with _cluster(write_emulated_model(tmp_path / "models", alpha_ms=1)) as url:
        response = httpx.post(f"{url}/v2/models/emulated/infer", json=BODY)
        assert response.status_code == 200
        assert response.json()["outputs"][0]["data"] == [16.0]


def test_a_replica_whose_device_fails_is_retried_around_then_ejected(tmp_path):
    """Two workers serve the model; one's device fails every batch (the emulator's error_rate 1).
    Every request still succeeds, sent again to the healthy replica when the broken one failed
    it, and after 5 failures in a row the broken one gets no more of the model's requests for a
    while (`router.Ejections`)."""
    broken = write_emulated_model(tmp_path / "broken", alpha_ms=1, error_rate=1.0)
    healthy = write_emulated_model(tmp_path / "healthy", alpha_ms=1)
    with _cluster(broken, healthy) as url:
        fresh = {"Cache-Control": "no-cache"}  # each one to a worker, not from the result cache
        statuses = [httpx.post(f"{url}/v2/models/emulated/infer", json=BODY, headers=fresh).status_code
                    for _ in range(60)]
        assert statuses == [200] * 60
        metrics = httpx.get(f"{url}/metrics").text
    scrape = Scrape.parse(metrics, 0.0)
    retried = sum(scrape.grouped("sluice_retried_requests_total", ()).values())
    assert 5 <= retried <= 10, retried  # the failures that ejected it (and, if the run outlasted 5 s, a few more)
    ejected = {worker: value for (worker,), value in scrape.grouped("sluice_replica_ejected", ("worker",)).items()}
    assert list(ejected) == ["0"], ejected  # the broken worker (the gateway's first), and only it, failed


def _stream_in_threads(sdk, count: int, max_tokens: int) -> tuple[list, threading.Semaphore, dict]:
    """`count` streamed completions, each in its own thread, started 50 ms apart; each releases
    the semaphore once it has two chunks. Outcomes by index: ("finished", completion tokens from
    the usage chunk) or (the error's message, chunks received)."""
    import openai

    streaming = threading.Semaphore(0)
    outcomes: dict[int, tuple[str, int]] = {}

    def stream(i: int) -> None:
        received = tokens = 0
        try:
            for chunk in sdk.completions.create(model="tiny", prompt=f"story {i}", max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}):
                received += 1
                if received == 2:
                    streaming.release()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            outcomes[i] = ("finished", tokens)
        except openai.APIError as exc:
            outcomes[i] = (exc.message, received)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    return threads, streaming, outcomes


def _tiny_sdk(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_kill_9_worker_mid_stream_ends_the_running_streams_and_reruns_the_waiting_ones(make_server, tmp_path):
    """Four streams on an engine that runs two sequences at once; the worker is killed while the
    first two stream. Those end at once with an error event (the SDK raises it) after the tokens
    they had; the two still waiting had sent nothing, so they are sent again to the restarted
    worker and stream to their end. None hangs."""
    from tests.conftest import write_tiny_lm_model

    server = make_server(write_tiny_lm_model(tmp_path / "models", max_num_seqs=2))
    threads, streaming, outcomes = _stream_in_threads(_tiny_sdk(server), 4, 300)
    assert streaming.acquire(timeout=30) and streaming.acquire(timeout=30)  # two streams under way
    os.kill(server.worker_pids()[0], signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=90)
    assert not any(thread.is_alive() for thread in threads), "a stream hung after its worker died"
    ended = sorted(outcomes.values())
    assert ended[:2] == [("finished", 300)] * 2, outcomes
    assert all(what.startswith("the worker serving model 'tiny' (version 1) stopped") and "ended early" in what
               and count >= 2 for what, count in ended[2:]), outcomes
    wait_workers_ready(server.url, 1)


def test_sigterm_while_streaming_finishes_every_stream_then_exits(make_server, tmp_path):
    """Draining lets running and waiting generations stream to their end before the server exits."""
    from tests.conftest import write_tiny_lm_model

    server = make_server(write_tiny_lm_model(tmp_path / "models", max_num_seqs=2))
    threads, streaming, outcomes = _stream_in_threads(_tiny_sdk(server), 3, 120)
    assert streaming.acquire(timeout=30) and streaming.acquire(timeout=30)
    server.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(timeout=90)
    assert sorted(outcomes.values()) == [("finished", 120)] * 3, outcomes
    assert server.process.wait(timeout=60) == 0


def test_requests_still_running_when_the_grace_period_ends_get_a_503_saying_so(make_server, tmp_path):
    """A batch that takes longer than the shutdown's grace period: its requests are answered 503
    `server_shutting_down`, in the OpenAI envelope, not cut off with their connection."""
    repo = write_emulated_model(tmp_path / "models", slo_ms=60000, alpha_ms=20000, beta_ms=1)
    server = make_server(repo, "--graceful-timeout", "1")

    started = time.monotonic()
    responses = _fire_while_stopping(server, 2, 0.5)
    assert time.monotonic() - started < 10, "answered when the grace period ended, not when the batch did"
    for response in responses:
        assert response.status_code == 503, response.text
        assert "shutting down" in response.json()["error"]  # KServe's shape: a message
    assert server.process.wait(timeout=30) == 0


def test_generations_still_running_when_the_grace_period_ends_get_an_error_event_or_a_503(make_server, tmp_path):
    """A stream then ends with an SSE error event, an unstreamed completion with a 503
    `server_shutting_down`, in the OpenAI envelope: neither is cut off with its connection."""
    import openai

    from tests.conftest import write_tiny_lm_model

    server = make_server(write_tiny_lm_model(tmp_path / "models", max_num_seqs=2), "--graceful-timeout", "0.5")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    ask = {"model": "tiny", "prompt": "story", "max_tokens": 1000, "temperature": 0, "extra_body": {"ignore_eos": True}}
    unstreamed: list[Exception] = []

    def whole() -> None:
        try:
            client.completions.create(**ask)
        except Exception as exc:  # looked at below
            unstreamed.append(exc)

    thread = threading.Thread(target=whole)
    thread.start()
    received = 0
    with pytest.raises(openai.APIError) as raised:
        for _ in client.completions.create(**ask, stream=True):
            received += 1
            if received == 2:
                eventually(lambda: metric_total(server, "vllm:num_requests_running", model_name="tiny") == 2,
                           "the unstreamed completion never ran beside the stream")
                server.process.send_signal(signal.SIGTERM)
    thread.join(timeout=60)
    assert 2 <= received < 1000
    assert "shutting down" in raised.value.message
    assert getattr(raised.value, "code", None) in (None, "server_shutting_down")
    assert len(unstreamed) == 1 and isinstance(unstreamed[0], openai.APIStatusError), unstreamed
    assert unstreamed[0].status_code == 503 and unstreamed[0].code == "server_shutting_down"
    assert server.process.wait(timeout=60) == 0


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow to collect it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_worker_started_on_its_own_outlives_the_process_that_started_it(tmp_path):
    """`sluice worker` started from a script that then exits (`sluice worker ... &` in a start
    script, `nohup` over ssh) keeps serving: it used to be SIGTERMed by the kernel the moment its
    parent exited (the death signal meant for `sluice serve`'s workers), and drained away without
    a word. It still drains on SIGTERM and exits 0."""
    import subprocess
    import sys

    from tests.conftest import free_port

    port, http_port = free_port(), free_port()
    command = [sys.executable, "-m", "sluice", "worker", "--bind", f"tcp://127.0.0.1:{port}",
              "--models", str(write_emulated_model(tmp_path / "models", alpha_ms=1))]
    launch = (  # the worker, then, once it listens (its start-up done), the launcher exits
        "import socket, subprocess, sys, time\n"
        f"worker = subprocess.Popen({command!r}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "deadline = time.monotonic() + 60\n"
        "while time.monotonic() < deadline:\n"
        "    try:\n"
        f"        socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
        "        break\n"
        "    except OSError:\n"
        "        time.sleep(0.1)\n"
        "print(worker.pid)\n")
    launcher = subprocess.run([sys.executable, "-c", launch], capture_output=True, text=True, check=True, timeout=90)
    pid = int(launcher.stdout)  # its parent has exited
    gateway = subprocess.Popen([sys.executable, "-m", "sluice", "gateway", "--worker", f"tcp://127.0.0.1:{port}",
                                "--port", str(http_port)])
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert _running(pid), "the worker exited with the process that started it"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v2/health/ready").status_code == 200:
                    break
            assert time.monotonic() < deadline, "the gateway did not become ready"
            time.sleep(0.1)
        assert httpx.post(f"{url}/v2/models/emulated/infer", json=BODY).status_code == 200
        assert _running(pid)
        os.kill(pid, signal.SIGTERM)  # drains and exits
        deadline = time.monotonic() + 30
        while _running(pid):
            assert time.monotonic() < deadline, "the worker did not exit on SIGTERM"
            time.sleep(0.1)
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(timeout=30)
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_worker_or_gateway_given_an_address_it_cannot_use_says_so(tmp_path):
    """A second worker on a taken address, a metrics port another process has, an address written
    without its scheme (to the worker or to the gateway), a port out of range: one line naming
    the problem and a non-zero exit status, where each used to be a Python traceback."""
    import socket
    import subprocess
    import sys

    from tests.conftest import free_port

    repo = str(write_emulated_model(tmp_path / "models", alpha_ms=1))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        done = subprocess.run([sys.executable, "-m", "sluice", "worker", "--bind", address, "--models", repo],
                              capture_output=True, text=True, timeout=120)
        metrics = subprocess.run([sys.executable, "-m", "sluice", "worker", "--bind", f"tcp://127.0.0.1:{free_port()}",
                                  "--models", repo, "--metrics-port", str(taken.getsockname()[1])],
                                 capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"Error: cannot listen on {address}:" in done.stderr and "address already in use" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert metrics.returncode == 1, metrics.stderr
    assert "Error: cannot serve metrics on port" in metrics.stderr and "Traceback" not in metrics.stderr, metrics.stderr
    for command in (["worker", "--bind", "127.0.0.1:7000", "--models", repo],
                    ["worker", "--bind", "tcp://127.0.0.1:7000", "--models", repo, "--metrics-port", "99999"],
                    ["gateway", "--worker", "127.0.0.1:7000", "--port", "0"]):
        done = subprocess.run([sys.executable, "-m", "sluice", *command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert "Invalid value for " in done.stderr and "--" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
