"""The worker's device thread forms the next batch under the scheduler lock, the moment the running
one ends; a request admitted on the loop thread must have its input in place by the time the lock
is released, or that batch runs without it and the request fails with "item 0: cancelled" (seen
once in a 100,000-item batch job)."""

from __future__ import annotations

import threading
from pathlib import Path

from sluice import wire
from sluice.clock import MonotonicClock
from sluice.metrics import WorkerMetrics
from sluice.worker.main import WorkerConfig, load_models
from sluice.worker.server import WorkerServer
from tests.conftest import write_emulated_model


class _FormsABatchOnRelease:
    """The scheduler lock, interleaved as the device thread can be: the first time the loop thread
    releases it, the device thread takes it and forms the next batch (`DeviceThread._run`)."""

    def __init__(self, server: WorkerServer) -> None:
        self._inner = threading.Lock()
        self._server = server
        self.formed: list[list[object]] = []

    def __enter__(self) -> None:
        self._inner.acquire()

    def __exit__(self, *exc: object) -> None:
        self._inner.release()
        if not self.formed:
            with self._inner:
                decision = self._server._scheduler.next_batch()
                assert decision.batch is not None
                self.formed.append(self._server._batches.prepared_items(decision.batch))


class _IdleDevice:
    is_stopping = False

    def start(self, batch: object, prepared: object) -> None:
        raise AssertionError("the device is already running the batch the device thread formed")


def test_a_batch_formed_as_admission_releases_the_lock_has_the_requests_input(tmp_path: Path) -> None:
    write_emulated_model(tmp_path / "models")
    models, _, _ = load_models(WorkerConfig("w", "inproc://w", tmp_path / "models"))
    server = WorkerServer("w", models, [], MonotonicClock(), WorkerMetrics("w"))
    lock = _FormsABatchOnRelease(server)
    server._batches._lock = lock  # type: ignore[assignment]
    server._batches.device = _IdleDevice()  # type: ignore[assignment]
    replies: list[wire.Message] = []
    server._outbox.reply = lambda identity, message: replies.append(message)  # type: ignore[method-assign]
    payload = wire.TensorPayload("float32", (1, 16), bytes(64))
    server._on_submit(b"gw", wire.Submit(1, "emulated", "1", payload, 5.0, "", 1))
    (prepared,) = lock.formed
    assert len(prepared) == 1 and prepared[0] is not None  # None: run as "cancelled", and answered so
    assert replies == []  # admitted, not answered yet
