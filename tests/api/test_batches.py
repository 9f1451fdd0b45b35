"""The Batch API's tenant scoping, on the real routes and a real SQLite store (no workers needed)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient
from starlette.types import ASGIApp, Receive, Scope, Send

from sluice.api import batches
from sluice.api.app import _on_sluice_error
from sluice.api.common import TENANT_SCOPE_KEY
from sluice.errors import SluiceError
from sluice.jobs.sqlite_store import SqliteJobStore


class _TenantFromHeader:
    """Stands in for the auth middleware: the tenant comes from a test header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            scope[TENANT_SCOPE_KEY] = headers.get(b"x-test-tenant", b"").decode()
        await self.app(scope, receive, send)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    store = SqliteJobStore(tmp_path / "data")
    app = Starlette(routes=batches.routes(store, lambda: None, 1 << 20),
                    exception_handlers={SluiceError: _on_sluice_error})
    with TestClient(_TenantFromHeader(app)) as test_client:
        yield test_client
    asyncio.run(store.aclose())


LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "x"}}\n'


def test_a_tenant_sees_only_its_own_files_and_batches(client: TestClient):
    acme, zeta = {"x-test-tenant": "acme"}, {"x-test-tenant": "zeta"}
    file_id = client.post("/v1/files", files={"file": ("a.jsonl", LINE)}, data={"purpose": "batch"},
                          headers=acme).json()["id"]
    assert client.get(f"/v1/files/{file_id}", headers=acme).status_code == 200
    assert client.get(f"/v1/files/{file_id}", headers=zeta).status_code == 404
    assert client.get(f"/v1/files/{file_id}/content", headers=zeta).status_code == 404
    assert client.delete(f"/v1/files/{file_id}", headers=zeta).status_code == 404
    created = {"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
    assert client.post("/v1/batches", json=created, headers=zeta).status_code == 404  # not its file
    batch_id = client.post("/v1/batches", json=created, headers=acme).json()["id"]
    assert client.get(f"/v1/batches/{batch_id}", headers=zeta).status_code == 404
    assert client.post(f"/v1/batches/{batch_id}/cancel", headers=zeta).status_code == 404
    assert client.get("/v1/batches", headers=zeta).json()["data"] == []
    assert [b["id"] for b in client.get("/v1/batches", headers=acme).json()["data"]] == [batch_id]
    assert client.get(f"/v1/batches/{batch_id}", headers=acme).json()["status"] == "validating"


def test_bad_requests_are_400_in_the_openai_shape(client: TestClient):
    bad_purpose = client.post("/v1/files", files={"file": ("a.jsonl", LINE)}, data={"purpose": "fine-tune"})
    assert bad_purpose.status_code == 400 and bad_purpose.json()["error"]["param"] == "purpose"
    window = client.post("/v1/batches", json={"input_file_id": "f", "endpoint": "/v1/embeddings",
                                              "completion_window": "forever"})
    assert window.status_code == 400 and window.json()["error"]["param"] == "completion_window"
    assert client.get("/v1/batches?limit=0").status_code == 400


@pytest.mark.parametrize(("window", "seconds"), [("24h", 86_400), ("1h", 3600), ("30m", 1800), ("90s", 90),
                                                 ("336h", 14 * 86_400)])
def test_completion_window_sets_expires_at(client: TestClient, window: str, seconds: int):
    file_id = client.post("/v1/files", files={"file": ("a.jsonl", LINE)}, data={"purpose": "batch"}).json()["id"]
    created = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/embeddings",
                                               "completion_window": window})
    assert created.status_code == 200, created.text
    batch = created.json()
    assert batch["completion_window"] == window and batch["expires_at"] - batch["created_at"] == seconds


@pytest.mark.parametrize("window", ["0h", "24", "h", "1d", "-1h", "1.5h", "337h", "24H", ""])
def test_invalid_completion_windows_are_400(client: TestClient, window: str):
    file_id = client.post("/v1/files", files={"file": ("a.jsonl", LINE)}, data={"purpose": "batch"}).json()["id"]
    rejected = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/embeddings",
                                                "completion_window": window})
    assert rejected.status_code == 400 and rejected.json()["error"]["param"] == "completion_window"


def _multipart(content: bytes, boundary: str = "sluice-test-boundary") -> tuple[bytes, bytes, dict[str, str]]:
    """A multipart upload of `content` as (head, tail, headers): the file's bytes go between them."""
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    return head, tail, {"content-type": f"multipart/form-data; boundary={boundary}"}


async def test_a_chunked_upload_over_the_cap_is_refused_before_it_is_all_read(tmp_path: Path):
    """No Content-Length to check: the streamed bytes are counted, and the upload is refused with a
    413 in OpenAI's shape once they pass the cap, not after reading (and holding) the whole file."""
    store = SqliteJobStore(tmp_path / "data")
    app = Starlette(routes=batches.routes(store, lambda: None, 1 << 20, max_file_bytes=1000),
                    exception_handlers={SluiceError: _on_sluice_error})
    head, tail, headers = _multipart(b"")
    num_sent = 0

    async def body():  # 1 MiB in 1 KiB chunks, sent chunked
        nonlocal num_sent
        yield head
        for _ in range(1024):
            num_sent += 1
            yield LINE * 10
        yield tail

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
        refused = await client.post("/v1/files", content=body(), headers=headers)
        assert refused.status_code == 413, refused.text
        assert refused.json()["error"]["code"] == "payload_too_large"
        assert num_sent < 200  # stopped near the cap (and the form's allowance), not at the end
        small = await client.post("/v1/files", content=head + LINE + tail, headers=headers)
        assert small.status_code == 200 and small.json()["bytes"] == len(LINE)
        just_over = await client.post("/v1/files", content=head + LINE * 20 + tail, headers=headers)
        assert just_over.status_code == 413  # a file over the cap within the form's allowance
    await store.aclose()


def _upload(client: TestClient, headers: dict[str, str] | None = None, content: bytes = LINE,
            name: str = "a.jsonl") -> str:
    uploaded = client.post("/v1/files", files={"file": (name, content)}, data={"purpose": "batch"},
                           headers=headers or {})
    assert uploaded.status_code == 200, uploaded.text
    return str(uploaded.json()["id"])


def _create(client: TestClient, file_id: str, headers: dict[str, str] | None = None, **extra: object):
    return client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/embeddings",
                                            "completion_window": "24h", **extra}, headers=headers or {})


def test_an_idempotency_key_reused_for_another_request_is_a_409(client: TestClient):
    file_id, other_file_id = _upload(client), _upload(client)
    key = {"Idempotency-Key": "job-1"}
    first = _create(client, file_id, key, metadata={"run": "1"})
    assert first.status_code == 200
    assert _create(client, file_id, key, metadata={"run": "1"}).json()["id"] == first.json()["id"]
    for changed in ({"metadata": {"run": "2"}}, {"input_file_id": other_file_id}, {"completion_window": "1h"}):
        reused = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/embeddings",
                                                  "completion_window": "24h", "metadata": {"run": "1"}, **changed},
                             headers=key)
        assert reused.status_code == 409, changed
        assert reused.json()["error"]["code"] == "idempotency_key_reused"
        assert "already used for a different batch request" in reused.json()["error"]["message"]
    assert len(client.get("/v1/batches").json()["data"]) == 1
    upload_key = {"Idempotency-Key": "upload-1"}
    uploaded = _upload(client, upload_key)
    assert _upload(client, upload_key) == uploaded
    other = client.post("/v1/files", files={"file": ("a.jsonl", LINE * 2)}, data={"purpose": "batch"},
                        headers=upload_key)
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_key_reused"


def test_an_idempotent_repeat_is_answered_even_after_its_input_file_is_deleted(client: TestClient):
    file_id = _upload(client)
    key = {"Idempotency-Key": "job-2"}
    first = _create(client, file_id, key)
    assert client.delete(f"/v1/files/{file_id}").status_code == 200
    repeat = _create(client, file_id, key)
    assert repeat.status_code == 200 and repeat.json()["id"] == first.json()["id"]
    assert _create(client, file_id).status_code == 404  # without the key: a new batch, and no such file


def test_metadata_within_openais_limits(client: TestClient):
    file_id = _upload(client)
    assert _create(client, file_id, metadata={f"k{i}": "v" * 512 for i in range(16)}).status_code == 200
    assert _create(client, file_id, metadata={"k" * 64: "v"}).status_code == 200
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        refused = _create(client, file_id, metadata=metadata)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "metadata"


def test_list_after_an_unknown_id_is_a_400_not_an_empty_page(client: TestClient):
    acme, zeta = {"x-test-tenant": "acme"}, {"x-test-tenant": "zeta"}
    batch_id = _create(client, _upload(client, acme), acme).json()["id"]
    assert client.get(f"/v1/batches?after={batch_id}", headers=acme).json()["data"] == []
    for headers, after in ((acme, "batch_nope"), (zeta, batch_id)):
        refused = client.get(f"/v1/batches?after={after}", headers=headers)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "after"
    assert client.get("/v1/files?after=file-nope", headers=acme).status_code == 400


def test_files_list_pages_filters_and_orders_a_tenants_files(client: TestClient):
    acme, zeta = {"x-test-tenant": "acme"}, {"x-test-tenant": "zeta"}
    ids = [_upload(client, acme, name=f"f{i}.jsonl") for i in range(5)]
    _upload(client, zeta)
    listed = client.get("/v1/files?limit=2", headers=acme).json()
    assert listed["object"] == "list" and listed["has_more"] and len(listed["data"]) == 2
    seen, after = [], None
    while True:
        page = client.get("/v1/files", params={"limit": 2, **({"after": after} if after else {})}, headers=acme).json()
        seen += [f["id"] for f in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert sorted(seen) == sorted(ids) and len(seen) == 5
    ascending = [f["id"] for f in client.get("/v1/files?order=asc", headers=acme).json()["data"]]
    assert ascending == seen[::-1]
    assert client.get("/v1/files?purpose=batch_output", headers=acme).json()["data"] == []
    assert len(client.get("/v1/files?purpose=batch", headers=acme).json()["data"]) == 5
    assert [f["id"] for f in client.get("/v1/files", headers=zeta).json()["data"]] != []
    assert not set(ids) & {f["id"] for f in client.get("/v1/files", headers=zeta).json()["data"]}
    for bad in ("limit=0", "limit=10001", "order=up"):
        assert client.get(f"/v1/files?{bad}", headers=acme).status_code == 400


async def test_an_output_file_in_many_parts_downloads_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from sluice.jobs import rows
    from sluice.jobs.store import BatchStatus, ItemOutcome, NewBatch, NewItem

    monkeypatch.setattr(rows, "FILE_PART_BYTES", 64)
    store = SqliteJobStore(tmp_path / "data")
    batch = await store.create_batch(NewBatch("", "/v1/embeddings", "file-x", "24h", None, 0, 2**40))
    assert await store.start_batch(batch.id, [NewItem(i, f"c{i}", "/v1/embeddings", b"{}") for i in range(50)], 0)
    claim = await store.claim(100, 30, 0)
    assert claim is not None
    lines = [b'{"custom_id":"c%d","response":{"status_code":200}}\n' % i for i in range(50)]
    await store.record(claim.token, [ItemOutcome(batch.id, i, lines[i]) for i in range(50)])
    final = await store.finalize(batch.id, BatchStatus.COMPLETED, None, 0)
    assert final is not None
    app = Starlette(routes=batches.routes(store, lambda: None, 1 << 20),
                    exception_handlers={SluiceError: _on_sluice_error})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
        downloaded = await client.get(f"/v1/files/{final.output_file_id}/content")
        assert downloaded.status_code == 200 and downloaded.content == b"".join(lines)
        assert downloaded.headers["content-length"] == str(len(b"".join(lines)))
        assert (await client.get("/v1/files/file-nope/content")).status_code == 404
    await store.aclose()


@pytest.mark.parametrize("body", [b'{"input_file_id": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                                  b'{"input_file_id": "f\xff", "endpoint": "/v1/embeddings"}'])
def test_an_unreadable_create_body_is_400_not_500(client: TestClient, body: bytes):
    refused = client.post("/v1/batches", content=body, headers={"content-type": "application/json"})
    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "invalid_request_error"


@pytest.fixture
def store_and_sdk(tmp_path: Path) -> Iterator[tuple[SqliteJobStore, openai.OpenAI]]:
    """The real `openai` SDK against the Batch API routes (in-process, through Starlette's client)."""
    store = SqliteJobStore(tmp_path / "data")
    app = Starlette(routes=batches.routes(store, lambda: None, 1 << 20),
                    exception_handlers={SluiceError: _on_sluice_error})
    with TestClient(_TenantFromHeader(app)) as test_client:
        yield store, openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=test_client,
                                   max_retries=0)
    asyncio.run(store.aclose())


async def _complete(store: SqliteJobStore, batch_id: str) -> None:
    from sluice.jobs.store import BatchStatus, ItemOutcome, NewItem

    assert await store.start_batch(batch_id, [NewItem(0, "a", "/v1/embeddings", b"{}")], 0)
    claim = await store.claim(1, 30, 0)
    assert claim is not None
    await store.record(claim.token, [ItemOutcome(batch_id, 0, b'{"custom_id":"a"}\n')])
    assert await store.begin_finalizing(batch_id, 0) is not None
    assert await store.finalize(batch_id, BatchStatus.COMPLETED, None, 0) is not None


def test_cancelling_a_batch_that_ended_is_a_409_as_openai_answers_it(store_and_sdk):
    """OpenAI answers a cancel of a completed (failed, expired, cancelled) batch with 409 and
    "Cannot cancel a batch with status 'completed'."; the SDK raises `ConflictError`. A repeated
    cancel of a batch still cancelling answers it again."""
    store, sdk = store_and_sdk
    file_id = sdk.files.create(file=("a.jsonl", LINE), purpose="batch").id
    done = sdk.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    asyncio.run(_complete(store, done.id))
    with pytest.raises(openai.ConflictError) as refused:
        sdk.batches.cancel(done.id)
    assert refused.value.status_code == 409
    assert refused.value.body["message"] == "Cannot cancel a batch with status 'completed'."  # type: ignore[index]
    assert refused.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert sdk.batches.retrieve(done.id).status == "completed"  # unchanged
    failed = sdk.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    asyncio.run(store.fail_batch(failed.id, [], 0))
    with pytest.raises(openai.ConflictError, match="status 'failed'"):
        sdk.batches.cancel(failed.id)
    running = sdk.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    assert sdk.batches.cancel(running.id).status == "cancelling"
    assert sdk.batches.cancel(running.id).status == "cancelling"  # asked again: the same answer
    with pytest.raises(openai.NotFoundError):
        sdk.batches.cancel("batch_nope")


def test_expires_after_through_the_sdk_sets_expires_at_and_bad_values_are_400(store_and_sdk):
    """`files.create(expires_after=...)` and `batches.create(output_expires_after=...)` as the
    `openai` SDK sends them: the file's `expires_at` is its creation plus the seconds (the output
    and error files': theirs, when the batch finishes); out of OpenAI's bounds (1 hour to 30 days)
    or with another anchor, a 400 naming the parameter."""
    store, sdk = store_and_sdk
    uploaded = sdk.files.create(file=("a.jsonl", LINE), purpose="batch",
                                expires_after={"anchor": "created_at", "seconds": 3600})
    assert uploaded.expires_at == uploaded.created_at + 3600
    assert sdk.files.retrieve(uploaded.id).expires_at == uploaded.expires_at
    assert [f.expires_at for f in sdk.files.list()] == [uploaded.expires_at]
    assert sdk.files.create(file=("a.jsonl", LINE), purpose="batch").expires_at is None
    for expires_after, param in (({"anchor": "created_at", "seconds": 3599}, "expires_after[seconds]"),
                                 ({"anchor": "created_at", "seconds": 2_592_001}, "expires_after[seconds]"),
                                 ({"anchor": "last_active_at", "seconds": 3600}, "expires_after[anchor]"),
                                 ({"anchor": "created_at", "seconds": "soon"}, "expires_after[seconds]"),
                                 ({"seconds": 3600}, "expires_after[anchor]")):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.files.create(file=("a.jsonl", LINE), purpose="batch", expires_after=expires_after)  # type: ignore[arg-type]
        assert refused.value.body["param"] == param, expires_after  # type: ignore[index]
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h",
                               output_expires_after={"anchor": "created_at", "seconds": 7200})
    asyncio.run(_complete(store, batch.id))
    done = sdk.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id
    output = sdk.files.retrieve(done.output_file_id)
    assert output.expires_at == output.created_at + 7200
    plain = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    asyncio.run(_complete(store, plain.id))
    assert sdk.files.retrieve(sdk.batches.retrieve(plain.id).output_file_id or "").expires_at is None
    for output_expires_after, param in (({"anchor": "created_at", "seconds": 60}, "output_expires_after[seconds]"),
                                        ({"anchor": "now", "seconds": 3600}, "output_expires_after[anchor]")):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h",
                               output_expires_after=output_expires_after)  # type: ignore[arg-type]
        assert refused.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):  # not a whole number of seconds
        sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h",
                           output_expires_after={"anchor": "created_at", "seconds": 3600.5})  # type: ignore[typeddict-item]


def test_an_idempotent_repeat_with_another_expiry_is_a_409(client: TestClient):
    key = {"Idempotency-Key": "upload-x"}
    expiry = {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
    first = client.post("/v1/files", files={"file": ("a.jsonl", LINE)}, headers=key, data=expiry)
    assert first.status_code == 200 and first.json()["expires_at"] == first.json()["created_at"] + 3600
    other = client.post("/v1/files", files={"file": ("a.jsonl", LINE)}, headers=key, data={"purpose": "batch"})
    assert other.status_code == 409
    file_id = first.json()["id"]
    batch_key = {"Idempotency-Key": "job-x"}
    assert _create(client, file_id, batch_key, output_expires_after={"anchor": "created_at", "seconds": 3600}
                   ).status_code == 200
    assert _create(client, file_id, batch_key).status_code == 409
