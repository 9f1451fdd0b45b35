"""The executor on a real SQLite store, with a small ASGI app standing in for the serving core."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

from sluice.jobs.executor import ExecutorConfig, JobExecutor, backoff_s
from sluice.jobs.sqlite_store import SqliteJobStore
from sluice.jobs.store import BatchStatus, NewBatch

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

    async def __call__(self, scope, receive, send) -> None:
        if await answered_model_query(scope, send):
            return
        text = json.loads((await receive())["body"])["input"]
        self.calls[text] += 1
        self.seen_headers.append(dict(scope["headers"]))
        self.tenants.add(scope["sluice.tenant"])
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


async def _run_job(tmp_path: Path, texts: list[str], app, config: ExecutorConfig = FAST,
                   timeout_s: float = 5.0) -> tuple[SqliteJobStore, str]:
    store = SqliteJobStore(tmp_path / "data")
    content = "\n".join(_line(f"c{i}", t) for i, t in enumerate(texts)).encode()
    file = await store.create_file("acme", "in.jsonl", "batch", content, 0)
    batch = await store.create_batch(NewBatch("acme", "/v1/embeddings", file.id, "24h", None, 0, 2**40))
    executor = JobExecutor(store, config)
    await executor.start(app)
    try:
        for _ in range(int(timeout_s / 0.01)):
            found = await store.get_batch(None, batch.id)
            if found is not None and not found.is_active:
                break
            await asyncio.sleep(0.01)
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


class LimitedApp:
    """A tenant's limits in front of the app, answering as sluice's limiter does (429, `retry-after-ms`,
    the limit's code): at most `max_concurrent` items at once (each takes `work_s`), and a bucket of
    `burst` requests refilled at `per_s`. `budget_refusals` first calls are refused as a spent budget."""

    def __init__(self, max_concurrent: int = 0, burst: float = 0, per_s: float = 0, budget_refusals: int = 0,
                 work_s: float = 0.002) -> None:
        self.max_concurrent, self.per_s, self.work_s = max_concurrent, per_s, work_s
        self.level, self.at = burst, time.monotonic()
        self.budget_refusals = budget_refusals
        self.num_in_flight = self.num_refused = self.num_answered = 0

    def _refusal(self) -> tuple[str, float, bool] | None:
        if self.budget_refusals:
            self.budget_refusals -= 1
            return "insufficient_quota", 0.05, True
        if self.max_concurrent and self.num_in_flight >= self.max_concurrent:
            return "concurrency_limit_exceeded", 0.05, False
        if self.per_s:
            now = time.monotonic()
            self.level, self.at = min(self.level + (now - self.at) * self.per_s, self.per_s), now
            if self.level < 1:
                return "requests_limit_exceeded", (1 - self.level) / self.per_s, False
            self.level -= 1
        return None

    async def __call__(self, scope, receive, send) -> None:
        if await answered_model_query(scope, send):
            return
        await receive()
        refusal = self._refusal()
        if refusal is not None:
            code, wait_s, is_final = refusal
            self.num_refused += 1
            headers = [(b"retry-after", b"1"), (b"retry-after-ms", str(max(1, int(wait_s * 1000))).encode())]
            if is_final:
                headers.append((b"x-should-retry", b"false"))
            body = json.dumps({"error": {"message": "limited", "type": "rate_limit_exceeded", "param": None,
                                         "code": code}}).encode()
            await send({"type": "http.response.start", "status": 429, "headers": headers})
            await send({"type": "http.response.body", "body": body})
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


async def test_a_concurrency_limit_paces_the_job_instead_of_failing_it(tmp_path: Path):
    app = LimitedApp(max_concurrent=2)
    store, batch_id = await _run_job(tmp_path, [f"t{i}" for i in range(60)], app, PACED, timeout_s=30)
    batch = await store.get_batch(None, batch_id)
    assert batch is not None and batch.status is BatchStatus.COMPLETED
    assert (batch.num_completed, batch.num_failed) == (60, 0)  # every refusal waited, none used an attempt
    assert app.num_answered == 60
    assert app.num_refused < 2 * 60  # launches slowed to the limit, not every item sent again and again
    await store.aclose()


async def test_a_requests_per_minute_limit_paces_the_job_instead_of_failing_it(tmp_path: Path):
    app = LimitedApp(burst=20, per_s=100)
    store, batch_id = await _run_job(tmp_path, [f"t{i}" for i in range(80)], app, PACED, timeout_s=30)
    batch = await store.get_batch(None, batch_id)
    assert batch is not None and (batch.status, batch.num_completed, batch.num_failed) == (
        BatchStatus.COMPLETED, 80, 0)
    assert app.num_refused < 2 * 80
    await store.aclose()


async def test_a_spent_budget_waits_for_its_reset(tmp_path: Path):
    app = LimitedApp(budget_refusals=12)  # more refusals than the items have attempts
    store, batch_id = await _run_job(tmp_path, [f"t{i}" for i in range(5)], app, PACED)
    batch = await store.get_batch(None, batch_id)
    assert batch is not None and (batch.num_completed, batch.num_failed) == (5, 0)
    await store.aclose()
