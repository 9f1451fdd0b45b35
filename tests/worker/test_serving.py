"""A worker whose state reports fail (a bug) exits, to be restarted, instead of staying up unheard:
without its reports the gateway would send it nothing again, and nothing would restart it."""

from __future__ import annotations

import asyncio
import logging

import pytest

from sluice.clock import MonotonicClock
from sluice.metrics import WorkerMetrics
from sluice.worker.main import WorkerConfig, load_models
from sluice.worker.server import WorkerServer
from tests.conftest import write_emulated_model


def _server(tmp_path) -> WorkerServer:
    write_emulated_model(tmp_path / "models")
    models, _, _ = load_models(WorkerConfig("w", "inproc://w", tmp_path / "models"))
    return WorkerServer("w", models, [], MonotonicClock(), WorkerMetrics("w"))


async def test_a_worker_whose_state_reports_fail_exits(tmp_path, caplog):
    server = _server(tmp_path)
    ticks = 0

    def unload_idle() -> None:  # runs at every state tick
        nonlocal ticks
        ticks += 1
        if ticks == 3:
            raise RuntimeError("a bug in a state tick")

    server._syncer.unload_idle = unload_idle  # type: ignore[method-assign]
    with caplog.at_level(logging.CRITICAL, logger="sluice"), pytest.raises(RuntimeError, match="a bug in a state tick"):
        async with asyncio.timeout(10):
            await server.serve(f"ipc://{tmp_path}/w.sock")
    assert "worker: its state reports failed; exiting to be restarted" in caplog.text


async def test_a_drained_worker_returns(tmp_path):
    server = _server(tmp_path)
    assert server.not_ready() == "loading its models"  # (its readiness probe's answer, `worker.probes`)
    serving = asyncio.create_task(server.serve(f"ipc://{tmp_path}/w.sock"))
    await asyncio.sleep(0.2)
    assert server.not_ready() is None
    server.drain()
    assert server.not_ready() == "draining"
    async with asyncio.timeout(10):
        await serving
