"""The embedded process supervisor: one worker process per device, restarted with backoff.

It is the local stand-in for Kubernetes in the embedded mode: it starts `sluice worker`
processes, notices at once when one exits (so the gateway can re-dispatch its requests), and
starts it again after an exponential backoff that resets once the worker has stayed up a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sluice.tasks import cancel_and_wait

log = logging.getLogger("sluice.supervisor")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    worker_id: str
    address: str
    models_dir: Path
    device: str
    share: tuple[int, int] = (0, 1)
    """(index, count), `sluice worker --share I/N`: which of the workers this is, for external
    upstreams' limits."""
    memory_mb: int | None = None
    """`sluice worker --model-memory-mb`."""
    load_concurrency: int | None = None
    """`sluice worker --load-concurrency` (None: its default)."""


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0
    stop_timeout_s: float = 30.0
    env: dict[str, str] = field(default_factory=dict)


class Supervisor:
    def __init__(
        self,
        specs: list[WorkerSpec],
        on_exit: Callable[[str], None],
        on_restart: Callable[[str], None],
        config: SupervisorConfig | None = None,
    ) -> None:
        self._specs = specs
        self._on_exit = on_exit
        self._on_restart = on_restart
        self._config = config or SupervisorConfig()
        self._processes: dict[str, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._is_stopping = False

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._keep_running(spec)) for spec in self._specs]

    async def aclose(self) -> None:
        """SIGTERM every worker (they drain), wait for them, then kill stragglers."""
        self._is_stopping = True
        for process in self._processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self._config.stop_timeout_s
        for process in self._processes.values():
            try:
                await asyncio.wait_for(process.wait(), timeout=max(deadline - time.monotonic(), 0.1))
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        await cancel_and_wait(self._tasks)

    async def _keep_running(self, spec: WorkerSpec) -> None:
        backoff = self._config.initial_backoff_s
        while not self._is_stopping:
            started = time.monotonic()
            try:
                process = await self._spawn(spec)
            except OSError as exc:  # no process to be had now (out of memory or of processes): tried again
                log.error("worker %s could not be started (%s); trying again in %.1f s", spec.worker_id, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._config.max_backoff_s)
                continue
            self._processes[spec.worker_id] = process
            code = await process.wait()
            from sluice.metrics import mark_process_dead

            mark_process_dead(process.pid)
            if self._is_stopping:
                return
            log.error("worker %s (pid %d) exited with %s; restarting in %.1f s",
                      spec.worker_id, process.pid, code, backoff)
            self._on_exit(spec.worker_id)
            if time.monotonic() - started > self._config.stable_after_s:
                backoff = self._config.initial_backoff_s
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._config.max_backoff_s)
            self._on_restart(spec.worker_id)

    async def _spawn(self, spec: WorkerSpec) -> asyncio.subprocess.Process:
        command = [
            sys.executable, "-m", "sluice", "worker",
            "--id", spec.worker_id, "--bind", spec.address,
            "--models", str(spec.models_dir), "--device", spec.device, "--share", "{}/{}".format(*spec.share),
            "--exit-with-parent",
        ]
        if spec.memory_mb is not None:
            command += ["--model-memory-mb", str(spec.memory_mb)]
        if spec.load_concurrency is not None:
            command += ["--load-concurrency", str(spec.load_concurrency)]
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_WORKER_")}  # not for these
        env = {**inherited, **self._config.env}
        return await asyncio.create_subprocess_exec(*command, env=env)
