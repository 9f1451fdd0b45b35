"""The device thread: runs batches back to back, forming each next batch itself.

    loop thread                          device thread
    ───────────                          ─────────────
    admit ─▶ scheduler (under lock)
    device idle? form batch ─▶ start() ─▶ run batch N
                                         lock: work queued? batch_done(N); next_batch() -> N+1
    ◀── call_soon_threadsafe(on_done) ── run batch N+1 at once
    replies for N, Started for N+1
    (nothing was queued: batch_done(N) after the replies, then a batch of what came meanwhile)

When a batch finishes and work is queued, the thread that is already awake forms the next one
and starts it, so the device does not wait for the event loop to be scheduled (on a busy host
that wait was a tenth of the device's time). When nothing is queued, the answers come first:
the thread hands the batch over unrecorded and the loop records it (`batch_done`) once the
replies have left, so a lone request's answer does not wait for the scheduler's bookkeeping
(the two threads share one GIL: work moved between them is not done in parallel). The
scheduler is shared under one lock; everything else (pending requests, replies, metrics) stays
on the event loop, which learns of each batch afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from sluice.engines.base import ItemFailure, ItemOutput, PreparedItem, Runner
from sluice.engines.device_gate import DEVICE_GATE
from sluice.scheduler import Batch, Decision, Scheduler

log = logging.getLogger("sluice.worker")

BatchOutput = tuple[list[ItemOutput | ItemFailure], float]  # outputs in item order, device seconds
Lookup = Callable[[Batch], list[PreparedItem | None]]
OnDone = Callable[[Batch, list[ItemOutput | ItemFailure], float, Decision | None], None]
"""(batch, outputs, device seconds, the next batch's decision, or None: the batch is not yet
recorded as done and the loop calls `Scheduler.batch_done` itself)"""


class DeviceThread:
    def __init__(self, scheduler: Scheduler, lock: threading.Lock, runners: dict[tuple[str, str], Runner],
                 lookup: Lookup, on_done: OnDone, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduler = scheduler
        self._lock = lock
        self._runners = runners
        self._lookup = lookup
        self._on_done = on_done
        self._loop = loop
        self._inbox: queue.SimpleQueue[tuple[Batch, list[PreparedItem | None]] | None] = queue.SimpleQueue()
        self.is_stopping = False
        self._thread = threading.Thread(target=self._run, name="device", daemon=True)
        self._thread.start()

    def start(self, batch: Batch, prepared: list[PreparedItem | None]) -> None:
        """Run a batch the loop formed while the device was idle."""
        self._inbox.put((batch, prepared))

    def stop(self) -> None:
        """Finish the running batch, start no more, and end the thread."""
        self.is_stopping = True
        self._inbox.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._inbox.get()) is not None:
            batch: Batch | None = job[0]
            prepared = job[1]
            while batch is not None:
                outputs, exec_s = self._execute(batch, prepared)
                decision: Decision | None = None
                next_prepared: list[PreparedItem | None] = []
                with self._lock:
                    if not self.is_stopping and self._scheduler.num_queued() > 0:
                        self._scheduler.batch_done(batch, exec_s)
                        decision = self._scheduler.next_batch()
                        if decision.batch is not None:
                            next_prepared = self._lookup(decision.batch)
                self._loop.call_soon_threadsafe(self._on_done, batch, outputs, exec_s, decision)
                batch, prepared = (decision.batch, next_prepared) if decision is not None else (None, [])

    def _execute(self, batch: Batch, prepared: list[PreparedItem | None]) -> BatchOutput:
        started = time.perf_counter()
        try:
            live = [item for item in prepared if item is not None]
            with DEVICE_GATE.shared():
                results = iter(run_isolating(self._runners[batch.model], live) if live else [])
            outputs: list[ItemOutput | ItemFailure] = [
                next(results) if item is not None else ItemFailure("cancelled") for item in prepared
            ]
        except Exception as exc:  # a runner bug, not the input: fail this batch, keep serving
            log.exception("batch failed on the device")
            outputs = [ItemFailure(f"device error: {exc}")] * len(prepared)
        return outputs, time.perf_counter() - started


def run_isolating(runner: Runner, items: Sequence[PreparedItem]) -> list[ItemOutput | ItemFailure]:
    """Run a batch; if the model raises, bisect so that only the poisoned item fails."""
    try:
        outputs = runner.run_batch(items)
    except Exception as exc:
        if len(items) == 1:
            log.warning("model error on one item: %s", type(exc).__name__)
            return [ItemFailure(f"model error: {exc}")]
        middle = len(items) // 2
        return run_isolating(runner, items[:middle]) + run_isolating(runner, items[middle:])
    if len(outputs) != len(items):
        raise RuntimeError(f"runner returned {len(outputs)} outputs for {len(items)} items")
    return outputs
