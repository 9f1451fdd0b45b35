"""The executor on a real SQLite store, with a small ASGI app standing in for the serving core."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import pytest
from starlette.responses import Response

from sluice.api.errors import error_response
from sluice.errors import BudgetExhausted, Overloaded, RateLimited, Unavailable
from sluice.jobs.executor import ExecutorConfig, JobExecutor, backoff_s
from sluice.jobs.lines import read_usage
from sluice.jobs.sqlite_store import SqliteJobStore
from sluice.jobs.store import BatchJob, BatchStatus, NewBatch, NewItem

FAST = ExecutorConfig(max_attempts=3, backoff_base_s=0.01, backoff_max_s=0.02, poll_interval_s=0.02,
                      flush_interval_s=0.005)


MODELS = ["m"]
"""What the stand-in apps serve (the executor asks, to check a new batch's models)."""


async def answered_model_query(scope, send) -> bool:
    """Answer the executor's GET /v1/models and /v2/health/ready as the serving app does."""
    if scope["method"] != "GET":
        return False
    body = {"object": "list", "data": [{"id": name, "object": "model"} for name in MODELS]}
    if scope["path"] == "/v2/health/ready":
        body = {"ready": True}
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})
    return True


class ScriptedApp:
    """Answers by the item's `input`: "flaky" fails with 503 twice, "down" always 503, "bad" is 400."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.seen_headers: list[dict[bytes, bytes]] = []
        self.tenants: set[str] = set()
        self.backgrounds: set[object] = set()

    async def __call__(self, scope, receive, send) -> None:
        if await answered_model_query(scope, send):
            return
        text = json.loads((await receive())["body"])["input"]
        self.calls[text] += 1
        self.seen_headers.append(dict(scope["headers"]))
        self.tenants.add(scope["sluice.tenant"])
        self.backgrounds.add(scope.get("sluice.background"))
        status = 200
        if text == "down" or (text == "flaky" and self.calls[text] <= 2):
            status = 503
        elif text == "bad":
            status = 400
        body = {"usage": {"prompt_tokens": 3}} if status == 200 else {"error": {"code": "x", "message": text}}
        await send({"type": "http.response.start", "status": status, "headers": [(b"x-request-id", b"r1")]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def _line(custom_id: str, text: str) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": "m", "input": text}})


async def _new_batch(store: SqliteJobStore, texts: list[str]) -> BatchJob:
    """acme's batch of embeddings, one item per text (custom ids c0, c1, ...)."""
    content = "\n".join(_line(f"c{i}", t) for i, t in enumerate(texts)).encode()
    file = await store.create_file("acme", "in.jsonl", "batch", content, 0)
    return await store.create_batch(NewBatch("acme", "/v1/embeddings", file.id, "24h", None, 0, 2**40))


async def _until_ended(store: SqliteJobStore, batch_id: str, timeout_s: float) -> BatchJob | None:
    """The batch once it is no longer active, or as it stands after `timeout_s`."""
    found = None
    for _ in range(int(timeout_s / 0.01)):
        found = await store.get_batch(None, batch_id)
        if found is not None and not found.is_active:
            break
        await asyncio.sleep(0.01)
    return found


async def _run_job(tmp_path: Path, texts: list[str], app, config: ExecutorConfig = FAST,
                   timeout_s: float = 5.0) -> tuple[SqliteJobStore, str]:
    store = SqliteJobStore(tmp_path / "data")
    batch = await _new_batch(store, texts)
    executor = JobExecutor(store, config)
    await executor.start(app)
    try:
        await _until_ended(store, batch.id, timeout_s)
    finally:
        await executor.aclose()
    return store, batch.id


async def test_retries_transient_failures_then_dead_letters(tmp_path: Path):
    app = ScriptedApp()
    store, batch_id = await _run_job(tmp_path, ["ok", "flaky", "down", "bad"], app)
    batch = await store.get_batch(None, batch_id)
    assert batch is not None and batch.status is BatchStatus.COMPLETED
    assert (batch.num_completed, batch.num_failed, batch.input_tokens) == (2, 2, 6)
    assert app.calls == {"ok": 1, "flaky": 3, "down": 3, "bad": 1}
    output = [json.loads(x) for x in (await store.file_content("acme", batch.output_file_id or "") or b"").splitlines()]
    errors = [json.loads(x) for x in (await store.file_content("acme", batch.error_file_id or "") or b"").splitlines()]
    assert [r["custom_id"] for r in output] == ["c0", "c1"]
    assert [(r["custom_id"], r["response"]["status_code"]) for r in errors] == [("c2", 503), ("c3", 400)]
    # OpenAI's shape: a request that got an answer carries it (and its reason) in `response`
    assert [r["response"]["body"]["error"]["message"] for r in errors] == ["down", "bad"]
    assert all(r["error"] is None for r in errors)
    assert app.seen_headers[0][b"x-sluice-priority"] == b"batch" and app.tenants == {"acme"}
    assert app.backgrounds == {True}  # job items are background work (scheduler/backlog.py)
    await store.aclose()


async def test_an_app_that_answers_early_is_asked_first(tmp_path: Path):
    """As the HTTP protocol does for a small request (`SluiceApp.answer_early`): an answer it gives
    at once or later is the item's (a refusal's Retry-After honoured); None goes through the app."""
    class EarlyApp(ScriptedApp):
        def __init__(self) -> None:
            super().__init__()
            self.early: Counter[str] = Counter()

        def answer_early(self, scope, body: bytes):
            if scope["method"] != "POST":
                return None
            text = json.loads(body)["input"]
            self.early[text] += 1
            if text == "busy" and self.early[text] == 1:
                return Response(b'{"error": {}}', 503, headers={"retry-after-ms": "10", "x-request-id": "r0"})
            if text in ("now", "busy"):
                return Response(b'{"usage": {"prompt_tokens": 2}}', headers={"x-request-id": "r2"})
            return later() if text == "later" else None

    async def later() -> Response:
        await asyncio.sleep(0.01)
        return Response(b'{"usage": {"prompt_tokens": 5}}', headers={"x-request-id": "r5"})

    app = EarlyApp()
    store, batch_id = await _run_job(tmp_path, ["now", "later", "busy", "ok"], app)
    batch = await store.get_batch(None, batch_id)
    assert batch is not None and (batch.num_completed, batch.num_failed, batch.input_tokens) == (4, 0, 12)
    assert app.early == {"now": 1, "later": 1, "busy": 2, "ok": 1} and app.calls == {"ok": 1}
    output = [json.loads(x) for x in (await store.file_content("acme", batch.output_file_id or "") or b"").splitlines()]
    assert [r["response"]["request_id"] for r in output] == ["r2", "r5", "r2", "r1"]
    await store.aclose()


def test_backoff_grows_exponentially_within_its_cap():
    assert backoff_s(1, 0.5, 60, rng=lambda: 1.0) == 0.5
    assert backoff_s(4, 0.5, 60, rng=lambda: 1.0) == 4.0
    assert backoff_s(20, 0.5, 60, rng=lambda: 1.0) == 60
    assert backoff_s(3, 0.5, 60, rng=lambda: 0.0) == 0.0


async def test_500_and_502_are_retried_as_transient(tmp_path: Path):
    class Flaky(ScriptedApp):
        async def __call__(self, scope, receive, send) -> None:
            if await answered_model_query(scope, send):
                return
            text = json.loads((await receive())["body"])["input"]
            self.calls[text] += 1
            status = {"e500": 500, "e502": 502}.get(text, 200) if self.calls[text] == 1 else 200
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

    app = Flaky()
    store, batch_id = await _run_job(tmp_path, ["e500", "e502"], app)
    batch = await store.get_batch(None, batch_id)
    assert batch is not None and (batch.num_completed, batch.num_failed) == (2, 0)
    assert app.calls == {"e500": 2, "e502": 2}
    await store.aclose()


async def test_503s_while_the_models_load_wait_instead_of_using_attempts(tmp_path: Path):
    """A job resumed by a restart meets its models still loading: 503 `model_not_ready` until they
    are up, and the server not ready meanwhile. Those answers are waits, not attempts: the items
    complete once the models are up instead of going to the error file as dead letters."""
    class Loading(ScriptedApp):
        def __init__(self) -> None:
            super().__init__()
            self.num_unready_answers = 0  # the items' first 10 calls find the models loading

        async def __call__(self, scope, receive, send) -> None:
            is_loading = self.calls.total() >= 1 and self.num_unready_answers < 10
            if scope["method"] == "GET" and scope["path"] == "/v2/health/ready" and is_loading:
                await send({"type": "http.response.start", "status": 503, "headers": []})
                await send({"type": "http.response.body", "body": b'{"ready": false}'})
                return
            if await answered_model_query(scope, send):
                return
            text = json.loads((await receive())["body"])["input"]
            self.calls[text] += 1
            status, body = 200, b'{"usage": {"prompt_tokens": 1}}'
            if text != "first" and self.num_unready_answers < 10:
                self.num_unready_answers += 1
                status, body = 503, b'{"error": {"code": "model_not_ready", "message": "loading"}}'
            await send({"type": "http.response.start", "status": status, "headers": [(b"retry-after-ms", b"1")]})
            await send({"type": "http.response.body", "body": body})

    app = Loading()
    config = ExecutorConfig(max_attempts=3, backoff_base_s=0.01, backoff_max_s=0.02, poll_interval_s=0.001,
                            flush_interval_s=0.005, max_in_flight=1, claim_size=1)
    store, batch_id = await _run_job(tmp_path, ["first", "a", "b"], app, config)
    batch = await store.get_batch(None, batch_id)
    assert batch is not None and (batch.num_completed, batch.num_failed) == (3, 0)
    assert app.num_unready_answers == 10 and app.calls["a"] + app.calls["b"] == 12
    await store.aclose()


class LimitedApp:
    """A tenant's limits in front of the app, refusing with sluice's own error answers (429,
    `retry-after-ms`, `x-sluice-limit`, in `protocol`'s error shape): at most `max_concurrent`
    items at once (each takes `work_s`), and a bucket of `burst` requests refilled at `per_s`.
    `budget_refusals` first calls are refused as a spent budget. `capacity`: more items at once are
    refused as the server's overload (503, `x-sluice-limit: capacity`), whoever sends them."""

    def __init__(self, max_concurrent: int = 0, burst: float = 0, per_s: float = 0, budget_refusals: int = 0,
                 work_s: float = 0.002, protocol: str = "openai", capacity: int = 0) -> None:
        self.max_concurrent, self.per_s, self.work_s, self.protocol = max_concurrent, per_s, work_s, protocol
        self.capacity = capacity
        self.level, self.at = burst, time.monotonic()
        self.budget_refusals = budget_refusals
        self.num_in_flight = self.num_refused = self.num_answered = 0
        self.called_at: list[float] = []

    def _refusal(self) -> RateLimited | Overloaded | None:
        if self.capacity and self.num_in_flight >= self.capacity:
            return Overloaded("the work queued ahead would make this request miss its deadline", retry_after_s=0.01)
        if self.budget_refusals:
            self.budget_refusals -= 1
            return BudgetExhausted("spent", "credits", 0.05, {"x-should-retry": "false"})
        if self.max_concurrent and self.num_in_flight >= self.max_concurrent:
            return RateLimited("busy", "concurrency", 1.0)  # what the limiter says (a slot frees when one ends)
        if self.per_s:
            now = time.monotonic()
            self.level, self.at = min(self.level + (now - self.at) * self.per_s, self.per_s), now
            if self.level < 1:
                return RateLimited("limited", "requests", (1 - self.level) / self.per_s)
            self.level -= 1
        return None

    async def __call__(self, scope, receive, send) -> None:
        if await answered_model_query(scope, send):
            return
        await receive()
        self.called_at.append(time.monotonic())
        refusal = self._refusal()
        if refusal is not None:
            self.num_refused += 1
            await error_response(refusal, self.protocol)(scope, receive, send)
            return
        self.num_in_flight += 1
        try:
            await asyncio.sleep(self.work_s)  # the device's time
        finally:
            self.num_in_flight -= 1
        self.num_answered += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"usage": {"prompt_tokens": 1}}'})


PACED = ExecutorConfig(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.02, poll_interval_s=0.02,
                       flush_interval_s=0.005)


@pytest.mark.parametrize("protocol", ["openai", "kserve"])
async def test_a_concurrency_limit_paces_the_job_instead_of_failing_it(tmp_path: Path, protocol: str):
    """A concurrency refusal does not pause the tenant for its Retry-After (1 s, which 60 items
    could not wait out each time in the test's time), in either protocol's error shape."""
    app = LimitedApp(max_concurrent=2, protocol=protocol)
    store, batch_id = await _run_job(tmp_path, [f"t{i}" for i in range(60)], app, PACED, timeout_s=30)
    batch = await store.get_batch(None, batch_id)
    assert batch is not None and batch.status is BatchStatus.COMPLETED
    assert (batch.num_completed, batch.num_failed) == (60, 0)  # every refusal waited, none used an attempt
    assert app.num_answered == 60
    assert app.num_refused < 2 * 60  # launches slowed to the limit, not every item sent again and again
    gaps = [b - a for a, b in zip(app.called_at, app.called_at[1:], strict=False)]
    # the tenant is not paused for a refusal's 1 s Retry-After (paused: ~15 such gaps in this job)
    assert sum(gap > 0.9 for gap in gaps) <= 3
    await store.aclose()


@pytest.mark.parametrize("protocol", ["openai", "kserve"])
async def test_the_servers_overload_paces_the_job_instead_of_failing_it(tmp_path: Path, protocol: str):
    """A job deeper than its model gets through in an item's time (1,024 items in flight on a slow
    model) is answered 503 `overloaded` for some: those wait and the job is paced, none is written
    off as a dead letter."""
    app = LimitedApp(capacity=3, protocol=protocol)
    store, batch_id = await _run_job(tmp_path, [f"t{i}" for i in range(60)], app, PACED, timeout_s=30)
    batch = await store.get_batch(None, batch_id)
    assert batch is not None and batch.status is BatchStatus.COMPLETED
    assert (batch.num_completed, batch.num_failed) == (60, 0)
    assert app.num_answered == 60 and 0 < app.num_refused < 2 * 60
    await store.aclose()


async def test_a_requests_per_minute_limit_paces_the_job_instead_of_failing_it(tmp_path: Path):
    app = LimitedApp(burst=20, per_s=100)
    store, batch_id = await _run_job(tmp_path, [f"t{i}" for i in range(80)], app, PACED, timeout_s=30)
    batch = await store.get_batch(None, batch_id)
    assert batch is not None and (batch.status, batch.num_completed, batch.num_failed) == (
        BatchStatus.COMPLETED, 80, 0)
    assert app.num_refused < 2 * 80
    await store.aclose()


async def test_a_request_too_large_for_its_limit_fails_at_once(tmp_path: Path):
    """A 429 that says retrying cannot help (`x-should-retry: false`, no Retry-After: a request
    over a whole minute's tokens) ends the item on its first try, as an error, not a dead letter."""
    class TooLarge(ScriptedApp):
        async def __call__(self, scope, receive, send) -> None:
            if await answered_model_query(scope, send):
                return
            text = json.loads((await receive())["body"])["input"]
            self.calls[text] += 1
            error = RateLimited("request too large", "tokens", None, {"x-should-retry": "false"})
            await error_response(error, "openai")(scope, receive, send)

    app = TooLarge()
    store, batch_id = await _run_job(tmp_path, ["huge"], app)
    batch = await store.get_batch(None, batch_id)
    assert batch is not None and (batch.num_completed, batch.num_failed) == (0, 1)
    assert app.calls == {"huge": 1}
    await store.aclose()


async def test_a_spent_budget_waits_for_its_reset(tmp_path: Path):
    app = LimitedApp(budget_refusals=12)  # more refusals than the items have attempts
    store, batch_id = await _run_job(tmp_path, [f"t{i}" for i in range(5)], app, PACED)
    batch = await store.get_batch(None, batch_id)
    assert batch is not None and (batch.num_completed, batch.num_failed) == (5, 0)
    await store.aclose()


async def test_housekeeping_deletes_files_once_they_expire(store, monkeypatch: pytest.MonkeyPatch):
    """A file uploaded with `expires_after` (through the `openai` SDK) is kept until its `expires_at`,
    then the executor's housekeeping deletes it, within `expired_files_every_s`: it answers 404 (the
    SDK's NotFoundError), its content too; a file without expiry stays. Both stores."""
    import httpx
    import openai
    from starlette.applications import Starlette

    from sluice.api import batches
    from sluice.api.app import _on_sluice_error
    from sluice.errors import SluiceError

    app = Starlette(routes=batches.routes(store, lambda: None, 1 << 20),
                    exception_handlers={SluiceError: _on_sluice_error})
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")
    sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http, max_retries=0)
    expiring = await sdk.files.create(file=("a.jsonl", b"x\n"), purpose="batch",
                                      expires_after={"anchor": "created_at", "seconds": 3600})
    kept = await sdk.files.create(file=("b.jsonl", b"y\n"), purpose="batch")
    assert expiring.expires_at == expiring.created_at + 3600 and kept.expires_at is None
    assert (await sdk.files.retrieve(expiring.id)).expires_at == expiring.expires_at
    now = [expiring.created_at + 3599.0]
    config = ExecutorConfig(poll_interval_s=0.01, expired_files_every_s=60.0)
    executor = JobExecutor(store, config, clock=lambda: now[0])
    await executor.start(ScriptedApp())
    try:
        await asyncio.sleep(0.1)  # housekeeping rounds before its expiry
        assert (await sdk.files.content(expiring.id)).content == b"x\n"
        now[0] = expiring.created_at + 3600.0 + config.expired_files_every_s
        for _ in range(500):
            if await store.get_file("", expiring.id) is None:
                break
            await asyncio.sleep(0.01)
    finally:
        await executor.aclose()
    with pytest.raises(openai.NotFoundError):
        await sdk.files.retrieve(expiring.id)
    with pytest.raises(openai.NotFoundError):
        await sdk.files.content(expiring.id)
    assert (await sdk.files.retrieve(kept.id)).id == kept.id
    assert [f.id async for f in sdk.files.list()] == [kept.id]
    await http.aclose()


async def test_items_waiting_for_a_model_that_never_comes_up_are_counted_and_warned_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """The model was served when the batch was validated, then never came back up (say its worker
    keeps crashing): every answer is 503 `model_not_ready` and the server is not ready. The items
    keep waiting (no attempt used: the model may yet come up), but no longer silently for the whole
    window: `sluice_batch_items_waiting_for_model{model}` counts them and, once they have waited
    `model_wait_s`, a warning names the batch and the model. Cancelling the batch ends the count."""
    from prometheus_client import REGISTRY

    class NeverUp(ScriptedApp):
        async def __call__(self, scope, receive, send) -> None:
            if scope["method"] == "GET" and scope["path"] == "/v2/health/ready":
                await send({"type": "http.response.start", "status": 503, "headers": []})
                await send({"type": "http.response.body", "body": b'{"ready": false}'})
                return
            if await answered_model_query(scope, send):  # listed: it was up when the batch was validated
                return
            await receive()
            self.calls["never"] += 1
            await send({"type": "http.response.start", "status": 503, "headers": [(b"retry-after-ms", b"1")]})
            await send({"type": "http.response.body", "body": b'{"error": {"code": "model_not_ready"}}'})

    def waiting() -> float:
        return REGISTRY.get_sample_value("sluice_batch_items_waiting_for_model", {"model": "m"}) or 0.0

    now = [1000.0]
    store = SqliteJobStore(tmp_path / "data")
    batch = await _new_batch(store, ["x"] * 3)
    config = ExecutorConfig(max_attempts=2, poll_interval_s=0.01, flush_interval_s=0.005, model_wait_s=300.0)
    executor = JobExecutor(store, config, clock=lambda: now[0])
    app = NeverUp()
    caplog.set_level("WARNING", logger="sluice.jobs")
    await executor.start(app)
    try:
        await _until_true(lambda: waiting() == 3.0 and app.calls["never"] == 3)
        assert not [r for r in caplog.records if batch.id in r.getMessage()]  # not yet: they just began waiting
        now[0] += config.model_wait_s
        await _until_true(lambda: any(batch.id in r.getMessage() for r in caplog.records))
        warning = next(r.getMessage() for r in caplog.records if batch.id in r.getMessage())
        assert "3 items" in warning and "'m'" in warning and "not up" in warning
        found = await store.get_batch(None, batch.id)
        assert found is not None and found.status is BatchStatus.IN_PROGRESS and found.num_failed == 0
        assert await store.cancel_batch("acme", batch.id, int(now[0])) is not None
        executor.notify()
        await _until_true(lambda: waiting() == 0.0)
    finally:
        await executor.aclose()
    await store.aclose()


async def test_items_wait_for_their_model_while_its_worker_restarts_though_the_server_is_ready(tmp_path: Path):
    """The server is ready (its other models serve) while the items' model is not up (its worker is
    being restarted): they answer 503 `model_not_ready`, and so does `GET /v1/models/m`. The items
    wait for it, their attempts untouched, rather than ending in the error file after
    `max_attempts`; once it is back they run."""

    class Restarting(ScriptedApp):
        is_up = False

        async def __call__(self, scope, receive, send) -> None:
            if scope["method"] == "GET" and scope["path"] == "/v1/models/m" and not self.is_up:
                await send({"type": "http.response.start", "status": 503, "headers": []})
                await send({"type": "http.response.body", "body": b'{"error": {"code": "model_not_ready"}}'})
                return
            if await answered_model_query(scope, send):  # listed, and the server ready
                return
            if self.is_up:
                await super().__call__(scope, receive, send)
                return
            await receive()
            self.calls["restarting"] += 1
            await send({"type": "http.response.start", "status": 503, "headers": [(b"retry-after-ms", b"1")]})
            await send({"type": "http.response.body", "body": b'{"error": {"code": "model_not_ready"}}'})

    app = Restarting()
    config = ExecutorConfig(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.02, poll_interval_s=0.01,
                            flush_interval_s=0.005)
    store = SqliteJobStore(tmp_path / "data")
    batch = await _new_batch(store, ["x"] * 3)
    executor = JobExecutor(store, config)
    await executor.start(app)
    try:
        await _until_true(lambda: app.calls["restarting"] >= 3 * (config.max_attempts + 2))
        found = await store.get_batch(None, batch.id)
        assert found is not None and found.status is BatchStatus.IN_PROGRESS and found.num_failed == 0
        app.is_up = True
        found = await _until_ended(store, batch.id, 10.0)
    finally:
        await executor.aclose()
    assert found is not None and found.status is BatchStatus.COMPLETED
    assert (found.num_completed, found.num_failed) == (3, 0)
    await store.aclose()


class FailingGetBatchStore(SqliteJobStore):
    """Fault injection: once `fail_next_get_batch` is set, the next `get_batch` raises as a store out
    of reach does; each housekeeping round (`active_batches`) sets `housekept`."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.fail_next_get_batch = False
        self.num_failed = 0
        self.housekept = asyncio.Event()

    async def get_batch(self, owner, batch_id):  # type: ignore[no-untyped-def]
        if self.fail_next_get_batch:
            self.fail_next_get_batch = False
            self.num_failed += 1
            raise Unavailable("the batch job store is unavailable; try again shortly", retry_after_s=1.0)
        return await super().get_batch(owner, batch_id)

    async def active_batches(self):  # type: ignore[no-untyped-def]
        found = await super().active_batches()
        self.housekept.set()
        return found


async def test_items_claimed_when_their_batch_cannot_be_read_are_given_back_and_run(tmp_path: Path):
    """Another gateway started a batch since this executor's last housekeeping, so a claim takes its
    items before their owner is known here, and reading the batch fails right then. The items are
    given back, run at a later claim, and the batch completes (they were not held, their lease
    renewed, for ever)."""

    class Held(ScriptedApp):
        def __init__(self) -> None:
            super().__init__()
            self.gates = {"held-a": asyncio.Event(), "held-b": asyncio.Event()}
            self.started: set[str] = set()

        async def __call__(self, scope, receive, send) -> None:
            if await answered_model_query(scope, send):
                return
            message = await receive()
            text = json.loads(message["body"])["input"]
            if text in self.gates:
                self.started.add(text)
                await self.gates[text].wait()

            async def replay():
                return message

            await super().__call__(scope, replay, send)

    store = FailingGetBatchStore(tmp_path / "data")
    held = await store.create_file("acme", "in.jsonl", "batch", f"{_line('a', 'held-a')}\n{_line('b', 'held-b')}"
                                   .encode(), 0)
    await store.create_batch(NewBatch("acme", "/v1/embeddings", held.id, "24h", None, 0, 2**40))
    app = Held()
    executor = JobExecutor(store, ExecutorConfig(poll_interval_s=3.0, flush_interval_s=0.005))
    await executor.start(app)
    try:
        await _until_true(lambda: app.started == set(app.gates))
        store.housekept.clear()
        await asyncio.wait_for(store.housekept.wait(), 10.0)  # the next round is a poll interval away
        other = await store.create_file("acme", "other.jsonl", "batch", b"", 0)
        started = await store.create_batch(NewBatch("acme", "/v1/embeddings", other.id, "24h", None, 0, 2**40))
        items = [NewItem(i, f"o{i}", "/v1/embeddings", json.dumps({"model": "m", "input": f"o{i}"}).encode())
                 for i in range(3)]
        assert await store.start_batch(started.id, items, 0)
        store.fail_next_get_batch = True
        app.gates["held-a"].set()  # its outcome recorded, the executor claims the other batch's items
        await _until_true(lambda: store.num_failed == 1)  # ...and cannot read their batch
        found = await _until_ended(store, started.id, 20.0)
    finally:
        app.gates["held-b"].set()
        await executor.aclose()
    assert found is not None and found.status is BatchStatus.COMPLETED and found.num_completed == 3
    assert [app.calls[f"o{i}"] for i in range(3)] == [1, 1, 1]
    await store.aclose()


async def test_an_item_whose_503_cannot_be_looked_into_ends_in_the_error_file_rather_than_held(tmp_path: Path):
    """The item answers 503, and asking whether the server is ready raises (a bug in the app): the
    item gets an outcome (`internal_error`, in the error file) and the batch completes; it is not
    left without one, its lease renewed for ever."""

    class BrokenReadiness(ScriptedApp):
        async def __call__(self, scope, receive, send) -> None:
            if scope["method"] == "GET" and scope["path"] == "/v2/health/ready":
                raise RuntimeError("readiness check broke")
            await super().__call__(scope, receive, send)

    store, batch_id = await _run_job(tmp_path, ["ok", "down"], BrokenReadiness())
    done = await store.get_batch(None, batch_id)
    assert done is not None and done.status is BatchStatus.COMPLETED
    assert (done.num_completed, done.num_failed) == (1, 1)
    errors = [json.loads(line) for line in (await store.file_content("acme", done.error_file_id or "") or b"")
              .splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("c1", "internal_error")]
    await store.aclose()


async def _until_true(condition, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_an_answers_tokens_are_read_in_each_endpoints_words():
    """Chat and completions count `prompt_tokens`/`completion_tokens`, the Responses API
    `input_tokens`/`output_tokens`: a batch of /v1/responses items counted none."""
    assert read_usage(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}') == (3, 4, 0, 0)
    assert read_usage(b'{"usage": {"input_tokens": 5, "output_tokens": 6, "total_tokens": 11}}') == (5, 6, 0, 0)
    assert read_usage(b'{"error": {"message": "x"}}') == (0, 0, 0, 0)
    chat = (b'{"usage": {"prompt_tokens": 30, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 16},'
            b' "completion_tokens_details": {"reasoning_tokens": 3}}}')
    assert read_usage(chat) == (30, 4, 16, 3)
    responses = (b'{"usage": {"input_tokens": 30, "output_tokens": 4, "input_tokens_details": {"cached_tokens": 16},'
                 b' "output_tokens_details": {"reasoning_tokens": 3}}}')
    assert read_usage(responses) == (30, 4, 16, 3)
    assert read_usage(b'{"usage": {"prompt_tokens": 7, "prompt_tokens_details": null}}') == (7, 0, 0, 0)
    nulls = (b'{"usage": {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": null},'
             b' "completion_tokens_details": {"reasoning_tokens": null}}}')
    assert read_usage(nulls) == (7, 3, 0, 0), "a null detail keeps the counts beside it"
