"""A real PostgreSQL that restarts mid-job: while it is down store calls fail soon with
`Unavailable` (a 503 to API clients); once it is back the store reconnects at once and the job goes
on, with every item run once and answered once (`jobs.postgres_store`, `jobs.executor`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from sluice.errors import ConfigError, Unavailable
from sluice.jobs.executor import ExecutorConfig, JobExecutor
from sluice.jobs.postgres_store import PostgresJobStore
from sluice.jobs.store import BatchJob, NewBatch
from tests.conftest import PostgresServer
from tests.jobs.test_executor import answered_model_query


class GatedApp:
    """Answers every item 200, once `gate` opens; counts the calls per item."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.gate = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        if await answered_model_query(scope, send):
            return
        text = json.loads((await receive())["body"])["input"]
        self.calls[text] += 1
        await self.gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"object": "list", "data": []}'})


@pytest.fixture
async def store(own_postgres: PostgresServer) -> AsyncIterator[PostgresJobStore]:
    opened = await PostgresJobStore.connect(f"{own_postgres.url}/postgres")
    yield opened
    await opened.aclose()


async def _start_job(store: PostgresJobStore, num_items: int) -> str:
    content = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings",
                                    "body": {"model": "m", "input": f"t{i}"}}) for i in range(num_items))
    file = await store.create_file("acme", "in.jsonl", "batch", content.encode(), 0)
    return (await store.create_batch(NewBatch("acme", "/v1/embeddings", file.id, "24h", None, 0, 2**40))).id


async def _final(store: PostgresJobStore, batch_id: str, timeout_s: float) -> BatchJob:
    """The batch once it is no longer active; a store call failing meanwhile counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            found = await store.get_batch(None, batch_id)
            if found is not None and not found.is_active:
                return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"batch {batch_id} did not finish within {timeout_s} s of the database coming back")


async def _until(condition, timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def _output_ids(store: PostgresJobStore, batch: BatchJob) -> list[str]:
    content = await store.file_content("acme", batch.output_file_id or "") or b""
    return [json.loads(line)["custom_id"] for line in content.splitlines()]


async def test_outcomes_of_several_leases_finished_during_an_outage_are_all_recorded(
        store: PostgresJobStore, own_postgres: PostgresServer):
    """Items of five claims finish while the database is down: once it is back, every outcome is
    recorded (none dropped with the first failed write, its items held until their lease ran out)."""
    num_items = 40
    app = GatedApp()
    batch_id = await _start_job(store, num_items)
    executor = JobExecutor(store, ExecutorConfig(claim_size=8, max_in_flight=num_items, poll_interval_s=0.05,
                                                 flush_interval_s=0.01))
    await executor.start(app)
    try:
        await _until(lambda: sum(app.calls.values()) == num_items)  # every item running, in five leases
        await asyncio.to_thread(own_postgres.stop)
        app.gate.set()  # they finish while their outcomes cannot be written...
        await asyncio.sleep(8.0)  # ...and the writes fail (a connection is waited for 5 s at most)
        await asyncio.to_thread(own_postgres.start)
        done = await _final(store, batch_id, timeout_s=30.0)  # the leases last 60 s: not a wait for them
    finally:
        await executor.aclose()
    assert done.status == "completed" and done.num_completed == num_items
    assert sorted(await _output_ids(store, done)) == sorted(f"c{i}" for i in range(num_items))
    assert set(app.calls.values()) == {1}, "items ran more than once"


async def test_leases_that_lapse_during_an_outage_are_renewed_before_anything_is_claimed(
        store: PostgresJobStore, own_postgres: PostgresServer):
    """The database is down when the leases are due for renewal, and stays down until they have
    run out: once it is back they are renewed before the next claim, so no item still running is
    claimed (and run) a second time."""
    num_items, lease_s = 8, 16.0
    app = GatedApp()
    batch_id = await _start_job(store, num_items)
    executor = JobExecutor(store, ExecutorConfig(claim_size=num_items, max_in_flight=64, lease_s=lease_s,
                                                 poll_interval_s=0.05, flush_interval_s=0.01))
    await executor.start(app)
    try:
        await _until(lambda: sum(app.calls.values()) == num_items)
        claimed_at = time.monotonic()
        await asyncio.sleep(lease_s / 4)
        await asyncio.to_thread(own_postgres.stop)
        # renewals are due from lease_s / 2 and fail; back a while after the leases ran out...
        await asyncio.sleep(max(claimed_at + lease_s + 4.0 - time.monotonic(), 0))
        await asyncio.to_thread(own_postgres.start)
        await asyncio.sleep(3.0)  # ...for the executor, which looks for work every 0.05 s, to find them
        calls = dict(app.calls)
        app.gate.set()
        done = await _final(store, batch_id, timeout_s=30.0)
    finally:
        await executor.aclose()
    assert set(calls.values()) == {1}, f"items still running were claimed and run again: {calls}"
    assert done.status == "completed" and sorted(await _output_ids(store, done)) == sorted(
        f"c{i}" for i in range(num_items))


async def test_the_store_answers_unavailable_while_its_database_is_down_and_reconnects_at_once(
        store: PostgresJobStore, own_postgres: PostgresServer):
    """Down for 20 s: each call fails soon with `Unavailable` (a 503 to API clients), not after
    the pool's 30 s queue with a foreign error; back, the store reconnects within seconds, not at
    the next step of psycopg_pool's exponential backoff (tries 1, 3, 7, 15, 31, 63 s after the
    loss, +-10%: the next after 20 s comes ~10 s after the database is back)."""
    await store.active_batches()
    await asyncio.to_thread(own_postgres.stop)
    down_at = time.monotonic()
    while time.monotonic() - down_at < 20.0:
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
        assert time.monotonic() - back_at < 6.0, "the store did not reconnect within 6 s of its database's return"
        await asyncio.sleep(0.1)


async def test_a_database_down_at_start_is_waited_for_then_named_in_the_error(own_postgres: PostgresServer):
    """`sluice serve --jobs-db` with its database down: it is tried for a while (one started
    beside the server may come up after it), then the error says why it cannot be reached, not
    only that psycopg's pool did not fill."""
    await asyncio.to_thread(own_postgres.stop)
    with pytest.raises(ConfigError) as raised:
        await PostgresJobStore.connect(f"{own_postgres.url}/postgres", open_timeout_s=2.0)
    assert "Connection refused" in raised.value.message and str(own_postgres.port) in raised.value.message
    starting = asyncio.create_task(asyncio.to_thread(lambda: (time.sleep(2.0), own_postgres.start())))
    store = await PostgresJobStore.connect(f"{own_postgres.url}/postgres")
    await starting
    assert await store.active_batches() == []
    await store.aclose()


class StoringHeldStore(PostgresJobStore):
    """Holds `add_items` (storing a batch's items after its first ones) until `may_store` is set, so
    that the outage comes while items remain to be stored."""

    may_store: asyncio.Event
    storing: asyncio.Event

    async def add_items(self, batch_id, items) -> None:  # type: ignore[no-untyped-def]
        self.storing.set()
        await self.may_store.wait()
        await super().add_items(batch_id, items)


async def test_an_outage_is_logged_when_it_begins_and_ends_not_at_every_round(
        own_postgres: PostgresServer, caplog: pytest.LogCaptureFixture):
    """The database is down for several seconds while the batch executor (a round every 0.05 s),
    its items' storing (a try a second) and the background responses' housekeeping (a round every
    0.2 s) all call the store: each says so once as the outage begins (its one-line reason, no
    traceback) and once when it ends, not a line or a traceback at every round."""
    from sluice.jobs.background import BackgroundResponses

    store = await StoringHeldStore.connect(f"{own_postgres.url}/postgres")
    store.may_store, store.storing = asyncio.Event(), asyncio.Event()
    app = GatedApp()
    app.gate.set()
    batch_id = await _start_job(store, 4)
    executor = JobExecutor(store, ExecutorConfig(first_load_size=1, load_chunk_size=1, poll_interval_s=0.05,
                                                 flush_interval_s=0.01))
    background = BackgroundResponses(store, check_s=0.2)
    caplog.set_level("INFO", logger="sluice.jobs")
    await executor.start(app)
    await background.start(app)
    try:
        await _until(store.storing.is_set)  # the first item runs; the others wait to be stored
        caplog.clear()
        await asyncio.to_thread(own_postgres.stop)
        store.may_store.set()
        await asyncio.sleep(6.0)
        await asyncio.to_thread(own_postgres.start)
        done = await _final(store, batch_id, timeout_s=30.0)
        for _ in range(300):  # each loop's next round after the return says it
            if sum("reachable again after" in r.getMessage() for r in caplog.records) >= 3:
                break
            await asyncio.sleep(0.1)
    finally:
        await background.aclose()
        await executor.aclose()
        await store.aclose()
    assert done.status == "completed" and done.num_completed == 4
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info]
    assert not tracebacks, f"{len(tracebacks)} tracebacks logged during the outage: {Counter(tracebacks)}"
    said = Counter((r.levelname, r.getMessage().partition(": the job store")[0]) for r in caplog.records
                   if ": the job store " in r.getMessage())  # (the store's own lines say "the job store's")
    loops = ("batch jobs", "batch jobs: validating and storing items", "background responses")
    assert said == {**{("WARNING", loop): 1 for loop in loops}, **{("INFO", loop): 1 for loop in loops}}, said
