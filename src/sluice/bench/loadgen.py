"""An open-loop load generator: Poisson arrivals, sent on schedule whatever the server does.

Open loop means a request's send time comes from the arrival process alone, never from the
completion of an earlier request, so a slow server cannot slow the offered load down
("coordinated omission"). The whole schedule is drawn before the run; a dispatcher sleeps until
the next arrival and starts every request that is due as its own task. If the dispatcher cannot
keep up (CPU starved), requests go out late: each request's lag (actual - scheduled send time) is
recorded so the report can say so.

    time ─────────────────────────────────────────────────────────────────────>
         |<──── warm-up (not recorded) ────>|<──────── measured ────────>| drain
                                            ^ scrape /metrics            ^ last send   ^ last answer,
                                                                                        scrape again

Per-request results go into preallocated typed arrays indexed by arrival number; nothing else is
allocated per request beyond the task and the body bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import time
from array import array
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import numpy as np

from sluice.bench.promstats import ServerSnapshot, server_delta
from sluice.bench.stats import TRANSPORT_ERROR, RunSamples
from sluice.bench.workloads import Workload

DEFAULT_MAX_CONNECTIONS = 1000
"""Enough for 10,000 req/s at 100 ms; a cap stops a stalled generator from opening thousands of
connections at once (each costs both sides CPU, which stalls it further). A request that waits
for a connection has that wait in its latency, and the run reports it as connection-limited."""

_START_DELAY_S = 0.02
_MIN_SLEEP_S = 0.001
_PROGRESS_EVERY_S = 0.1

Snapshotter = Callable[[], Coroutine[Any, Any, ServerSnapshot | None]]
T = TypeVar("T")
ProgressCallback = Callable[[int, int], None]
"""Called with (number of requests sent, number finished), counting warm-up ones too."""


def poisson_schedule(rate_per_s: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Send offsets in seconds, sorted, in [0, duration_s): a Poisson process of the given rate."""
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be positive, got {rate_per_s}/s for {duration_s} s")
    expected = rate_per_s * duration_s
    num_draws = int(expected + 6 * math.sqrt(expected) + 16)
    while True:
        offsets = np.cumsum(rng.exponential(1.0 / rate_per_s, size=num_draws))
        if offsets[-1] >= duration_s:
            return offsets[offsets < duration_s]
        num_draws *= 2


@dataclass(frozen=True, slots=True)
class LoadConfig:
    rate_per_s: float
    duration_s: float
    warmup_s: float = 0.0
    seed: int = 0


class LoadGenerator:
    """Sends a workload over one shared aiohttp session. One run at a time."""

    def __init__(self, session: aiohttp.ClientSession, workload: Workload) -> None:
        self._session = session
        self._workload = workload
        self._sent = array("d")
        self._done = array("d")
        self._status = array("h")
        self._retry_after = array("b")
        self._num_sent = 0
        self._num_done = 0
        self._peak_in_flight = 0
        self._drained: asyncio.Event | None = None
        """Set once every request has finished; exists only while draining."""

    async def run(self, config: LoadConfig, snapshot: Snapshotter | None = None,
                  progress: ProgressCallback | None = None) -> RunSamples:
        rng = np.random.default_rng(config.seed)
        warmup = np.empty(0)
        if config.warmup_s > 0:
            warmup = poisson_schedule(config.rate_per_s, config.warmup_s, rng)
        measured = poisson_schedule(config.rate_per_s, config.duration_s, rng)
        schedule = np.concatenate([warmup, measured + config.warmup_s])
        num_warmup = len(warmup)
        self._reset(len(schedule))

        tasks: set[asyncio.Task[Any]] = set()
        with _frozen_heap():
            cpu_start_s, wall_start_s = time.process_time(), time.perf_counter()
            start_s = wall_start_s + _START_DELAY_S
            send_at = array("d", (schedule + start_s).tolist())
            try:
                before_task = await self._dispatch(send_at, num_warmup, tasks, snapshot, progress)
                await self._drain(tasks, progress)
            finally:  # only matters when the run itself is cancelled: leave nothing running
                for task in tasks:
                    task.cancel()
        before = await before_task if before_task is not None else None
        after = await snapshot() if snapshot is not None else None
        server = server_delta(before, after) if before is not None and after is not None else None
        cpu_cores = (time.process_time() - cpu_start_s) / (time.perf_counter() - wall_start_s)

        measure_start_s = start_s + config.warmup_s
        connector = self._session.connector
        sent = np.frombuffer(self._sent, dtype=np.float64)[num_warmup:].copy()
        done = np.frombuffer(self._done, dtype=np.float64)[num_warmup:].copy()
        return RunSamples(
            rate_per_s=config.rate_per_s, duration_s=config.duration_s, scheduled_s=measured,
            sent_s=sent - measure_start_s, latency_s=done - sent,
            status=np.frombuffer(self._status, dtype=np.int16)[num_warmup:].copy(),
            has_retry_after=np.frombuffer(self._retry_after, dtype=np.int8)[num_warmup:].astype(bool),
            server=server,
            peak_in_flight=self._peak_in_flight, max_connections=0 if connector is None else connector.limit,
            generator_cpu_cores=cpu_cores,
        )

    def _reset(self, num_requests: int) -> None:
        # Flat typed arrays, not lists: the garbage collector never has to walk them.
        self._sent = array("d", [math.nan]) * num_requests
        self._done = array("d", [math.nan]) * num_requests
        self._status = array("h", [TRANSPORT_ERROR]) * num_requests
        self._retry_after = array("b", [0]) * num_requests
        self._num_sent = 0
        self._num_done = 0
        self._peak_in_flight = 0

    async def _dispatch(self, send_at: array[float], num_warmup: int, tasks: set[asyncio.Task[Any]],
                        snapshot: Snapshotter | None, progress: ProgressCallback | None,
                        ) -> asyncio.Task[ServerSnapshot | None] | None:
        """Start every request at its scheduled time, adding it to `tasks` until it finishes.

        Returns the task taking the first snapshot, started when measurement starts.
        """
        loop = asyncio.get_running_loop()
        before_task: asyncio.Task[ServerSnapshot | None] | None = None
        if snapshot is not None and num_warmup == 0:
            before_task = _spawn(loop, snapshot(), tasks)
        next_progress_s = 0.0
        num_requests = len(send_at)
        index = 0
        while index < num_requests:
            now = time.perf_counter()
            while index < num_requests and send_at[index] <= now:
                _spawn(loop, self._send(index), tasks)
                index += 1
                if index == num_warmup and snapshot is not None:
                    before_task = _spawn(loop, snapshot(), tasks)
            if progress is not None and now >= next_progress_s:
                progress(self._num_sent, self._num_done)
                next_progress_s = now + _PROGRESS_EVERY_S
            if index < num_requests:
                # Sleeping 0 still yields, so started requests make progress while we are behind.
                # Shorter sleeps would spin: uvloop rounds timers to whole milliseconds.
                delay_s = send_at[index] - time.perf_counter()
                await asyncio.sleep(max(delay_s, _MIN_SLEEP_S) if delay_s > 0 else 0)
        return before_task

    async def _drain(self, tasks: set[asyncio.Task[Any]], progress: ProgressCallback | None) -> None:
        # Wait on one event rather than asyncio.wait(tasks): that hooks a callback onto every
        # pending task on each call, which costs real CPU when thousands are outstanding.
        self._drained = asyncio.Event()
        if self._num_done == len(self._done):
            self._drained.set()
        while tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), _PROGRESS_EVERY_S)
            if progress is not None:
                progress(self._num_sent, self._num_done)
        if progress is not None:
            progress(self._num_sent, self._num_done)
        self._drained = None

    async def _send(self, index: int) -> None:
        workload = self._workload
        body = workload.body(index)
        self._num_sent += 1
        in_flight = self._num_sent - self._num_done
        if in_flight > self._peak_in_flight:
            self._peak_in_flight = in_flight
        sent_s = time.perf_counter()
        self._sent[index] = sent_s
        try:
            async with self._session.post(workload.url, data=body, headers=workload.headers) as response:
                await response.read()
                self._status[index] = response.status
                self._retry_after[index] = "Retry-After" in response.headers
        except (aiohttp.ClientError, TimeoutError, OSError):
            self._status[index] = TRANSPORT_ERROR
        self._done[index] = time.perf_counter()
        self._num_done += 1
        if self._drained is not None and self._num_done == len(self._done):
            self._drained.set()


def _spawn(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], tasks: set[asyncio.Task[Any]],
           ) -> asyncio.Task[T]:
    """Start `coro`, holding a reference in `tasks` until it finishes (the loop holds only a weak one)."""
    task = loop.create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Keep the garbage collector off everything that existed before the run.

    A full collection walks every tracked object (modules, aiohttp, rich, ...) and measured
    40-70 ms here: long enough to send a whole burst late. Frozen objects are never walked; the
    per-request garbage made during the run is still collected as usual. Process-wide, so only
    one run at a time may use it.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def new_session(request_timeout_s: float,
                max_connections: int = DEFAULT_MAX_CONNECTIONS) -> aiohttp.ClientSession:
    """The one session a run uses: keep-alive connections, at most `max_connections` (0: no limit)."""
    connector = aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=60, force_close=False,
                                     enable_cleanup_closed=False)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=request_timeout_s),
                                 skip_auto_headers=("User-Agent",))
