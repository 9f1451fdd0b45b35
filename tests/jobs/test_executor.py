"""The executor on a real SQLite store, with a small ASGI app standing in for the serving core."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

from sluice.jobs.executor import ExecutorConfig, JobExecutor, backoff_s
from sluice.jobs.sqlite_store import SqliteJobStore
from sluice.jobs.store import BatchStatus, NewBatch

FAST = ExecutorConfig(max_attempts=3, backoff_base_s=0.01, backoff_max_s=0.02, poll_interval_s=0.02,
                      flush_interval_s=0.005)


class ScriptedApp:
    """Answers by the item's `input`: "flaky" fails with 503 twice, "down" always 503, "bad" is 400."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.seen_headers: list[dict[bytes, bytes]] = []
        self.tenants: set[str] = set()

    async def __call__(self, scope, receive, send) -> None:
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


async def _run_job(tmp_path: Path, texts: list[str], app: ScriptedApp) -> tuple[SqliteJobStore, str]:
    store = SqliteJobStore(tmp_path / "data")
    content = "\n".join(_line(f"c{i}", t) for i, t in enumerate(texts)).encode()
    file = await store.create_file("acme", "in.jsonl", "batch", content, 0)
    batch = await store.create_batch(NewBatch("acme", "/v1/embeddings", file.id, "24h", None, 0, 2**40))
    executor = JobExecutor(store, FAST)
    await executor.start(app)
    try:
        for _ in range(500):
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
    assert "gave up after 3 attempts" in errors[0]["error"]["message"]
    assert app.seen_headers[0][b"x-sluice-priority"] == b"batch" and app.tenants == {"acme"}
    await store.aclose()


def test_backoff_grows_exponentially_within_its_cap():
    assert backoff_s(1, 0.5, 60, rng=lambda: 1.0) == 0.5
    assert backoff_s(4, 0.5, 60, rng=lambda: 1.0) == 4.0
    assert backoff_s(20, 0.5, 60, rng=lambda: 1.0) == 60
    assert backoff_s(3, 0.5, 60, rng=lambda: 0.0) == 0.0
