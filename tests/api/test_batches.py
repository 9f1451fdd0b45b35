"""The Batch API's tenant scoping, on the real routes and a real SQLite store (no workers needed)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

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
