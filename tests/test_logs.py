"""Logs go to stderr through one writer thread: a stderr nobody reads never stops the server
(lines are dropped, counted and owned up to instead), and lines are written in order."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from sluice import logs
from tests.conftest import eventually, free_port, metric_total, start_server, write_emulated_model

INPUTS = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
PATIENCE_S = 60.0
"""How long a request may take on a loaded machine: the server must answer, not answer fast."""


def long_id(i: int) -> str:
    return f"{i:08d}-" + "x" * 119  # the longest id echoed (128 characters): long access lines


@pytest.fixture
def unread_stderr_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`sluice serve` whose stderr is a pipe that nobody reads (until the test does)."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "sluice", "serve", "--models", str(write_emulated_model(tmp_path / "repo")),
         "--port", str(port), "--log-level", "info"],
        stdout=(tmp_path / "stdout").open("wb"), stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        eventually(lambda: _is_ready(url), "the server ready", timeout_s=120)
        yield process, url
    finally:
        process.kill()
        process.wait()
        assert process.stderr is not None
        process.stderr.close()


def _is_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_server_whose_stderr_nobody_reads_still_answers_and_counts_what_it_dropped(
        unread_stderr_server: tuple[subprocess.Popen[bytes], str]) -> None:
    process, url = unread_stderr_server
    with httpx.Client(base_url=url, timeout=PATIENCE_S) as client:
        sent = 0
        while metric_total(url, "sluice_log_lines_dropped_total", process="gateway") == 0:
            assert sent < 50_000, "no log line dropped: is stderr read after all?"
            for _ in range(500):  # an access line each, far more than the pipe holds
                assert client.get("/v2/health/live", headers={"x-request-id": long_id(sent)}).status_code == 200
                sent += 1
        assert client.get("/v2/health/live").json() == {"live": True}
        answer = client.post("/v2/models/emulated/infer", json=INPUTS)
        assert answer.status_code == 200 and answer.json()["outputs"]

        # Read stderr at last: the writer catches up and says how many lines it dropped.
        stderr = process.stderr
        assert stderr is not None
        read = bytearray()

        def read_all() -> None:
            while chunk := stderr.read1(65536):
                read.extend(chunk)

        threading.Thread(target=read_all, daemon=True).start()

        def dropped_lines() -> list[dict[str, object]]:
            text = bytes(read).decode(errors="replace")
            return [json.loads(line) for line in text.splitlines() if '"sluice.logs"' in line]

        eventually(lambda: bool(dropped_lines()), "a line saying how many were dropped", timeout_s=PATIENCE_S)
        dropped = metric_total(url, "sluice_log_lines_dropped_total", process="gateway")
        eventually(lambda: sum(int(line["num_dropped"]) for line in dropped_lines()) == dropped,  # type: ignore[call-overload]
                   "every dropped line owned up to", timeout_s=PATIENCE_S)
        assert all(line["level"] == "WARNING" and line["process"] == "gateway" for line in dropped_lines())
        assert "Traceback" not in bytes(read).decode(errors="replace")


def test_every_line_of_a_normal_run_is_written_in_order_even_those_just_before_exit(tmp_path: Path) -> None:
    server = start_server(write_emulated_model(tmp_path / "repo"), tmp_path)
    ids = [f"in-order-{i:04d}" for i in range(300)]
    try:
        with httpx.Client(base_url=server.url, timeout=PATIENCE_S) as client:
            for rid in ids:
                assert client.post("/v2/models/emulated/infer", json=INPUTS,
                                   headers={"x-request-id": rid}).status_code == 200
    finally:
        assert server.stop() == 0  # at once: the last lines are written on the way out
    logged = [json.loads(line)["request_id"] for line in server.log().splitlines() if '"sluice.access"' in line]
    assert [rid for rid in logged if rid and rid.startswith("in-order-")] == ids
    assert '"sluice.logs"' not in server.log()  # nothing dropped


@pytest.fixture
def configure(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], io.StringIO]]:
    """`logs.configure(level)` with this process's stderr read back (set in the test itself: pytest
    sets its own between a fixture and its test); undone afterwards, pytest's logging restored."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def configured(level: str) -> io.StringIO:
        out = io.StringIO()
        monkeypatch.setattr(sys, "stderr", out)
        logs.configure(level, process="test")
        return out

    try:
        yield configured
    finally:
        logging.captureWarnings(False)
        root.handlers[:], root.level = handlers, level


def test_records_and_access_lines_are_written_in_the_order_they_were_logged(
        configure: Callable[[str], io.StringIO]) -> None:
    """A record logged on the event loop's thread comes after the access lines its turn already holds."""
    stderr = configure("info")

    async def one_turn() -> None:
        logs.write_access({"request_id": "first"})
        logging.getLogger("sluice.test").warning("second")
        logs.write_access({"request_id": "third"})

    asyncio.run(one_turn())
    eventually(lambda: stderr.getvalue().count("\n") == 3, "three lines written", timeout_s=PATIENCE_S)
    lines = [json.loads(line) for line in stderr.getvalue().splitlines()]
    assert [line.get("request_id") or line["message"] for line in lines] == ["first", "second", "third"]
    assert [line["logger"] for line in lines] == ["sluice.access", "sluice.test", "sluice.access"]
    assert all(line["process"] == "test" for line in lines)


def test_logging_from_many_threads_at_once_loses_and_reorders_nothing(configure: Callable[[str], io.StringIO]) -> None:
    stderr = configure("info")

    def log_some(name: str) -> None:
        for i in range(500):
            logging.getLogger("sluice.test").info("%s %d", name, i)
            logs.write_access({"request_id": f"{name}-{i}"})

    threads = [threading.Thread(target=log_some, args=(f"t{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    eventually(lambda: stderr.getvalue().count("\n") == 4 * 2 * 500, "every line written", timeout_s=PATIENCE_S)
    lines = [json.loads(line) for line in stderr.getvalue().splitlines()]
    for n in range(4):
        mine = [line.get("request_id") or line["message"] for line in lines
                if (line.get("request_id") or line["message"]).startswith(f"t{n}")]
        assert mine == [item for i in range(500) for item in (f"t{n} {i}", f"t{n}-{i}")]


def test_a_python_warning_is_a_json_line_through_the_writer_not_a_write_of_its_own(
        configure: Callable[[str], io.StringIO]) -> None:
    """`warnings` writes to stderr itself, on the warning's thread (an event loop's): it goes
    through the writer as a `py.warnings` record instead."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # (not this project's tests' "error")
        stderr = configure("warning")
        warnings.warn("a library's complaint", UserWarning, stacklevel=1)
    eventually(lambda: stderr.getvalue().count("\n") >= 1, "the warning written", timeout_s=PATIENCE_S)
    [line] = [json.loads(line) for line in stderr.getvalue().splitlines()]
    assert (line["logger"], line["level"], line["process"]) == ("py.warnings", "WARNING", "test")
    assert "a library's complaint" in line["message"]
