"""A batch's statuses as a client sees them: finalizing, expiry, storing items while the first run,
and resuming each step after a crash. A real SQLite store, the real executor and the real API routes;
a small scripted ASGI app stands in for the serving core."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
from prometheus_client import REGISTRY
from starlette.applications import Starlette

from sluice.api import batches
from sluice.jobs.executor import ExecutorConfig, JobExecutor
from sluice.jobs.sqlite_store import SqliteJobStore
from sluice.jobs.store import BatchJob, BatchStatus, ItemOutcome, NewBatch, NewItem
from tests.jobs.test_executor import FAST, ScriptedApp, _line, answered_model_query


class HangingApp(ScriptedApp):
    """Like ScriptedApp, but items whose input is "hang" wait until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        if await answered_model_query(scope, send):
            return
        message = await receive()
        if json.loads(message["body"])["input"] == "hang":
            self.calls["hang"] += 1
            await self.release.wait()
            self.calls["hang"] -= 1  # ScriptedApp counts it again

        async def replay():
            return message

        await super().__call__(scope, replay, send)


class PausingStore(SqliteJobStore):
    """Holds `finalize` (writing the files) until the test lets it go, and can slow `add_items` down."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.in_finalize = asyncio.Event()
        self.may_finalize = asyncio.Event()
        self.may_add_items = asyncio.Event()
        self.may_add_items.set()

    async def finalize(self, *args) -> BatchJob | None:  # type: ignore[override]
        self.in_finalize.set()
        await self.may_finalize.wait()
        return await super().finalize(*args)

    async def add_items(self, batch_id: str, items) -> None:  # type: ignore[override]
        await self.may_add_items.wait()
        await super().add_items(batch_id, items)


def _content(texts: list[str]) -> bytes:
    return "\n".join(_line(f"c{i}", t) for i, t in enumerate(texts)).encode()


async def _create(store: SqliteJobStore, texts: list[str], created_at: int = 0, expires_at: int = 2**40) -> str:
    file = await store.create_file("", "in.jsonl", "batch", _content(texts), created_at)
    batch = await store.create_batch(NewBatch("", "/v1/embeddings", file.id, "24h", None, created_at, expires_at))
    return batch.id


async def _until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if await predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


async def _final(store: SqliteJobStore, batch_id: str) -> BatchJob:
    async def is_final() -> bool:
        found = await store.get_batch(None, batch_id)
        return found is not None and not found.is_active

    await _until(is_final)
    found = await store.get_batch(None, batch_id)
    assert found is not None
    return found


async def _lines(store: SqliteJobStore, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in (await store.file_content("", file_id or "") or b"").splitlines()]


async def test_a_polling_client_sees_finalizing_while_the_files_are_written(tmp_path: Path):
    store = PausingStore(tmp_path / "data")
    batch_id = await _create(store, ["ok"] * 5)
    executor = JobExecutor(store, FAST)
    api = Starlette(routes=batches.routes(store, executor.notify, 1 << 20))
    await executor.start(ScriptedApp())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(api), base_url="http://t") as client:
        await asyncio.wait_for(store.in_finalize.wait(), 10)
        polled = (await client.get(f"/v1/batches/{batch_id}")).json()
        assert polled["status"] == "finalizing" and polled["finalizing_at"] is not None
        assert polled["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
        assert polled["output_file_id"] is None and polled["completed_at"] is None
        store.may_finalize.set()
        done = await _final(store, batch_id)
        polled = (await client.get(f"/v1/batches/{batch_id}")).json()
    assert polled["status"] == "completed" and polled["finalizing_at"] == done.finalizing_at
    assert len(await _lines(store, done.output_file_id)) == 5
    await executor.aclose()
    await store.aclose()


async def test_a_crash_while_finalizing_resumes_finalizing(tmp_path: Path):
    store = SqliteJobStore(tmp_path / "data")
    batch_id = await _create(store, ["ok", "ok"])
    assert await store.start_batch(batch_id, [NewItem(i, f"c{i}", "/v1/embeddings", b"{}") for i in range(2)], 1)
    claim = await store.claim(2, 30, 1)
    assert claim is not None
    await store.record(claim.token, [ItemOutcome(batch_id, i, b'{"custom_id":"c%d"}\n' % i) for i in range(2)])
    assert await store.begin_finalizing(batch_id, 7) is not None
    await store.aclose()  # the server dies here: finalizing is committed, the files are not written

    store = SqliteJobStore(tmp_path / "data")
    executor = JobExecutor(store, FAST)
    await executor.start(ScriptedApp())
    done = await _final(store, batch_id)
    await executor.aclose()
    assert done.status is BatchStatus.COMPLETED and done.finalizing_at == 7
    assert [r["custom_id"] for r in await _lines(store, done.output_file_id)] == ["c0", "c1"]
    await store.aclose()


def _items_total(outcome: str) -> float:
    return REGISTRY.get_sample_value("sluice_batch_items_total", {"outcome": outcome}) or 0.0


async def test_expiry_keeps_finished_items_and_writes_off_the_rest(tmp_path: Path):
    store = SqliteJobStore(tmp_path / "data")
    now = [1000.0]
    batch_id = await _create(store, ["ok", "bad", "hang", "hang", "ok", "ok"], created_at=1000, expires_at=1010)
    app = HangingApp()
    config = ExecutorConfig(max_in_flight=2, claim_size=2, poll_interval_s=0.01, flush_interval_s=0.002)
    executor = JobExecutor(store, config, clock=lambda: now[0])
    expired_before, jobs_before = _items_total("expired"), _jobs_total("expired")
    await executor.start(app)

    async def hanging() -> bool:
        return app.calls["hang"] == 2

    await _until(hanging)  # items 0 and 1 are done, 2 and 3 running (they never end), 4 and 5 queued
    now[0] = 1010.0  # the window ends
    done = await _final(store, batch_id)
    await executor.aclose()
    assert done.status is BatchStatus.EXPIRED and done.expired_at == 1010 and done.completed_at is None
    assert (done.num_total, done.num_completed, done.num_failed) == (6, 1, 1)
    assert [r["custom_id"] for r in await _lines(store, done.output_file_id)] == ["c0"]
    errors = await _lines(store, done.error_file_id)
    assert [(r["custom_id"], r["response"] and r["response"]["status_code"], (r["error"] or {}).get("code"))
            for r in errors] == [("c1", 400, None), ("c2", None, "batch_expired"), ("c3", None, "batch_expired"),
                                 ("c4", None, "batch_expired"), ("c5", None, "batch_expired")]
    assert app.calls["ok"] == 1  # the queued items never ran
    assert _items_total("expired") - expired_before == 4 and _jobs_total("expired") - jobs_before == 1
    await store.aclose()


class UnreadableFileStore(SqliteJobStore):
    """Reading a batch's input file fails (its database unreachable) until `readable` is set."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.readable = False
        self.num_reads = 0

    async def file_content(self, owner: str, file_id: str) -> bytes | None:
        self.num_reads += 1
        if not self.readable:
            raise OSError("the database is unreachable")
        return await super().file_content(owner, file_id)


async def test_a_batch_still_validating_when_its_window_ends_expires(tmp_path: Path):
    """Validation keeps failing (the input file cannot be read); once the completion window ends
    the batch is `expired`, as OpenAI's are, with no items and no files, rather than validating
    for ever (a client polling it never saw it end); it does not start when the file is back."""
    store = UnreadableFileStore(tmp_path / "data")
    now = [1000.0]
    batch_id = await _create(store, ["ok", "ok"], created_at=1000, expires_at=1010)
    executor = JobExecutor(store, FAST, clock=lambda: now[0])
    jobs_before = _jobs_total("expired")
    await executor.start(ScriptedApp())

    async def retried() -> bool:
        return store.num_reads >= 2

    await _until(retried)
    still = await store.get_batch(None, batch_id)
    assert still is not None and still.status is BatchStatus.VALIDATING
    now[0] = 1010.0  # the window ends
    done = await _final(store, batch_id)
    store.readable = True
    await executor.aclose()
    assert done.status is BatchStatus.EXPIRED and done.expired_at == 1010 and done.in_progress_at is None
    assert (done.num_total, done.num_completed, done.num_failed) == (0, 0, 0)
    assert done.output_file_id is None and done.error_file_id is None
    assert _jobs_total("expired") - jobs_before == 1
    after = await store.get_batch(None, batch_id)
    assert after is not None and after.status is BatchStatus.EXPIRED
    await store.aclose()


def _jobs_total(status: str) -> float:
    return REGISTRY.get_sample_value("sluice_batch_jobs_total", {"status": status}) or 0.0


async def test_first_items_run_while_the_rest_are_stored(tmp_path: Path):
    store = PausingStore(tmp_path / "data")
    store.may_finalize.set()
    store.may_add_items.clear()
    batch_id = await _create(store, [f"t{i}" for i in range(10)])
    app = ScriptedApp()
    config = ExecutorConfig(max_attempts=3, poll_interval_s=0.02, flush_interval_s=0.005, first_load_size=2,
                            load_chunk_size=3)
    executor = JobExecutor(store, config)
    await executor.start(app)

    async def first_ran() -> bool:
        batch = await store.get_batch(None, batch_id)
        return batch is not None and batch.num_completed == 2

    await _until(first_ran)  # while storing the other 8 is held up
    assert await store.num_items(batch_id) == 2
    store.may_add_items.set()
    done = await _final(store, batch_id)
    await executor.aclose()
    assert done.status is BatchStatus.COMPLETED and done.num_completed == 10
    assert [r["custom_id"] for r in await _lines(store, done.output_file_id)] == [f"c{i}" for i in range(10)]
    await store.aclose()


async def test_a_crash_while_storing_items_stores_the_rest_on_restart(tmp_path: Path):
    store = SqliteJobStore(tmp_path / "data")
    batch_id = await _create(store, [f"t{i}" for i in range(7)])
    first = [NewItem(i, f"c{i}", "/v1/embeddings", json.dumps({"model": "m", "input": f"t{i}"}).encode())
             for i in range(3)]
    assert await store.start_batch(batch_id, first, 1, num_total=7)
    await store.aclose()  # the server dies with 3 of 7 items stored

    store = SqliteJobStore(tmp_path / "data")
    executor = JobExecutor(store, FAST)
    await executor.start(ScriptedApp())
    done = await _final(store, batch_id)
    await executor.aclose()
    assert done.status is BatchStatus.COMPLETED and (done.num_total, done.num_completed) == (7, 7)
    assert [r["custom_id"] for r in await _lines(store, done.output_file_id)] == [f"c{i}" for i in range(7)]
    await store.aclose()


async def test_cancel_stops_running_items_and_keeps_finished_ones(tmp_path: Path):
    store = SqliteJobStore(tmp_path / "data")
    batch_id = await _create(store, ["ok", "hang", "hang", "hang", "ok"])
    app = HangingApp()
    executor = JobExecutor(store, ExecutorConfig(max_in_flight=3, claim_size=3, poll_interval_s=0.01,
                                                 flush_interval_s=0.002))
    cancelled_before = _items_total("cancelled")
    await executor.start(app)

    async def hanging() -> bool:
        batch = await store.get_batch(None, batch_id)
        return app.calls["hang"] == 3 and batch is not None and batch.num_completed == 1

    await _until(hanging)  # item 0 done, 1 to 3 running forever, 4 queued
    assert await store.cancel_batch("", batch_id, 5) is not None
    executor.notify()
    done = await _final(store, batch_id)
    await executor.aclose()
    assert done.status is BatchStatus.CANCELLED and done.cancelled_at is not None
    assert [r["custom_id"] for r in await _lines(store, done.output_file_id)] == ["c0"]
    errors = await _lines(store, done.error_file_id)
    assert [(r["custom_id"], r["error"]["code"]) for r in errors] == [
        ("c1", "batch_cancelled"), ("c2", "batch_cancelled"), ("c3", "batch_cancelled"), ("c4", "batch_cancelled")]
    assert _items_total("cancelled") - cancelled_before == 4 and app.calls["ok"] == 1
    await store.aclose()


class CountingStore(SqliteJobStore):
    """Counts `result_lines` calls, so a test can tell a results stream is waiting."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.num_result_reads = 0

    async def result_lines(self, batch_id: str, after_idx: int, limit: int):  # type: ignore[override]
        self.num_result_reads += 1
        return await super().result_lines(batch_id, after_idx, limit)


async def _stream_results(store: CountingStore, texts: list[str], finish) -> tuple[list[str], list[dict]]:
    """Start a batch whose "hang" items never end on their own, read its results in input order while
    they hang, then `finish(app, executor, batch_id)` it; the custom_ids streamed and the lines."""
    batch_id = await _create(store, texts)
    app = HangingApp()
    executor = JobExecutor(store, FAST)
    api = Starlette(routes=batches.routes(store, executor.notify, 1 << 20))
    await executor.start(app)

    async def others_done() -> bool:
        batch = await store.get_batch(None, batch_id)
        return batch is not None and batch.num_completed == texts.count("ok")

    await _until(others_done)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(api), base_url="http://t") as client:
        reading = asyncio.create_task(client.get(f"/v1/batches/{batch_id}/results?order=input"))
        reads_before = store.num_result_reads

        async def polled_again() -> bool:
            return store.num_result_reads >= reads_before + 3

        await _until(polled_again)
        assert not reading.done()  # it waits for the item that runs, rather than skip it
        await finish(app, executor, batch_id)
        answer = await asyncio.wait_for(reading, 10)
    await executor.aclose()
    assert answer.status_code == 200
    rows = [json.loads(x) for x in answer.text.splitlines()]
    return [r["custom_id"] for r in rows], rows


async def test_results_in_input_order_wait_for_running_items(tmp_path: Path):
    store = CountingStore(tmp_path / "data")

    async def release(app: HangingApp, executor: JobExecutor, batch_id: str) -> None:
        app.release.set()

    ids, rows = await _stream_results(store, ["ok", "hang", "ok", "ok"], release)
    assert ids == ["c0", "c1", "c2", "c3"]  # not c0, c2, c3: a reader counting lines gets each in its place
    assert all(r["response"]["status_code"] == 200 for r in rows)
    await store.aclose()


async def test_results_in_input_order_include_items_cancelled_while_reading(tmp_path: Path):
    store = CountingStore(tmp_path / "data")

    async def cancel(app: HangingApp, executor: JobExecutor, batch_id: str) -> None:
        assert await store.cancel_batch("", batch_id, 5) is not None
        executor.notify()

    ids, rows = await _stream_results(store, ["ok", "hang", "ok"], cancel)
    assert ids == ["c0", "c1", "c2"]
    assert rows[1]["response"] is None and rows[1]["error"]["code"] == "batch_cancelled"
    await store.aclose()


class LoadingApp(ScriptedApp):
    """A server whose model "late" is still loading until `loaded`: not listed, `GET /v1/models/late`
    and its items answer 503, and the server is not ready; "m" is up, any other model unknown (404)."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded = False
        self.num_model_queries = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["method"] == "GET":
            self.num_model_queries += 1
            status, body = self._get(scope["path"])
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": json.dumps(body).encode()})
            return
        message = await receive()
        if json.loads(message["body"])["model"] == "late" and not self.loaded:
            self.calls["late"] += 1
            await send({"type": "http.response.start", "status": 503, "headers": [(b"retry-after-ms", b"1")]})
            await send({"type": "http.response.body", "body": b'{"error": {"code": "model_not_ready"}}'})
            return

        async def replay():
            return message

        await super().__call__(scope, replay, send)

    def _get(self, path: str) -> tuple[int, dict]:
        if path == "/v2/health/ready":
            return (200 if self.loaded else 503), {"ready": self.loaded}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": name} for name in (["m", "late"] if self.loaded else ["m"])]}
        name = path.removeprefix("/v1/models/")
        if name == "m" or (name == "late" and self.loaded):
            return 200, {"id": name, "object": "model"}
        if name == "late":
            return 503, {"error": {"code": "model_not_ready"}}
        return 404, {"error": {"code": "model_not_found"}}


def _late_lines(num: int) -> bytes:
    return "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings",
                                 "body": {"model": "late", "input": "ok"}}) for i in range(num)).encode()


async def test_a_batch_naming_a_model_still_loading_starts_and_its_items_wait_for_it(tmp_path: Path):
    """However long the model loads (here: validated `model_wait_s` after the batch was created, when
    validation used to give up waiting and fail it `model_not_found`), the batch starts and its items
    wait for the model, their attempts untouched, then run once it is up."""
    store = SqliteJobStore(tmp_path / "data")
    file = await store.create_file("", "in.jsonl", "batch", _late_lines(3), 0)
    created_at = int(time.time() - FAST.model_wait_s)
    batch = await store.create_batch(NewBatch("", "/v1/embeddings", file.id, "24h", None, created_at, 2**40))
    app = LoadingApp()
    executor = JobExecutor(store, FAST)
    await executor.start(app)

    async def waited() -> bool:  # each item answered 503 more often than it may be attempted
        return app.calls["late"] >= 3 * (FAST.max_attempts + 1)

    await _until(waited)
    waiting = await store.get_batch(None, batch.id)
    assert waiting is not None and waiting.status is BatchStatus.IN_PROGRESS and waiting.num_failed == 0
    app.loaded = True
    done = await _final(store, batch.id)
    await executor.aclose()
    assert done.status is BatchStatus.COMPLETED and done.num_completed == 3 and done.num_failed == 0
    await store.aclose()


async def test_a_batch_naming_a_model_the_server_does_not_have_fails_at_once_while_others_load(tmp_path: Path):
    """The server is not ready ("late" loads), but "nope" is no model of it: the file fails at once
    with `model_not_found` for that line only, not after a wait for the server's models."""
    store = SqliteJobStore(tmp_path / "data")
    content = b"\n".join([_late_lines(1), json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/embeddings",
                                                     "body": {"model": "nope", "input": "ok"}}).encode()])
    file = await store.create_file("", "in.jsonl", "batch", content, 0)
    batch = await store.create_batch(NewBatch("", "/v1/embeddings", file.id, "24h", None, 1000, 2**40))
    executor = JobExecutor(store, FAST, clock=lambda: 1000.0)
    await executor.start(LoadingApp())
    done = await _final(store, batch.id)
    await executor.aclose()
    assert done.status is BatchStatus.FAILED
    assert [(e["line"], e["code"]) for e in done.errors or []] == [(2, "model_not_found")]
    await store.aclose()
