"""The job store under test: each test that takes `store` runs on both backends, SQLite
(embedded) and a real PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sluice.jobs.postgres_store import PostgresJobStore
from sluice.jobs.sqlite_store import SqliteJobStore
from sluice.jobs.store import JobStore


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[JobStore]:
    if request.param == "sqlite":
        opened: JobStore = SqliteJobStore(tmp_path / "data")
    else:
        opened = await PostgresJobStore.connect(request.getfixturevalue("postgres_dsn"))
    yield opened
    await opened.aclose()
