"""The Batch API's tenant scoping, on the real routes and a real SQLite store (no workers needed)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
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
