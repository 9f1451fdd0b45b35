"""What must not overlap on a CUDA device shared by the threads of one worker process.

A worker runs each generative model's steps on a thread of its own, its batch models' batches on
the device thread, and loads and warms up versions on load threads, two at a time
(`--load-concurrency`). CUDA lets all of that overlap but one thing: recording a CUDA graph
(`engines.generative.graphs`). While one thread records, any other thread's work on the device (a
kernel on the default stream, a device-wide synchronize, memory handed back) makes the recording
fail, and can take the process down. Seen on an H200: a worker loading two generative models at
once recorded neither model's graphs (`operation not permitted when stream is capturing`), so
both ran every decode step eagerly (2,571 output tokens/s through the server instead of 4,224),
and the run's log held a `terminate called after throwing an instance of 'c10::Error'`.

So every unit of device work holds the `DEVICE_GATE` shared (an engine step, a batch, a warm-up,
emptying the allocator's cache), and recording one graph holds it exclusively: a recording waits
for the steps running to end, and steps wait for it (milliseconds a graph). A waiting recording
goes first, so steps arriving all the time do not starve it. `one_load_at_a_time(device)` keeps
a CUDA worker's loads apart: a load records its graphs, and sizes its KV cache from the memory
free, both of which another load running beside it would falsify.

On the CPU nothing is ever held exclusively: holding the gate shared costs a lock round trip.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

__all__ = ["DEVICE_GATE", "DeviceGate", "one_load_at_a_time"]


class DeviceGate:
    """A readers-writer lock in which a waiting writer goes before new readers. Holding it shared
    is reentrant on a thread; asking for it exclusively while holding it shared is an error (it
    would wait for itself), raised as `RuntimeError`."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        self._held = threading.local()

    @contextmanager
    def shared(self) -> Iterator[None]:
        depth = getattr(self._held, "depth", 0)
        if depth == 0:
            with self._changed:
                while self._writing or self._writers_waiting:
                    self._changed.wait()
                self._readers += 1
        self._held.depth = depth + 1
        try:
            yield
        finally:
            self._held.depth = depth
            if depth == 0:
                with self._changed:
                    self._readers -= 1
                    if self._readers == 0 and self._writers_waiting:
                        self._changed.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        if getattr(self._held, "depth", 0):
            raise RuntimeError("the device gate is held shared by this thread: it cannot wait for itself")
        with self._changed:
            self._writers_waiting += 1
            try:
                while self._writing or self._readers:
                    self._changed.wait()
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._changed:
                self._writing = False
                self._changed.notify_all()


DEVICE_GATE = DeviceGate()

_CUDA_LOADS = threading.Lock()


def one_load_at_a_time(device: str) -> AbstractContextManager[object]:
    """Held around loading a version on `device`: on a CUDA device, one load at a time."""
    return nullcontext() if device == "cpu" else _CUDA_LOADS
