"""The embedded supervisor: a worker that cannot be started for now (no memory or processes left
to fork) is tried again after its backoff, not given up on."""

from __future__ import annotations

import asyncio
import errno
import logging
from pathlib import Path

from sluice.gateway.supervisor import Supervisor, SupervisorConfig, WorkerSpec


async def test_a_worker_that_cannot_be_started_now_is_started_later(monkeypatch, caplog):
    real_exec = asyncio.create_subprocess_exec
    attempts: list[tuple[str, ...]] = []

    async def create_subprocess_exec(*command: str, **kwargs: object) -> asyncio.subprocess.Process:
        attempts.append(command)
        if len(attempts) <= 2:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        return await real_exec("sleep", "30")  # stands in for the worker

    monkeypatch.setattr(asyncio, "create_subprocess_exec", create_subprocess_exec)
    supervisor = Supervisor([WorkerSpec("w0", "ipc:///tmp/unused.sock", Path("/models"), "cpu")],
                            on_exit=lambda worker_id: None, on_restart=lambda worker_id: None,
                            config=SupervisorConfig(initial_backoff_s=0.01, stop_timeout_s=5))
    with caplog.at_level(logging.ERROR, logger="sluice.supervisor"):
        await supervisor.start()
        async with asyncio.timeout(5):
            while "w0" not in supervisor._processes:
                await asyncio.sleep(0.01)
    process = supervisor._processes["w0"]
    assert len(attempts) == 3 and process.returncode is None
    assert caplog.text.count("worker w0 could not be started ([Errno 11] Resource temporarily unavailable)") == 2
    await supervisor.aclose()
    assert process.returncode is not None
