"""Crash safety: `kill -9` the server mid-job, restart it on the same data directory, and the job
completes with every input line exactly once in the output or error file. Also: cancelling mid-job,
and the PostgreSQL job store's database restarting mid-job."""

from __future__ import annotations

import os
import time
from pathlib import Path

import openai
import pytest

from tests.conftest import PostgresServer, is_alive, start_server, write_emulated_model
from tests.integration.test_batch_api import embedding_lines, jsonl, output_rows, wait_until_final

NUM_ITEMS = int(os.environ.get("SLUICE_CRASH_ITEMS", "2000"))
"""`SLUICE_CRASH_ITEMS=100000` runs the kill test on a job of the issue's size (a few minutes)."""


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=2, timeout=60)


def _wait_for_progress(client: openai.OpenAI, batch_id: str, at_least: int, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        counts = client.batches.retrieve(batch_id).request_counts
        if counts is not None and counts.completed + counts.failed >= at_least:
            return counts.completed + counts.failed
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} made no progress")


def test_kill_9_mid_job_then_restart_loses_and_duplicates_nothing(tmp_path: Path):
    repo = write_emulated_model(tmp_path / "models", slo_ms=2000, max_batch_size=8, alpha_ms=15)
    data_dir = str(tmp_path / "data")
    server = start_server(repo, tmp_path, "--data-dir", data_dir)
    try:
        with _client(server.url) as client:
            uploaded = client.files.create(file=("in.jsonl", jsonl(embedding_lines(NUM_ITEMS))), purpose="batch")
            batch_id = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                             completion_window="24h").id
        for cycle in range(5):  # the issue asks for zero lost or duplicated across five
            with _client(server.url) as client:
                _wait_for_progress(client, batch_id, at_least=NUM_ITEMS * (cycle + 1) // 7,
                                   timeout_s=60 + NUM_ITEMS / 100)
            workers = server.worker_pids()
            server.process.kill()  # SIGKILL: no drain, no flush
            server.process.wait()
            deadline = time.monotonic() + 30
            while any(is_alive(pid) for pid in workers) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(is_alive(pid) for pid in workers), "workers outlived their killed server"
            server = start_server(repo, tmp_path, "--data-dir", data_dir)
        with _client(server.url) as client:
            done = wait_until_final(client, batch_id, timeout_s=180 + NUM_ITEMS / 50)
            assert done.status == "completed"
            rows = output_rows(client, done.output_file_id) + output_rows(client, done.error_file_id)
    finally:
        server.stop()
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == NUM_ITEMS and set(ids) == {f"req-{i}" for i in range(NUM_ITEMS)}
    assert done.request_counts.total == NUM_ITEMS
    assert done.request_counts.completed + done.request_counts.failed == NUM_ITEMS


def test_cancel_mid_job_keeps_finished_items_and_cancels_the_rest(make_server, tmp_path: Path):
    repo = write_emulated_model(tmp_path / "models", slo_ms=2000, max_batch_size=4, alpha_ms=20)
    server = make_server(repo, "--data-dir", str(tmp_path / "data"))
    with _client(server.url) as client:
        uploaded = client.files.create(file=("in.jsonl", jsonl(embedding_lines(NUM_ITEMS))), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
        _wait_for_progress(client, batch.id, at_least=50)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = wait_until_final(client, batch.id)
        assert done.status == "cancelled" and done.cancelled_at
        finished = output_rows(client, done.output_file_id)
        errors = output_rows(client, done.error_file_id)
    assert 50 <= len(finished) < NUM_ITEMS
    assert len(finished) == done.request_counts.completed
    cancelled = [r for r in errors if r["error"]["code"] == "batch_cancelled"]
    assert len(finished) + len(errors) == NUM_ITEMS and len(cancelled) > 0
    assert {r["custom_id"] for r in finished + errors} == {f"req-{i}" for i in range(NUM_ITEMS)}


def test_the_job_store_database_restarting_mid_job_is_a_503_then_the_job_goes_on(tmp_path: Path,
                                                                                own_postgres: PostgresServer):
    """`sluice serve --jobs-db`: while its PostgreSQL is down, the Files and Batch APIs answer 503
    with a Retry-After in OpenAI's error shape (not a 500, not a hang); once it is back, the job
    goes on and completes with every input line exactly once."""
    num_items = 1500
    repo = write_emulated_model(tmp_path / "models", slo_ms=2000, max_batch_size=4, alpha_ms=15)
    server = start_server(repo, tmp_path, "--jobs-db", f"{own_postgres.url}/postgres")
    try:
        with _client(server.url) as client:
            uploaded = client.files.create(file=("in.jsonl", jsonl(embedding_lines(num_items))), purpose="batch")
            batch_id = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                             completion_window="24h").id
            _wait_for_progress(client, batch_id, at_least=100)
        own_postgres.stop()
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=20) as client:
            for call in (lambda: client.batches.retrieve(batch_id), lambda: client.batches.list(),
                         lambda: client.files.list(), lambda: client.files.retrieve(uploaded.id),
                         lambda: client.files.create(file=("b.jsonl", jsonl(embedding_lines(1))), purpose="batch")):
                with pytest.raises(openai.APIStatusError) as raised:
                    call()  # a hang would be an APITimeoutError
                answer = raised.value.response
                assert answer.status_code == 503 and int(answer.headers["retry-after"]) >= 1
                assert answer.json()["error"]["type"] == "server_error" and answer.json()["error"]["message"]
        own_postgres.start()
        with _client(server.url) as client:
            done = wait_until_final(client, batch_id, timeout_s=180)
            rows = output_rows(client, done.output_file_id) + output_rows(client, done.error_file_id)
    finally:
        server.stop()
    assert done.status == "completed" and done.request_counts.completed == num_items
    assert sorted(r["custom_id"] for r in rows) == sorted(f"req-{i}" for i in range(num_items))
