"""The shared result store against a real Redis, and what it does when Redis is away."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as redis

from sluice import wire
from sluice.clock import VirtualClock
from sluice.gateway.cache import CachedResult
from sluice.gateway.shared_cache import RedisCacheStore
from tests.conftest import free_port

VALUE = CachedResult(wire.TextPayload(["stored"]), 5)


async def _settled(store: RedisCacheStore) -> None:
    await asyncio.sleep(0)
    for _ in range(100):
        if not store._writes:
            return
        await asyncio.sleep(0.01)


async def test_entries_are_shared_and_expire(redis_url: str) -> None:
    writer = RedisCacheStore(redis.Redis.from_url(redis_url), ttl_s=0.3, prefix="test-shared-cache")
    reader = RedisCacheStore(redis.Redis.from_url(redis_url), ttl_s=0.3, prefix="test-shared-cache")
    try:
        writer.put(b"key", VALUE)
        await _settled(writer)
        assert await reader.get(b"key") == VALUE
        assert await reader.get(b"other") is None
        await asyncio.sleep(0.4)
        assert await reader.get(b"key") is None
    finally:
        await writer.aclose()
        await reader.aclose()


async def test_unreadable_entries_are_misses(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    store = RedisCacheStore(client, ttl_s=60, prefix="test-shared-cache-bad")
    try:
        await client.set(f"test-shared-cache-bad:{b'key'.hex()}", b"\x93not a cached result")
        assert await store.get(b"key") is None
    finally:
        await store.aclose()


async def test_a_redis_that_is_away_is_a_miss_and_is_not_called_again_at_once() -> None:
    errors: list[None] = []
    clock = VirtualClock()
    client = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.2)
    store = RedisCacheStore(client, ttl_s=60, clock=clock, on_error=lambda: errors.append(None))
    try:
        assert await store.get(b"key") is None
        assert len(errors) == 1
        store.put(b"key", VALUE)  # the circuit is open: not even tried
        assert await store.get(b"key") is None and len(errors) == 1
        clock.advance(6.0)
        assert await store.get(b"key") is None and len(errors) == 2  # one trial after open_s
    finally:
        await store.aclose()


@pytest.fixture(autouse=True)
def _quiet_cache_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="sluice.gateway.cache")
