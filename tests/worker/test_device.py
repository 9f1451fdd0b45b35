"""The device thread chains batches itself while work is queued; with nothing queued it hands a
finished batch to the event loop unrecorded, and the loop sends the answers before recording it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import numpy as np

from sluice import wire
from sluice.clock import MonotonicClock
from sluice.engines.base import ItemFailure, PreparedItem
from sluice.repository import BatchingConfig
from sluice.scheduler import Batch, Decision, LatencyProfile, Scheduler
from sluice.worker.device import DeviceThread

KEY = ("m", "1")


class _Runner:
    def run_batch(self, items: Sequence[PreparedItem]) -> list[np.ndarray | ItemFailure]:
        return [np.array([item.data]) for item in items]


def _scheduler(max_batch_size: int) -> Scheduler:
    scheduler = Scheduler(MonotonicClock())
    scheduler.add_model(KEY, BatchingConfig(max_batch_size=max_batch_size), LatencyProfile(0.001, 0.0, 1))
    return scheduler


async def _run(scheduler: Scheduler, num_requests: int) -> list[tuple[Batch, list, Decision | None, bool]]:
    loop = asyncio.get_running_loop()
    lock = threading.Lock()
    done: list[tuple[Batch, list, Decision | None, bool]] = []
    all_done = asyncio.Event()

    def on_done(batch: Batch, outputs: list, exec_s: float, decision: Decision | None) -> None:
        with lock:
            done.append((batch, outputs, decision, scheduler.is_idle))
            if decision is None:
                scheduler.batch_done(batch, exec_s)  # what the worker's loop does
        if sum(len(b.items) for b, *_ in done) == num_requests:
            all_done.set()

    device = DeviceThread(scheduler, lock, {KEY: _Runner()},  # type: ignore[dict-item]
                          lambda batch: [PreparedItem(1, item.request_id) for item in batch.items], on_done, loop)
    with lock:
        for request_id in range(num_requests):
            scheduler.admit(KEY, request_id, [1], MonotonicClock().now() + 10.0)
        decision = scheduler.next_batch()
        assert decision.batch is not None
        device.start(decision.batch, [PreparedItem(1, item.request_id) for item in decision.batch.items])
    await asyncio.wait_for(all_done.wait(), 10.0)
    device.stop()
    return done


async def test_with_work_queued_the_device_thread_starts_the_next_batch_itself():
    done = await _run(_scheduler(max_batch_size=1), 3)
    assert [d is not None and d.batch is not None for _, _, d, _ in done] == [True, True, False]
    (_, _, decision, was_idle) = done[-1]
    assert decision is None and not was_idle  # the last one: handed over unrecorded
    assert [int(o[0]) for _, outs, _, _ in done for o in outs] == [0, 1, 2]


async def test_a_lone_batch_is_handed_to_the_loop_unrecorded():
    scheduler = _scheduler(max_batch_size=8)
    done = await _run(scheduler, 1)
    ((_, outputs, decision, was_idle),) = done
    assert decision is None and not was_idle and [int(o[0]) for o in outputs] == [0]
    assert scheduler.is_idle  # recorded by the loop


def test_the_worker_answers_before_it_records_the_batch(tmp_path):
    from sluice.metrics import WorkerMetrics
    from sluice.worker.main import WorkerConfig, load_models
    from sluice.worker.server import WorkerServer
    from tests.conftest import write_emulated_model

    write_emulated_model(tmp_path / "models")
    models, _, _ = load_models(WorkerConfig("w", "inproc://w", tmp_path / "models"))
    server = WorkerServer("w", models, [], MonotonicClock(), WorkerMetrics("w"))
    events: list[str] = []

    class _Device:
        is_stopping = False
        started: list[Batch] = []

        def start(self, batch: Batch, prepared: object) -> None:
            self.started.append(batch)

    class _Listener:
        def send(self, identity: bytes, body: bytes) -> bool:
            events.extend(type(m).__name__ for m in wire.decode(body))
            return True

    device = _Device()
    server._batches.device = device  # type: ignore[assignment]
    server._outbox.listener = _Listener()  # type: ignore[assignment]
    original_done = server._scheduler.batch_done
    server._scheduler.batch_done = lambda b, s: (events.append("recorded"), original_done(b, s))[1]  # type: ignore[method-assign]

    async def scenario() -> None:
        payload = wire.TensorPayload("float32", (1, 16), bytes(64))
        server._on_submit(b"gw", wire.Submit(1, "emulated", "1", payload, 5.0, "", 1))
        (batch,) = device.started
        server._on_batch_done(batch, [np.zeros(1, np.float32)], 0.009, None)
        await asyncio.sleep(0)  # let the queued flush of the Started message run too

    asyncio.run(scenario())
    assert events.index("Result") < events.index("recorded")
    assert server._scheduler.is_idle
