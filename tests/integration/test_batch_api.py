"""The Files and Batch APIs end to end with the real `openai` SDK, on a real server and the emulated model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import eventually, free_port, metric_total, stop_all, write_emulated_model
from tests.user_models import add_gated_version


def jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def embedding_lines(n: int, prefix: str = "req") -> list[dict]:
    return [{"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": "emulated", "input": f"item number {i}"}} for i in range(n)]


def wait_until_final(client: openai.OpenAI, batch_id: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout_s} s")


def output_rows(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines()]


@pytest.fixture
def served(make_server, emulated_repo, tmp_path: Path):
    server = make_server(emulated_repo(), "--data-dir", str(tmp_path / "data"))
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield server, client


def test_sdk_files_and_batches_end_to_end(served):
    server, client = served
    uploaded = client.files.create(file=("in.jsonl", jsonl(embedding_lines(300))), purpose="batch")
    assert uploaded.object == "file" and uploaded.purpose == "batch" and uploaded.bytes > 0
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h",
                                  metadata={"team": "search"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"team": "search"}
    done = wait_until_final(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 300 and done.request_counts.completed == 300
    assert done.request_counts.failed == 0 and done.error_file_id is None
    assert done.in_progress_at and done.completed_at and done.usage.input_tokens > 0
    rows = output_rows(client, done.output_file_id)
    assert [r["custom_id"] for r in rows] == [f"req-{i}" for i in range(300)]
    first = rows[0]
    assert first["error"] is None and first["response"]["status_code"] == 200
    assert first["response"]["request_id"] and first["id"].startswith("batch_req_")
    assert first["response"]["body"]["data"][0]["embedding"] == [pytest.approx(float(len("item number 0")))] or \
        first["response"]["body"]["object"] == "list"
    ordered = httpx.get(f"{server.url}/v1/batches/{batch.id}/results?order=input", timeout=30)
    assert [json.loads(x)["custom_id"] for x in ordered.text.splitlines()] == [f"req-{i}" for i in range(300)]
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):  # an output file is no input file
        client.batches.create(input_file_id=done.output_file_id, endpoint="/v1/embeddings", completion_window="24h")
    assert [f.id for f in client.files.list(purpose="batch_output")] == [done.output_file_id]
    listed = [f.id for f in client.files.list(limit=1)]  # the SDK follows the pages
    assert sorted(listed) == sorted([done.output_file_id, uploaded.id])
    assert [f.id for f in client.files.list(order="asc", purpose="batch")] == [uploaded.id]
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_a_job_beside_online_traffic_rides_in_its_batches_and_finishes_once_it_stops(served):
    """Job items yield to online work: while online requests keep coming they ride in the online
    batches (one or so per batch), and once the traffic stops the rest run as soon as the online
    rate has decayed: the worker looks again when the scheduler said, with nothing arriving to
    prompt it (the whole job is in flight at once, so no submission wakes it; without that timer
    the held items would sit until their 60 s item deadline)."""
    server, client = served
    stop = threading.Event()
    online_ok: list[int] = []

    def send_online() -> None:  # ~25 requests/s, each different (the result cache would answer repeats)
        with httpx.Client(base_url=server.url, timeout=10) as http:
            while not stop.is_set():
                data = [float(len(online_ok))] * 16
                body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": data}]}
                online_ok.append(http.post("/v2/models/emulated/infer", json=body).status_code)
                time.sleep(0.03)

    sender = threading.Thread(target=send_online)
    sender.start()
    try:
        uploaded = client.files.create(file=("in.jsonl", jsonl(embedding_lines(500))), purpose="batch")
        time.sleep(2.0)  # the worker's online rate (a decaying average, half-life 0.5 s) sees the traffic
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
        deadline = time.monotonic() + 30
        while (progress := client.batches.retrieve(batch.id)).request_counts.completed < 30:
            assert time.monotonic() < deadline, progress
            time.sleep(0.2)
        assert progress.request_counts.completed < 250  # riding along, not running the job's own batches
    finally:
        stop.set()
        sender.join()
    done = wait_until_final(client, batch.id, timeout_s=30)  # raises past 30 s
    assert done.status == "completed" and done.request_counts.completed == 500, done
    assert online_ok and set(online_ok) == {200}


def test_list_pages_and_cancel_unknown(served):
    _, client = served
    uploaded = client.files.create(file=("in.jsonl", jsonl(embedding_lines(2))), purpose="batch")
    ids = [client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                 completion_window="24h").id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    assert [b.id for b in client.batches.list(limit=2, after=page.data[-1].id).data] == ids[:1]
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]  # the SDK follows the cursor
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_nope")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/nothing", completion_window="24h")


def test_bad_input_file_fails_validation_with_line_numbers(served):
    _, client = served
    lines = jsonl(embedding_lines(3)) + b"not json\n" + jsonl([
        {"custom_id": "req-0", "method": "POST", "url": "/v1/embeddings", "body": {}},
        {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {}},
    ])
    uploaded = client.files.create(file=("bad.jsonl", lines), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    failed = wait_until_final(client, batch.id)
    assert failed.status == "failed" and failed.request_counts.total == 0
    assert [(e.line, e.code) for e in failed.errors.data] == [
        (4, "invalid_json"), (5, "duplicate_custom_id"), (6, "invalid_url")]


def test_bodies_that_cannot_run_fail_the_file_before_any_item_runs(served):
    """An empty body, a body without a model, a model the server does not serve, an empty custom_id:
    the whole file is rejected at validation with each line's problem; no line runs."""
    _, client = served
    lines = jsonl([
        *embedding_lines(2),
        {"custom_id": "empty", "method": "POST", "url": "/v1/embeddings", "body": {}},
        {"custom_id": "no-model", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "unknown", "method": "POST", "url": "/v1/embeddings", "body": {"model": "nope", "input": "x"}},
        {"custom_id": "", "method": "POST", "url": "/v1/embeddings", "body": {"model": "emulated", "input": "x"}},
    ])
    uploaded = client.files.create(file=("bad.jsonl", lines), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    failed = wait_until_final(client, batch.id)
    assert failed.status == "failed" and failed.request_counts.total == 0 and failed.output_file_id is None
    assert [(e.line, e.code, e.param) for e in failed.errors.data] == [
        (3, "missing_model", "body.model"), (4, "missing_model", "body.model"),
        (5, "model_not_found", "body.model"), (6, "invalid_custom_id", "custom_id")]


def test_item_errors_go_to_the_error_file_and_kserve_items_run(served):
    _, client = served
    rows = [
        {"custom_id": "good", "method": "POST", "url": "/v2/models/emulated/infer",
         "body": {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}},
        {"custom_id": "bad", "method": "POST", "url": "/v2/models/emulated/infer",
         "body": {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1, 2]}]}},
    ]
    uploaded = client.files.create(file=("t.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v2/infer", completion_window="24h")
    done = wait_until_final(client, batch.id)
    assert done.status == "completed" and done.request_counts.failed == 1
    (good,) = output_rows(client, done.output_file_id)
    assert good["custom_id"] == "good" and good["response"]["body"]["outputs"][0]["data"] == [6.0]
    (bad,) = output_rows(client, done.error_file_id)
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 400 and bad["error"] is None
    assert "INPUT0" in bad["response"]["body"]["error"]  # KServe's reason (`{"error": "..."}`), kept


def test_idempotency_key_returns_the_original_objects(served):
    _, client = served
    content = jsonl(embedding_lines(5))
    key = {"Idempotency-Key": "upload-1"}
    first = client.files.create(file=("a.jsonl", content), purpose="batch", extra_headers=key)
    again = client.files.create(file=("a.jsonl", content), purpose="batch", extra_headers=key)
    assert again.id == first.id
    key = {"Idempotency-Key": "job-1"}
    batch = client.batches.create(input_file_id=first.id, endpoint="/v1/embeddings", completion_window="24h",
                                  extra_headers=key)
    repeat = client.batches.create(input_file_id=first.id, endpoint="/v1/embeddings", completion_window="24h",
                                   extra_headers=key)
    assert repeat.id == batch.id
    assert len(client.batches.list().data) == 1
    assert wait_until_final(client, batch.id).request_counts.completed == 5


def test_cli_submit_waits_and_downloads(served, tmp_path: Path):
    import subprocess
    import sys

    server, _ = served
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(embedding_lines(20)))
    out = subprocess.run([sys.executable, "-m", "sluice", "batch", "submit", str(source), "--endpoint",
                          "/v1/embeddings", "--wait", "--url", server.url, "--output", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    batch_id = out.stdout.splitlines()[0]
    lines = (tmp_path / "out" / f"{batch_id}_output.jsonl").read_text().splitlines()
    assert len(lines) == 20
    # the server named in the environment, as every option can be (SLUICE_<COMMAND>_<OPTION>)
    environment = {**os.environ, "SLUICE_BATCH_STATUS_URL": server.url}
    status = subprocess.run([sys.executable, "-m", "sluice", "batch", "status", batch_id],
                            capture_output=True, text=True, timeout=60, env=environment)
    assert "completed  20 ok, 0 failed of 20" in status.stdout, status.stderr


def test_a_job_past_its_window_expires_keeping_what_finished(make_server, emulated_repo, tmp_path: Path):
    """A slow device (one item per 100 ms batch) and a 2 s window: about 20 of 60 items finish."""
    server = make_server(emulated_repo(max_batch_size=1, alpha_ms=100.0, beta_ms=0.0), "--data-dir",
                         str(tmp_path / "data"))
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        uploaded = client.files.create(file=("in.jsonl", jsonl(embedding_lines(60))), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                      completion_window="2s")  # a sluice extension: OpenAI takes only "24h"
        assert batch.expires_at == batch.created_at + 2
        done = wait_until_final(client, batch.id, timeout_s=60)
        assert done.status == "expired", done
        assert done.expired_at is not None and done.expired_at >= done.expires_at and done.completed_at is None
        ok = output_rows(client, done.output_file_id)
        expired = output_rows(client, done.error_file_id)
        assert 1 <= len(ok) < 60 and len(ok) == done.request_counts.completed and done.request_counts.failed == 0
        assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in ok)
        assert {r["error"]["code"] for r in expired} == {"batch_expired"}
        assert all(r["response"] is None for r in expired)
        ids = sorted((r["custom_id"] for r in ok + expired), key=lambda c: int(c.split("-")[1]))
        assert ids == [f"req-{i}" for i in range(60)]  # every line exactly once
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert f'sluice_batch_items_total{{outcome="expired"}} {float(len(expired))}' in metrics
        assert 'sluice_batch_jobs_total{status="expired"} 1.0' in metrics


def test_a_batch_of_responses_answers_what_each_request_would(make_server, tmp_path: Path):
    from tests.conftest import write_tiny_lm_model

    server = make_server(write_tiny_lm_model(tmp_path / "repo", "tiny"), "--data-dir", str(tmp_path / "data"))
    shared = "Tell me, in a few words and plainly, about the weather we had here last week. "  # a cached prefix
    asks = [{"model": "tiny", "input": f"{shared}Question {i}", "max_output_tokens": 4, "temperature": 0,
             "store": False} for i in range(3)]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        client.responses.create(**{**asks[0], "input": f"{shared}Anything", "max_output_tokens": 1})
        uploaded = client.files.create(file=("in.jsonl", jsonl([
            *({"custom_id": f"q-{i}", "method": "POST", "url": "/v1/responses", "body": ask}
              for i, ask in enumerate(asks)),
            {"custom_id": "later", "method": "POST", "url": "/v1/responses", "body": {**asks[0], "background": True,
                                                                                        "store": True}}])),
            purpose="batch")
        batch = wait_until_final(client, client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h").id)
        assert batch.status == "completed" and batch.request_counts.completed == 3
        [refused] = output_rows(client, batch.error_file_id)  # a batch item is in the background already
        assert refused["custom_id"] == "later" and refused["response"]["status_code"] == 400
        assert refused["response"]["body"]["error"]["param"] == "background"
        rows = {row["custom_id"]: row["response"] for row in output_rows(client, batch.output_file_id)}
        for i, ask in enumerate(asks):
            answer = rows[f"q-{i}"]
            assert answer["status_code"] == 200 and answer["body"]["object"] == "response"
            direct = client.responses.create(**ask)
            assert answer["body"]["output"][0]["content"][0]["text"] == direct.output_text
            assert answer["body"]["usage"]["output_tokens"] == 4
        usages = [rows[f"q-{i}"]["body"]["usage"] for i in range(3)]
        assert batch.usage.input_tokens == sum(u["input_tokens"] for u in usages)
        assert batch.usage.output_tokens == 12 and batch.usage.output_tokens_details.reasoning_tokens == 0
        cached = [u["input_tokens_details"]["cached_tokens"] for u in usages]
        assert batch.usage.input_tokens_details.cached_tokens == sum(cached) and min(cached) > 0


def gated_lines(n: int, model: str, prefix: str) -> list[dict]:
    return [{"custom_id": f"{prefix}-{i}", "method": "POST", "url": f"/v2/models/{model}/infer",
             "body": {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [float(i)]}]}}
            for i in range(n)]


@pytest.fixture
def loading_server(tmp_path: Path):
    """`sluice serve` of the emulated model and a `gated` one whose load lasts until the file `gate`
    exists: (url, gate), once the emulated model serves and `gated` is reported LOADING (the server
    is not ready meanwhile, so it is not started with `make_server`, which waits for that)."""
    repo = write_emulated_model(tmp_path / "models", alpha_ms=1.0, beta_ms=0.1)
    gate = tmp_path / "gate"
    add_gated_version(repo / "gated", "1", gate)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "sluice", "serve", "--models", str(repo), "--port",
                                    str(port), "--data-dir", str(tmp_path / "data"), "--log-level", "info"],
                                   stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        eventually(lambda: {(e["name"], e["state"]) for e in httpx.post(f"{url}/v2/repository/index", json={}).json()}
                   >= {("gated", "LOADING"), ("emulated", "READY")}, "gated LOADING beside emulated READY", 90)
        yield url, gate
    finally:
        gate.touch()
        stop_all([process])


def test_a_batch_for_a_model_still_loading_waits_for_it_and_expires_rather_than_failing(loading_server):
    """Batches naming a model that exists but is still loading are not failed as `model_not_found`:
    they start, their items wait for the model (counted in `sluice_batch_items_waiting_for_model`);
    one whose window ends first expires (`batch_expired` items, as OpenAI's), one that outlasts the
    load runs once it is up. A model that does not exist still fails its batch at once, although
    the server is not ready."""
    url, gate = loading_server
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        def submit(rows: list[dict], window: str) -> str:
            uploaded = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
            return client.batches.create(input_file_id=uploaded.id, endpoint="/v2/infer",
                                         completion_window=window).id  # type: ignore[arg-type]

        short = submit(gated_lines(2, "gated", "short"), "15s")  # a sluice extension: OpenAI takes only "24h"
        waits = submit(gated_lines(3, "gated", "waits"), "24h")
        unknown = submit(gated_lines(1, "nope", "unknown"), "24h")

        failed = wait_until_final(client, unknown, timeout_s=30)
        assert failed.status == "failed" and [e.code for e in failed.errors.data] == ["model_not_found"]
        eventually(lambda: client.batches.retrieve(waits).status == "in_progress"
                   and metric_total(url, "sluice_batch_items_waiting_for_model", model="gated") == 5.0,
                   "the items of both batches waiting for the model", 30)

        expired = wait_until_final(client, short, timeout_s=90)
        assert expired.status == "expired" and expired.request_counts.completed == 0
        assert sorted((r["custom_id"], r["error"]["code"]) for r in output_rows(client, expired.error_file_id)) \
            == [("short-0", "batch_expired"), ("short-1", "batch_expired")]
        assert client.batches.retrieve(waits).status == "in_progress"

        gate.touch()
        done = wait_until_final(client, waits, timeout_s=90)
        assert done.status == "completed" and done.request_counts.completed == 3 and done.error_file_id is None
        rows = output_rows(client, done.output_file_id)
        assert [(r["custom_id"], r["response"]["body"]["outputs"][0]["data"]) for r in rows] == [
            ("waits-0", [0.0]), ("waits-1", [1.0]), ("waits-2", [2.0])]
        eventually(lambda: metric_total(url, "sluice_batch_items_waiting_for_model", model="gated") == 0.0,
                   "no item waiting once the model is up", 30)
