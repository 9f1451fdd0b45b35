"""How fast can the generator itself send? Measured against a null server in another process.

Two measurements, on the same machine the real benchmark runs on:

1. closed loop: `concurrency` connections each send the next request as soon as the previous
   one is answered, over the generator's own client; requests per second is the generator's
   ceiling on this machine.
2. open loop (optional): the real generator at target rates; its achieved send rate and lag
   say whether it can offer that rate without falling behind.

The null server (`sluice.bench.nullserver`) does almost no work, so both numbers are about the
client. On a small machine the two processes still share the CPU, as they would with a real
server: the numbers are a floor, not a flattering best case.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from sluice.bench.http_client import HttpPool, post_head, post_request, split_url
from sluice.bench.loadgen import LoadConfig, LoadGenerator
from sluice.bench.stats import MAX_LAG_P99_MS, RateResult, summarize
from sluice.bench.workloads import Endpoint, InputSpec, Workload, build_workload
from sluice.tasks import stop_process

_READY_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class ClosedLoopResult:
    concurrency: int
    duration_s: float
    num_ok: int
    num_errors: int
    cpu_s: float
    """CPU time the generator's process used while measuring."""

    @property
    def requests_per_s(self) -> float:
        return self.num_ok / self.duration_s

    @property
    def cpu_us_per_request(self) -> float:
        """The generator's cost per request: its ceiling on an idle core is 1e6 / this."""
        return 1e6 * self.cpu_s / max(1, self.num_ok + self.num_errors)


@dataclass(frozen=True, slots=True)
class SelfTestResult:
    closed_loop: ClosedLoopResult
    open_loop: tuple[RateResult, ...]


@contextlib.asynccontextmanager
async def null_server() -> AsyncIterator[str]:
    """Run the null server in a child process for the duration of the block; yields its base URL."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sluice.bench.nullserver", "--port", "0",
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), _READY_TIMEOUT_S)
        if not line.strip().isdigit():
            raise RuntimeError(f"the null server did not report its port (got {line!r})")
        yield f"http://127.0.0.1:{int(line)}"
    finally:
        await stop_process(process, 10)


async def closed_loop(workload: Workload, concurrency: int, duration_s: float, warmup_s: float = 1.0,
                      request_timeout_s: float = 10.0) -> ClosedLoopResult:
    """Keep `concurrency` requests in flight for `warmup_s + duration_s`; count the answers in the measured part.

    Uses the generator's own client (`HttpPool`, one connection per request in flight): each answer
    sends the next request from the pool's callback, so this measures what the open-loop
    generator pays per request, minus its scheduling.
    """
    if concurrency < 1 or duration_s <= 0:
        raise ValueError(f"need concurrency ≥ 1 and a positive duration, got {concurrency}, {duration_s} s")
    origin, _ = split_url(workload.url)
    head = post_head(workload.url, workload.headers)
    measure_from_s = time.perf_counter() + warmup_s
    stop_s = measure_from_s + duration_s
    clients = _ClosedLoop(head, workload, measure_from_s, stop_s)
    async with HttpPool(origin, clients.on_done, concurrency, request_timeout_s) as pool:
        clients.pool = pool
        for _ in range(concurrency):
            clients.send_next()
        await asyncio.sleep(max(0.0, measure_from_s - time.perf_counter()))
        cpu_start_s = time.process_time()
        await asyncio.sleep(max(0.0, stop_s - time.perf_counter()))
        cpu_s = time.process_time() - cpu_start_s
        # Every request gets its callback within the timeout (plus one sweep), so this ends.
        await asyncio.wait_for(clients.finished.wait(), request_timeout_s + 1.0)
    return ClosedLoopResult(concurrency, duration_s, clients.num_ok, clients.num_errors, cpu_s)


class _ClosedLoop:
    """The closed loop's state: every answer before `stop_s` sends the next request."""

    def __init__(self, head: bytes, workload: Workload, measure_from_s: float, stop_s: float) -> None:
        self.pool: HttpPool | None = None
        self._head = head
        self._workload = workload
        self._measure_from_s = measure_from_s
        self._stop_s = stop_s
        self._next_index = 0
        self._num_in_flight = 0
        self.num_ok = 0
        self.num_errors = 0
        self.finished = asyncio.Event()

    def send_next(self) -> None:
        assert self.pool is not None
        index, self._next_index = self._next_index, self._next_index + 1
        self._num_in_flight += 1
        self.pool.send(index, post_request(self._head, self._workload.body(index)), time.perf_counter())

    def on_done(self, index: int, status: int, has_retry_after: bool) -> None:
        self._num_in_flight -= 1
        now = time.perf_counter()
        if self._measure_from_s <= now < self._stop_s:
            if status == 200:
                self.num_ok += 1
            else:
                self.num_errors += 1
        if now < self._stop_s:
            self.send_next()
        elif self._num_in_flight == 0:
            self.finished.set()


async def run_self_test(concurrency: int, duration_s: float, open_loop_rates_per_s: Sequence[float] = (),
                        max_lag_p99_ms: float = MAX_LAG_P99_MS) -> SelfTestResult:
    async with null_server() as url:
        workload = build_workload(Endpoint.KSERVE, url, "null", 16, None, InputSpec("INPUT0", "FP32"))
        closed = await closed_loop(workload, concurrency, duration_s)
        open_results = []
        generator = LoadGenerator(workload, request_timeout_s=10.0)
        for rate_per_s in open_loop_rates_per_s:
            samples = await generator.run(LoadConfig(rate_per_s, duration_s, warmup_s=1.0))
            open_results.append(summarize(samples, max_lag_p99_ms))
    return SelfTestResult(closed, tuple(open_results))
