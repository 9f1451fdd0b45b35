"""The job store on a real PostgreSQL that restarts: while it is down calls fail soon with
`Unavailable` (a 503 to API clients), and once it is back they succeed again at once
(`jobs.postgres_store`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from sluice.errors import Unavailable
from sluice.jobs.postgres_store import PostgresJobStore
from tests.conftest import PostgresServer


@pytest.fixture
async def store(own_postgres: PostgresServer) -> AsyncIterator[PostgresJobStore]:
    opened = await PostgresJobStore.connect(f"{own_postgres.url}/postgres")
    yield opened
    await opened.aclose()


async def test_the_store_answers_unavailable_while_its_database_is_down_and_reconnects_at_once(
        store: PostgresJobStore, own_postgres: PostgresServer):
    """Down for 35 s: each call fails soon with `Unavailable` (a 503 to API clients), not after
    the pool's 30 s queue with a foreign error; back, the store reconnects within seconds, not at
    the next step of an exponential backoff (1, 3, 7, 15, 31, 63 s after the loss: ~30 s later)."""
    await store.active_batches()
    await asyncio.to_thread(own_postgres.stop)
    down_at = time.monotonic()
    while time.monotonic() - down_at < 35.0:
        with pytest.raises(Unavailable) as raised:
            async with asyncio.timeout(15.0):  # the pool waits 30 s for a connection
                await store.list_files("acme", None, None, 10)
        assert raised.value.retry_after_s is not None and raised.value.retry_after_s > 0
        await asyncio.sleep(1.0)
    await asyncio.to_thread(own_postgres.start)
    back_at = time.monotonic()
    while True:
        with contextlib.suppress(Unavailable):
            await store.list_files("acme", None, None, 10)
            break
        assert time.monotonic() - back_at < 15.0, "the store did not reconnect within 15 s of its database's return"
        await asyncio.sleep(0.1)
