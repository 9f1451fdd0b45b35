"""An open-loop load generator: Poisson arrivals, sent on schedule whatever the server does.

Open loop means a request's send time comes from the arrival process alone, never from the
completion of an earlier request, so a slow server cannot slow the offered load down
("coordinated omission"). The whole schedule is drawn before the run; a dispatcher sleeps until
the next arrival and hands every request that is due to the lean keep-alive client in
`http_client.py` (callbacks, no task per request). If the dispatcher cannot keep up (CPU
starved), requests go out late: each request's lag (actual - scheduled send time) is recorded so
the report can say so. Everything else a run does over HTTP (the /metrics snapshots, model
metadata, the streaming generative bench) uses an aiohttp session from `new_session`.

    time ─────────────────────────────────────────────────────────────────────>
         |<──── warm-up (not recorded) ────>|<──────── measured ────────>| drain
                                            ^ scrape /metrics            ^ last send   ^ last answer,
                                                                                        scrape again

Per-request results go into preallocated typed arrays indexed by arrival number; nothing else is
allocated per request beyond the request bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import time
from array import array
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import numpy as np

from sluice.bench.http_client import HttpPool, post_head, post_request, split_url
from sluice.bench.promstats import ServerSnapshot, server_delta
from sluice.bench.stats import TRANSPORT_ERROR, RunSamples
from sluice.bench.workloads import Workload
from sluice.tasks import wait_event

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
    """Sends one or more workloads to one server over its own keep-alive connections. One run at a time.

    With several workloads (streams), each has its own Poisson arrivals at its own rate; the
    schedules are merged into one, so a single dispatcher sends them all on time. Each run opens
    its connections (at most `max_connections`, 0: no cap) and closes them when it ends; a
    request unanswered `request_timeout_s` after its send counts as a transport error.
    """

    def __init__(self, workload: Workload | Sequence[Workload], request_timeout_s: float,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        self._workloads = (workload,) if isinstance(workload, Workload) else tuple(workload)
        if not self._workloads:
            raise ValueError("a load generator needs at least one workload")
        origins = {split_url(w.url)[0] for w in self._workloads}
        if len(origins) != 1:
            raise ValueError(f"all workloads of one generator must go to one server, got {sorted(map(str, origins))}")
        if max_connections < 0 or not request_timeout_s > 0:
            raise ValueError(f"need max_connections >= 0 and a positive request timeout, got {max_connections}, "
                             f"{request_timeout_s} s")
        (self._origin,) = origins
        self._heads = tuple(post_head(w.url, w.headers) for w in self._workloads)
        self._request_timeout_s = request_timeout_s
        self._max_connections = max_connections
        self._stream = array("B")
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
        """The first workload alone at `config.rate_per_s`."""
        (samples,) = await self.run_streams((config.rate_per_s,), config, snapshot, progress)
        return samples

    async def run_streams(self, rates_per_s: Sequence[float], config: LoadConfig,
                          snapshot: Snapshotter | None = None, progress: ProgressCallback | None = None,
                          ) -> list[RunSamples]:
        """Workload i at `rates_per_s[i]` (a rate of 0 sends nothing), all at once; one result per stream.

        `config.rate_per_s` is ignored; its duration, warm-up and seed apply to every stream.
        """
        if len(rates_per_s) > len(self._workloads):
            raise ValueError(f"{len(rates_per_s)} rates for {len(self._workloads)} workloads")
        offsets, streams, num_warmup, measured = _merged_schedule(rates_per_s, config)
        self._reset(len(offsets), streams)

        tasks: set[asyncio.Task[Any]] = set()  # the snapshots
        pool = HttpPool(self._origin, self._record, self._max_connections, self._request_timeout_s)
        with _frozen_heap():
            async with pool:
                cpu_start_s, wall_start_s = time.process_time(), time.perf_counter()
                start_s = wall_start_s + _START_DELAY_S
                send_at = array("d", (offsets + start_s).tolist())
                try:
                    before_task = await self._dispatch(pool, send_at, num_warmup, tasks, snapshot, progress)
                    await self._drain(progress)
                finally:  # only matters when the run itself is cancelled: leave nothing running
                    for task in tasks:
                        task.cancel()
        before = await before_task if before_task is not None else None
        after = await snapshot() if snapshot is not None else None
        server = server_delta(before, after) if before is not None and after is not None else None
        cpu_cores = (time.process_time() - cpu_start_s) / (time.perf_counter() - wall_start_s)

        measure_start_s = start_s + config.warmup_s
        in_stream = np.frombuffer(self._stream, dtype=np.uint8)[num_warmup:]
        sent = np.frombuffer(self._sent, dtype=np.float64)[num_warmup:]
        done = np.frombuffer(self._done, dtype=np.float64)[num_warmup:]
        status = np.frombuffer(self._status, dtype=np.int16)[num_warmup:]
        retry_after = np.frombuffer(self._retry_after, dtype=np.int8)[num_warmup:]
        results = []
        for stream, rate_per_s in enumerate(rates_per_s):
            mine = in_stream == stream
            results.append(RunSamples(
                rate_per_s=rate_per_s, duration_s=config.duration_s, scheduled_s=measured[stream],
                sent_s=sent[mine] - measure_start_s, latency_s=done[mine] - sent[mine],
                status=status[mine].copy(), has_retry_after=retry_after[mine].astype(bool),
                server=server,
                peak_in_flight=self._peak_in_flight, max_connections=self._max_connections,
                generator_cpu_cores=cpu_cores,
            ))
        return results

    def _reset(self, num_requests: int, streams: np.ndarray) -> None:
        # Flat typed arrays, not lists: the garbage collector never has to walk them.
        self._stream = array("B", streams.astype(np.uint8).tobytes())
        self._sent = array("d", [math.nan]) * num_requests
        self._done = array("d", [math.nan]) * num_requests
        self._status = array("h", [TRANSPORT_ERROR]) * num_requests
        self._retry_after = array("b", [0]) * num_requests
        self._num_sent = 0
        self._num_done = 0
        self._peak_in_flight = 0

    async def _dispatch(self, pool: HttpPool, send_at: array[float], num_warmup: int,
                        tasks: set[asyncio.Task[Any]], snapshot: Snapshotter | None,
                        progress: ProgressCallback | None) -> asyncio.Task[ServerSnapshot | None] | None:
        """Send every request at its scheduled time.

        Returns the task taking the first snapshot, started (and held in `tasks`) when measurement starts.
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
                self._send(pool, index)
                index += 1
                if index == num_warmup and snapshot is not None:
                    before_task = _spawn(loop, snapshot(), tasks)
            if progress is not None and now >= next_progress_s:
                progress(self._num_sent, self._num_done)
                next_progress_s = now + _PROGRESS_EVERY_S
            if index < num_requests:
                # Sleeping 0 still yields, so answers are read while we are behind.
                # Shorter sleeps would spin: uvloop rounds timers to whole milliseconds.
                delay_s = send_at[index] - time.perf_counter()
                await asyncio.sleep(max(delay_s, _MIN_SLEEP_S) if delay_s > 0 else 0)
        return before_task

    async def _drain(self, progress: ProgressCallback | None) -> None:
        """Wait until every request is answered or failed; the pool's timeout sweep bounds the wait."""
        self._drained = asyncio.Event()
        if self._num_done == len(self._done):
            self._drained.set()
        while not self._drained.is_set():
            await wait_event(self._drained, _PROGRESS_EVERY_S)
            if progress is not None:
                progress(self._num_sent, self._num_done)
        if progress is not None:
            progress(self._num_sent, self._num_done)
        self._drained = None

    def _send(self, pool: HttpPool, index: int) -> None:
        stream = self._stream[index]
        body = self._workloads[stream].body(index)
        self._num_sent += 1
        in_flight = self._num_sent - self._num_done
        if in_flight > self._peak_in_flight:
            self._peak_in_flight = in_flight
        sent_s = time.perf_counter()
        self._sent[index] = sent_s
        pool.send(index, post_request(self._heads[stream], body), sent_s)

    def _record(self, index: int, status: int, has_retry_after: bool) -> None:
        """The pool's callback: request `index` finished now (an answer or TRANSPORT_ERROR)."""
        self._done[index] = time.perf_counter()
        self._status[index] = status
        self._retry_after[index] = has_retry_after
        self._num_done += 1
        if self._drained is not None and self._num_done == len(self._done):
            self._drained.set()


def _merged_schedule(rates_per_s: Sequence[float], config: LoadConfig,
                     ) -> tuple[np.ndarray, np.ndarray, int, list[np.ndarray]]:
    """Every stream's arrivals in one sorted schedule.

    Returns (send offsets, stream of each send, number of warm-up sends, each stream's measured
    offsets). Warm-up sends all come before measured ones. Stream 0 draws from `seed` itself, so
    a single stream has the same schedule as before streams existed; stream i from (seed, i).
    """
    if len(rates_per_s) > 255 or any(r < 0 for r in rates_per_s) or not any(r > 0 for r in rates_per_s):
        raise ValueError(f"need 1-255 streams with non-negative rates, some positive: {list(rates_per_s)}")
    warmups, measured = [], []
    for stream, rate_per_s in enumerate(rates_per_s):
        rng = np.random.default_rng(config.seed if stream == 0 else [config.seed, stream])
        warmup = np.empty(0)
        if config.warmup_s > 0 and rate_per_s > 0:
            warmup = poisson_schedule(rate_per_s, config.warmup_s, rng)
        warmups.append(warmup)
        measured.append(poisson_schedule(rate_per_s, config.duration_s, rng) if rate_per_s > 0 else np.empty(0))
    offsets = np.concatenate([*warmups, *(m + config.warmup_s for m in measured)])
    labels = [np.full(len(part), stream, dtype=np.uint8) for parts in (warmups, measured)
              for stream, part in enumerate(parts)]
    streams = np.concatenate(labels)
    order = np.argsort(offsets, kind="stable")
    return offsets[order], streams[order], sum(len(w) for w in warmups), measured


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


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header that carries an API key to the server (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def new_session(request_timeout_s: float, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                headers: Mapping[str, str] | None = None) -> aiohttp.ClientSession:
    """The aiohttp session for a run's other requests (/metrics snapshots, metadata, streaming).

    Keep-alive connections, at most `max_connections` (0: no limit); `headers` go on every
    request (an API key). The load itself goes out through `LoadGenerator`'s own connections,
    not this session.
    """
    connector = aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=60, force_close=False,
                                     enable_cleanup_closed=False)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=request_timeout_s),
                                 skip_auto_headers=("User-Agent",), headers=headers)
