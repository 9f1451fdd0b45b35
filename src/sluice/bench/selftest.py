"""How fast can the generator itself send? Measured against a null server in another process.

Two measurements, on the same machine the real benchmark runs on:

1. closed loop: `concurrency` connections each send the next request as soon as the previous
   one is answered; requests per second is the generator's ceiling on this machine.
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

import aiohttp

from sluice.bench.loadgen import LoadConfig, LoadGenerator, new_session
from sluice.bench.stats import MAX_LAG_P99_MS, RateResult, summarize
from sluice.bench.workloads import Endpoint, InputSpec, Workload, build_workload

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
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()


async def closed_loop(workload: Workload, concurrency: int, duration_s: float, warmup_s: float = 1.0,
                      request_timeout_s: float = 10.0) -> ClosedLoopResult:
    """Keep `concurrency` requests in flight for `warmup_s + duration_s`; count the measured part."""
    if concurrency < 1 or duration_s <= 0:
        raise ValueError(f"need concurrency ≥ 1 and a positive duration, got {concurrency}, {duration_s} s")
    counts = [0, 0]  # ok, errors: during measurement only
    cpu_at_s = [0.0, 0.0]  # process time at the start and at the end of measurement
    async with new_session(request_timeout_s) as session:
        start_s = time.perf_counter()
        measure_from_s = start_s + warmup_s
        stop_s = measure_from_s + duration_s

        async def client(client_index: int) -> None:
            index = client_index
            url, headers = workload.url, workload.headers
            while (now := time.perf_counter()) < stop_s:
                try:
                    async with session.post(url, data=workload.body(index), headers=headers) as response:
                        await response.read()
                        is_ok = response.status == 200
                except (aiohttp.ClientError, TimeoutError, OSError):
                    is_ok = False
                if now >= measure_from_s:
                    counts[0 if is_ok else 1] += 1
                index += concurrency

        async def clock() -> None:
            await asyncio.sleep(warmup_s)
            cpu_at_s[0] = time.process_time()
            await asyncio.sleep(duration_s)
            cpu_at_s[1] = time.process_time()

        await asyncio.gather(clock(), *(client(i) for i in range(concurrency)))
    return ClosedLoopResult(concurrency, duration_s, counts[0], counts[1], cpu_at_s[1] - cpu_at_s[0])


async def run_self_test(concurrency: int, duration_s: float, open_loop_rates_per_s: Sequence[float] = (),
                        max_lag_p99_ms: float = MAX_LAG_P99_MS) -> SelfTestResult:
    async with null_server() as url:
        workload = build_workload(Endpoint.KSERVE, url, "null", 16, None, InputSpec("INPUT0", "FP32"))
        closed = await closed_loop(workload, concurrency, duration_s)
        open_results = []
        async with new_session(request_timeout_s=10.0) as session:
            generator = LoadGenerator(session, workload)
            for rate_per_s in open_loop_rates_per_s:
                samples = await generator.run(LoadConfig(rate_per_s, duration_s, warmup_s=1.0))
                open_results.append(summarize(samples, max_lag_p99_ms))
    return SelfTestResult(closed, tuple(open_results))
