"""A real PostgreSQL server for the job store tests, started once per session.

It runs from a temporary folder on a free loopback port with `initdb`/`pg_ctl` (found in PATH or
`/usr/lib/postgresql/*/bin`). initdb refuses to run as root, so as root the server runs as the
`postgres` OS user. `postgres_dsn` gives each test its own fresh database.
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port

_DATABASES = itertools.count(1)


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _as_server_user(command: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return command
    return ["runuser", "-u", "postgres", "--", *command]


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """The base DSN (`postgresql://...@127.0.0.1:PORT`) of a server started for this session."""
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.fail("PostgreSQL is not installed (initdb not found); ./scripts/test installs it")
    root = Path(tempfile.mkdtemp(prefix="sluice-pg-"))
    os.chmod(root, 0o755)
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    user = "postgres" if os.geteuid() == 0 else os.environ.get("USER", "postgres")
    port = free_port()
    subprocess.run(_as_server_user([initdb, "-D", str(data), "-A", "trust", "-U", user, "--no-sync"]),
                   check=True, capture_output=True)
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run(_as_server_user([pg_ctl, "-D", str(data), "-o", options, "-l", str(root / "log"), "-w",
                                    "start"]), check=True, capture_output=True)
    try:
        yield f"postgresql://{user}@127.0.0.1:{port}"
    finally:
        subprocess.run(_as_server_user([pg_ctl, "-D", str(data), "-m", "immediate", "stop"]),
                       check=False, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_dsn(postgres_server: str) -> str:
    """A fresh, empty database on the session's server."""
    import psycopg

    name = f"sluice_test_{os.getpid()}_{next(_DATABASES)}"
    with psycopg.connect(f"{postgres_server}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{postgres_server}/{name}"
