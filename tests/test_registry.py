"""The worker registry against a real Redis: workers come, withdraw, or die and expire."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis

from sluice.registry import PREFIX, RegistryWatcher, WorkerRegistration, registered_workers
from tests.conftest import until


@pytest.fixture
def registry_url(redis_url: str) -> str:
    url = redis_url.rsplit("/", 1)[0] + "/5"  # a database of its own: the registry's keys are fixed
    redis.Redis.from_url(url).flushdb()
    return url


def test_gateways_see_workers_join_withdraw_and_expire(registry_url: str) -> None:
    async def scenario() -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []

        async def add(worker_id: str, address: str) -> None:
            events.append(("add", worker_id))

        async def remove(worker_id: str) -> None:
            events.append(("remove", worker_id))

        # b renews every TTL / 5 = 0.3 s (a host stall shorter than 1.2 s cannot expire it); a's TTL
        # is long, so that its removal within seconds of withdrawing can only be the withdrawal,
        # however long a busy host takes to show it
        a = WorkerRegistration(registry_url, "a", "tcp://10.0.0.1:7000", ttl_s=60.0)
        b = WorkerRegistration(registry_url, "b", "tcp://10.0.0.2:7000", ttl_s=1.5)
        a.start()
        await asyncio.sleep(0.05)
        watcher = RegistryWatcher(registry_url, add, remove, poll_s=0.05)
        await watcher.start()  # knows a at once
        assert events == [("add", "a@tcp://10.0.0.1:7000")]
        b.start()
        await until(lambda: len(watcher.workers) == 2)
        await asyncio.sleep(2.0)  # longer than b's TTL: its renewals keep it
        assert set(watcher.workers) == {"tcp://10.0.0.1:7000", "tcp://10.0.0.2:7000"}
        a.withdraw()  # a drains: its entry goes at once
        await until(lambda: events[-1][0] == "remove", timeout_s=15.0)  # long before its TTL
        assert events[-1] == ("remove", "a@tcp://10.0.0.1:7000")
        assert b._task is not None
        b._task.cancel()  # b dies without a word: its entry expires
        await until(lambda: len(events) == 4, timeout_s=10.0)
        assert events[-1] == ("remove", "b@tcp://10.0.0.2:7000")
        assert await registered_workers(watcher._redis) == {}
        await watcher.aclose()
        await b.aclose()
        return events

    events = asyncio.run(scenario())
    assert [kind for kind, _ in events] == ["add", "add", "remove", "remove"]


def test_a_registry_that_cannot_be_reached_keeps_the_workers_known(registry_url: str) -> None:
    async def scenario() -> None:
        removed: list[str] = []

        async def add(worker_id: str, address: str) -> None:
            pass

        async def remove(worker_id: str) -> None:
            removed.append(worker_id)

        redis.Redis.from_url(registry_url).set(PREFIX + "tcp://10.0.0.3:7000", "c")
        watcher = RegistryWatcher(registry_url, add, remove)
        await watcher.start()
        assert list(watcher.workers) == ["tcp://10.0.0.3:7000"]
        watcher._redis = redis.asyncio.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
        await watcher.refresh()  # Redis away: nothing removed
        assert removed == [] and list(watcher.workers) == ["tcp://10.0.0.3:7000"]
        await watcher.aclose()

    asyncio.run(scenario())


def test_a_worker_told_to_drain_before_it_listens_never_registers(registry_url: str) -> None:
    async def scenario() -> None:
        registration = WorkerRegistration(registry_url, "a", "tcp://10.0.0.4:7000", ttl_s=1.0)
        registration.withdraw()  # SIGTERM while the models were still loading
        await asyncio.sleep(0.1)
        registration.start()  # then the listener came up
        await asyncio.sleep(0.3)
        try:
            assert redis.Redis.from_url(registry_url).keys(PREFIX + "*") == []
            assert registration._task is None
        finally:
            if registration._task is not None:
                registration._task.cancel()
            await registration.aclose()

    asyncio.run(scenario())


def test_a_worker_that_withdraws_while_renewing_stops_renewing(registry_url: str) -> None:
    """redis-py writes through Python 3.11's `asyncio.wait_for`, which loses a cancellation arriving
    as the write completes: the renewal went on, `aclose()` never returned and the worker never
    exited after SIGTERM (a CI run caught it once in ~2,200 tests). Renewing every 2 ms and
    withdrawing at random instants hits that instant within a few hundred tries."""
    async def scenario() -> int:
        rng = random.Random(7)
        client = redis.asyncio.Redis.from_url(registry_url)
        hung = 0
        for i in range(300):
            registration = WorkerRegistration(registry_url, "a", f"tcp://10.0.0.5:{7000 + i}", ttl_s=0.01)
            registration.start()
            await asyncio.sleep(rng.uniform(0, 0.004))
            try:
                async with asyncio.timeout(2.0):
                    await registration.aclose()
            except TimeoutError:
                hung += 1
                renewing = registration._task
                assert renewing is not None
                while not renewing.done():  # cancel it until it ends, so that the test can report
                    renewing.cancel()
                    await asyncio.wait([renewing], timeout=0.1)
        assert await client.keys(PREFIX + "*") == []
        await client.aclose()
        return hung

    assert asyncio.run(scenario()) == 0
