"""`http-single`: a fixed external inference API that takes one item per call, as a sluice device.

The scheduler still forms batches; this runner fans a batch out as concurrent HTTP calls:

    device thread                    call loop (its own thread, one aiohttp session)
    ─────────────                    ──────────────────────────────────────────────
    run_batch(items) ──submit──▶     gather(call(item) for item in items)
         (blocks)                      call: semaphore(concurrency) ─▶ breaker.allow()?
                                             ─▶ POST url {"input": item} ─▶ {"output": ...}
                                             5xx / timeout / connection error: back off, retry
    ◀──── one output or ItemFailure per item, in order

Contract (field names configurable with `input_field` / `output_field`): each item is POSTed as
`{"input": <item>}` — a string for a text item (OpenAI embeddings), a list of numbers for an
FP32 tensor row (KServe infer) — and the upstream answers `{"output": <number or list of numbers>}`.
Each call carries its request's W3C trace context (`traceparent`, `tracestate`): with tracing on,
the gateway's request span as its parent; with it off, the caller's own, passed on unchanged.

Failures are per item: an item whose calls all fail (5xx, 429, timeout, connection error) after
`max_attempts`, or that the upstream refuses with another 4xx (final, never retried), or that is
refused at once because the circuit breaker is open, becomes an `ItemFailure` saying why; the
rest of the batch is unaffected. Consecutive failed calls open the breaker (`sluice.circuit`).

Cost and latency: every item costs 1 (a call), so a batch's padded cost is its size. See
`upstream_prior` for how the linear latency profile is seeded from `expected_latency_ms`.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import numpy as np

from sluice import wire
from sluice.circuit import CircuitBreaker, CircuitConfig
from sluice.clock import MonotonicClock
from sluice.engines.base import ItemFailure, PreparedItem, Share, fp32_rows, rows_model_info, share_of, stack_rows
from sluice.engines.retry import RETRYABLE_4XX, backoff_delay_s
from sluice.errors import ConfigError
from sluice.repository import ModelVersion

__all__ = ["HttpSingleRunner", "UpstreamConfig", "backoff_delay_s", "parse_config", "upstream_prior"]

@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    url: str
    concurrency: int = 8
    """Most calls in flight to this upstream at once (also its connection pool size), from all the
    workers of one `sluice serve` together: each takes its part (`engines.base.share_of`)."""
    timeout_s: float = 5.0
    """Per call, counted from when the call gets a concurrency slot."""
    max_attempts: int = 3
    backoff_s: float = 0.05
    """Base of the exponential backoff with full jitter: attempt k waits U(0, backoff_s * 2**(k-1))."""
    max_backoff_s: float = 2.0
    expected_latency_s: float = 0.1
    """One call's latency, as the latency profile's prior."""
    input_field: str = "input"
    output_field: str = "output"
    output_dims: int | None = None
    """When set, an answer that is not a list of this many numbers fails its item (0: a number)."""
    warmup_input: Any = None
    """When set, warm-up sends this item a few times to measure the upstream; else no warm-up."""
    circuit: CircuitConfig = field(default_factory=CircuitConfig)


def parse_config(version: ModelVersion) -> UpstreamConfig:
    """Read `[params]`; raise ConfigError naming the model for anything missing or out of range."""
    p = version.params
    url = p.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"{version.name}: http-single needs params.url, an http(s) URL")
    try:
        dims = p.get("output_dims")
        config = UpstreamConfig(
            url=url,
            concurrency=int(p.get("concurrency", 8)),
            timeout_s=float(p.get("timeout_ms", 5000)) / 1000,
            max_attempts=int(p.get("max_attempts", 3)),
            backoff_s=float(p.get("backoff_ms", 50)) / 1000,
            max_backoff_s=float(p.get("max_backoff_ms", 2000)) / 1000,
            expected_latency_s=float(p.get("expected_latency_ms", 100)) / 1000,
            input_field=str(p.get("input_field", "input")),
            output_field=str(p.get("output_field", "output")),
            output_dims=None if dims is None else int(dims),
            warmup_input=p.get("warmup_input"),
            circuit=CircuitConfig(int(p.get("failure_threshold", 5)), float(p.get("open_s", 5.0))),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{version.name}: bad http-single parameter: {exc}") from exc
    if config.concurrency < 1 or config.max_attempts < 1 or not config.timeout_s > 0:
        raise ConfigError(f"{version.name}: concurrency, max_attempts and timeout_ms must be positive")
    if config.backoff_s < 0 or config.max_backoff_s < 0 or not config.expected_latency_s > 0:
        raise ConfigError(f"{version.name}: backoff must be >= 0 and expected_latency_ms positive")
    return config


def upstream_prior(latency_s: float, concurrency: int, max_batch_size: int) -> tuple[float, float, float]:
    """Seed the linear profile `alpha + beta * n` (n = batch size, each item costing 1).

    A batch of n items at concurrency c takes about ceil(n / c) call latencies L. When batches
    are no larger than c (the default), every batch is one round of calls: alpha = L, beta = 0,
    and the worker's per-item estimate alpha / max_batch_size = L / c is the upstream's
    throughput. Larger batches need several rounds; ceil(n / c) <= (n + c - 1) / c gives the
    line alpha = L (c - 1) / c, beta = L / c, exact when n = 1, c + 1, 2c + 1, ... and never
    below the truth, so admission errs on the side of meeting deadlines. Measured batches then
    refine both (tail latency makes a round of c calls slower than one call).
    """
    if max_batch_size <= concurrency:
        return latency_s, 0.0, 1.0
    return latency_s * (concurrency - 1) / concurrency, latency_s / concurrency, 1.0


@dataclass(frozen=True, slots=True)
class _Retry:
    reason: str


@dataclass(frozen=True, slots=True)
class _Final:
    reason: str
    is_upstream_fault: bool
    """An unusable answer (True) counts against the circuit; a refusal of the item (4xx) does not."""


_Attempt = np.ndarray | _Retry | _Final


class _CallLoop:
    """A persistent asyncio loop in a background thread, so the synchronous device thread can
    run coroutines on it. Owns the loop; `close()` stops it and joins the thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="http-single", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


class HttpSingleRunner:
    """The runner. `run_batch` blocks the device thread while the call loop fans the batch out;
    the breaker, semaphore, session and jitter source belong to the call loop's thread."""

    def __init__(self, version: ModelVersion, device: str, share: Share = (0, 1)) -> None:
        config = parse_config(version)
        self.config = replace(config, concurrency=share_of(config.concurrency, share))
        self.device = device
        self.max_batch_size = version.batching.max_batch_size
        self.info = rows_model_info(version)
        self.breaker = CircuitBreaker(self.config.circuit, MonotonicClock())  # used on the call loop only
        self._rng = random.Random(0)  # backoff jitter; call loop only
        self._calls = _CallLoop()
        self._semaphore, self._session = self._calls.run(self._open_session())

    async def _open_session(self) -> tuple[asyncio.Semaphore, aiohttp.ClientSession]:
        connector = aiohttp.TCPConnector(limit=self.config.concurrency, limit_per_host=self.config.concurrency)
        return asyncio.Semaphore(self.config.concurrency), aiohttp.ClientSession(connector=connector)

    def prior(self) -> tuple[float, float, float]:
        return upstream_prior(self.config.expected_latency_s, self.config.concurrency, self.max_batch_size)

    def warmup(self) -> list[tuple[int, float]]:
        """Optional: only with `warmup_input`, as calling an external API at start may cost money.
        Times a single call and a full round of calls, twice; failed rounds are left out."""
        sample = self.config.warmup_input
        if sample is None:
            return []
        item = PreparedItem(cost=1, data=sample if isinstance(sample, str) else np.asarray(sample, np.float32))
        timings = []
        for size in (1, min(self.config.concurrency, self.max_batch_size)) * 2:
            started = time.perf_counter()
            outputs = self.run_batch([item] * size)
            if not any(isinstance(output, ItemFailure) for output in outputs):
                timings.append((size, time.perf_counter() - started))
        return timings

    def prepare(self, payload: wire.Payload) -> list[PreparedItem]:
        if isinstance(payload, wire.TextPayload):
            return [PreparedItem(cost=1, data=text, num_tokens=max(1, len(text.split()))) for text in payload.texts]
        return [PreparedItem(cost=1, data=row) for row in fp32_rows(payload)]

    def run_batch(self, items: Sequence[PreparedItem]) -> list[np.ndarray | ItemFailure]:
        result: list[np.ndarray | ItemFailure] = self._calls.run(self._call_all(items))
        return result

    def pack(self, outputs: Sequence[np.ndarray]) -> wire.Payload:
        return stack_rows(outputs)

    def close(self) -> None:
        if self._calls.loop.is_closed():
            return
        self._calls.run(self._session.close(), timeout_s=5)
        self._calls.close()

    # -- the call loop -------------------------------------------------------------------------

    async def _call_all(self, items: Sequence[PreparedItem]) -> list[np.ndarray | ItemFailure]:
        return list(await asyncio.gather(*(self._call_item(item) for item in items)))

    async def _call_item(self, item: PreparedItem) -> np.ndarray | ItemFailure:
        data = item.data if isinstance(item.data, str) else item.data.tolist()
        body = json.dumps({self.config.input_field: data}).encode()
        reason = ""
        for attempt in range(1, self.config.max_attempts + 1):
            async with self._semaphore:
                if not self.breaker.allow():
                    return ItemFailure(
                        f"upstream unavailable: circuit open after repeated failures "
                        f"(next trial in {self.breaker.retry_after_s():.1f} s)"
                        + (f"; last error: {reason}" if reason else ""),
                        is_transient=True,
                    )
                outcome = await self._attempt(body, item.trace)
            if isinstance(outcome, np.ndarray):
                return outcome
            if isinstance(outcome, _Final):
                return ItemFailure(outcome.reason)
            reason = outcome.reason
            if attempt < self.config.max_attempts:
                cfg = self.config
                await asyncio.sleep(backoff_delay_s(attempt, cfg.backoff_s, cfg.max_backoff_s, self._rng))
        return ItemFailure(f"upstream failed after {self.config.max_attempts} attempts: {reason}", is_transient=True)

    async def _attempt(self, body: bytes, trace: wire.TraceContext | None = None) -> _Attempt:
        """One call. Records its outcome with the breaker: a 5xx, 408/429, timeout, connection
        error or unusable answer is a failure; any other answer (a 4xx included) shows the
        upstream is up. Recorded even when the call raises or is cancelled, so that a half-open
        breaker never waits forever for its trial."""
        outcome: _Attempt = _Retry("call abandoned")
        try:
            outcome = await self._post(body, trace)
        finally:
            if isinstance(outcome, np.ndarray) or (isinstance(outcome, _Final) and not outcome.is_upstream_fault):
                self.breaker.record_success()
            else:
                self.breaker.record_failure()
        return outcome

    async def _post(self, body: bytes, trace: wire.TraceContext | None = None) -> _Attempt:
        """`trace`: the item's request's W3C trace context, sent as `traceparent` and `tracestate`."""
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        headers = {"Content-Type": "application/json", **(trace.headers() if trace is not None else {})}
        try:
            async with self._session.post(self.config.url, data=body, headers=headers, timeout=timeout) as response:
                status, text = response.status, await response.text(errors="replace")
        except TimeoutError:
            return _Retry(f"timed out after {self.config.timeout_s * 1000:.0f} ms")
        except aiohttp.ClientError as exc:
            return _Retry(f"connection error: {type(exc).__name__}: {exc}")
        if status >= 500 or status in RETRYABLE_4XX:
            return _Retry(f"HTTP {status}")
        if status >= 400:
            return _Final(f"upstream rejected the item: HTTP {status}: {text[:200]}", is_upstream_fault=False)
        return self._parse(status, text)

    def _parse(self, status: int, text: str) -> np.ndarray | _Final:
        name = self.config.output_field
        try:
            value = json.loads(text)[name]
            output = np.asarray(value, dtype=np.float32)
        except (ValueError, TypeError, KeyError, IndexError, RecursionError):
            return _Final(f"upstream answered HTTP {status} without a numeric {name!r}", is_upstream_fault=True)
        dims = self.config.output_dims
        expected = None if dims is None else (dims,) if dims else ()
        if output.ndim > 1 or (expected is not None and output.shape != expected):
            wanted = "a number or a list of numbers" if expected is None else f"shape {list(expected)}"
            return _Final(f"upstream answered {name!r} with shape {list(output.shape)}, expected {wanted}",
                          is_upstream_fault=True)
        if not np.all(np.isfinite(output)):
            return _Final(f"upstream answered {name!r} with NaN or infinite values", is_upstream_fault=True)
        return output
