"""Result-cache entries shared by every gateway, kept in Redis.

    sluice:cache:<key hex>   the msgpack of a `CachedResult`, expiring after the cache's TTL

Redis's own eviction (`maxmemory-policy allkeys-lru` on a Redis given to caching) bounds the
shared store's size. A cache must never fail or slow down a request: a read that fails or takes
longer than `timeout_s` is a miss, writes are sent in the background, and after a failure a
circuit breaker stops calling Redis for a while (`REDIS_CIRCUIT`), so an outage costs one
timeout per `open_s`, not one per request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
import redis.asyncio as redis
from redis.exceptions import RedisError

from sluice.circuit import CircuitBreaker, CircuitConfig
from sluice.clock import Clock, MonotonicClock
from sluice.gateway.cache import CachedResult

__all__ = ["RedisCacheStore"]

log = logging.getLogger("sluice.gateway.cache")

REDIS_CIRCUIT = CircuitConfig(failure_threshold=1, open_s=5.0)
MAX_PENDING_WRITES = 1024
"""Writes in the background at once; beyond it new entries are not shared (they are still kept locally)."""


class RedisCacheStore:
    def __init__(self, client: redis.Redis, ttl_s: float, *, prefix: str = "sluice:cache", timeout_s: float = 0.25,
                 clock: Clock | None = None, circuit: CircuitConfig = REDIS_CIRCUIT,
                 on_error: Callable[[], None] | None = None) -> None:
        self._client = client
        self._ttl_ms = max(int(ttl_s * 1000), 1)
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._breaker = CircuitBreaker(circuit, clock or MonotonicClock())
        self._decoder = msgspec.msgpack.Decoder(CachedResult)
        self._encoder = msgspec.msgpack.Encoder()
        self._writes: set[asyncio.Task[None]] = set()
        self._on_error = on_error

    @classmethod
    def from_url(cls, url: str, ttl_s: float, on_error: Callable[[], None] | None = None) -> RedisCacheStore:
        return cls(redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0), ttl_s,
                   on_error=on_error)

    async def ping(self) -> None:
        """Raises `RedisError` if Redis cannot be reached (checked once at start)."""
        await self._client.ping()

    async def get(self, key: bytes) -> CachedResult | None:
        if not self._breaker.allow():
            return None
        try:
            async with asyncio.timeout(self._timeout_s):  # not wait_for: it can swallow a client's disconnect
                raw = await self._client.get(self._name(key))
        except (RedisError, TimeoutError, OSError) as exc:
            self._failed(exc)
            return None
        self._breaker.record_success()
        if raw is None:
            return None
        try:
            return self._decoder.decode(raw)
        except msgspec.DecodeError:  # written by another version of sluice: not ours to read
            return None

    def put(self, key: bytes, value: CachedResult) -> None:
        if len(self._writes) >= MAX_PENDING_WRITES or not self._breaker.allow():
            return
        task = asyncio.get_running_loop().create_task(self._write(self._name(key), self._encoder.encode(value)))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, name: str, data: bytes) -> None:
        try:
            async with asyncio.timeout(self._timeout_s * 4):
                await self._client.set(name, data, px=self._ttl_ms)
        except (RedisError, TimeoutError, OSError) as exc:
            self._failed(exc)
            return
        self._breaker.record_success()

    def _failed(self, exc: BaseException) -> None:
        self._breaker.record_failure()
        if self._on_error is not None:
            self._on_error()
        log.warning("result cache: Redis call failed (%s); not using it for %.0f s",
                    exc or type(exc).__name__, self._breaker.retry_after_s())

    def _name(self, key: bytes) -> str:
        return f"{self._prefix}:{key.hex()}"

    async def aclose(self) -> None:
        if self._writes:
            await asyncio.wait(self._writes, timeout=1.0)
        await self._client.aclose()
