"""Shared fixtures: real `sluice serve` processes on free loopback ports, a real Redis and PostgreSQL.

`make_server(repo)` starts one and waits until it is ready; servers stop (SIGTERM, then kill) at
the end of the test or session that made them. `emulated_repo(tmp_path, **params)` writes a
model repository holding one emulated model with the given parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import itertools
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sluice.exposition import Scrape
from sluice.repository import demo_repository


@dataclass
class ServerProcess:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def worker_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process still running, newest first (they drain), then wait; kill stragglers."""
    for process in reversed(processes):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Wait until `condition()` holds (an HTTP error counts as not yet), or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if condition():
                return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """In a test's event loop: wait until `condition()` holds, or fail after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


def wait_workers_ready(url: str, count: int, timeout_s: float = 60.0, *, model: str | None = None) -> None:
    """Until the server at `url` has `count` workers connected and ready (`sluice_workers_ready`),
    and, given a `model`, each of them serving it (its Triton config's instance count): a worker
    is ready as soon as it listens, and loads its models after, so a request sent before then
    has fewer replicas to choose from than the test started."""
    eventually(lambda: f"sluice_workers_ready {float(count)}" in httpx.get(f"{url}/metrics").text,
               f"{count} workers ready", timeout_s)
    if model is not None:
        eventually(lambda: httpx.get(f"{url}/v2/models/{model}/config").json()["instance_group"][0]["count"] == count,
                   f"{count} workers serving {model}", timeout_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_SERVERS = itertools.count(1)
_LISTENING = re.compile(r"(?:Uvicorn running on|listening on) https?://127\.0\.0\.1:(\d+)")
"""uvicorn's line once its socket is bound (at `--log-level info`), or sluice's banner once models are loaded."""


def start_server(models_dir: Path, log_dir: Path, *extra: str, ready_timeout_s: float = 120.0,
                 tls: ssl.SSLContext | None = None) -> ServerProcess:
    """`sluice serve` of `models_dir` on a free port, once it is ready; `tls`: the client context
    to check its readiness with, for a server started with `--ssl-certfile` (its url then https).
    The server binds `--port 0` and the port is read from its log: a port picked here and bound
    there could be taken in between."""
    log_path = log_dir / f"sluice-{next(_SERVERS)}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("SLUICE_CACHE_DIR", str(log_dir / "sluice-cache"))  # generated demo weights (tiny-lm)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "sluice", "serve", "--models", str(models_dir), "--port", "0",
         "--log-level", "info", *extra],
        stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env,
    )
    scheme = "http" if tls is None else "https"
    server = ServerProcess(f"{scheme}://127.0.0.1:0", 0, process, log_path)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sluice serve exited with {process.returncode}:\n{server.log()}")
        if server.port == 0 and (listening := _LISTENING.search(server.log())) is not None:
            server = ServerProcess(f"{scheme}://127.0.0.1:{listening[1]}", int(listening[1]), process, log_path)
        if server.port != 0:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/v2/health/ready", timeout=1, verify=tls or True).status_code == 200:
                    return server
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"sluice serve did not become ready:\n{server.log()}")


def write_emulated_model(repo: Path, name: str = "emulated", slo_ms: float = 1000, max_batch_size: int = 32,
                         **params: float) -> Path:
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "1" / "SHA256SUMS").write_text("")
    lines = ['kind = "emulated"', "[batching]", f"max_batch_size = {max_batch_size}", "[slo]",
             f"default_ms = {slo_ms}", "[params]"]
    lines += [f"{key} = {value}" for key, value in params.items()]
    (model_dir / "model.toml").write_text("\n".join(lines) + "\n")
    return repo


def write_two_versions(repo: Path, routing: str = "", v2_params: str = "", max_batch_size: int = 32,
                       alpha_ms: float = 1.0) -> Path:
    """The emulated model with versions 1 and 2 (2's own settings in its version.toml)."""
    write_emulated_model(repo, max_batch_size=max_batch_size, alpha_ms=alpha_ms, beta_ms=0.1)
    model = repo / "emulated"
    (model / "2").mkdir()
    (model / "2" / "SHA256SUMS").write_text("")
    if v2_params:
        (model / "2" / "version.toml").write_text(f"[params]\n{v2_params}\n")
    if routing:
        (model / "model.toml").write_text((model / "model.toml").read_text() + f"\n[routing]\n{routing}\n")
    return repo


def write_tiny_lm_model(repo: Path, name: str = "tiny", max_num_seqs: int = 16) -> Path:
    """A repository entry `name`: a tiny random-weight Llama (generated, with its SHA256SUMS) served
    by the generative engine with a roomy deadline and a small KV cache."""
    from sluice.engines.generative.tiny import make_tiny_lm
    from sluice.repository import MANIFEST, write_manifest

    version = make_tiny_lm(repo / name / "1")
    write_manifest(version, version / MANIFEST)
    (repo / name / "model.toml").write_text(
        f'kind = "generative"\n[slo]\ndefault_ms = 60000\n[params]\nkv_cache_mb = 16\nmax_num_seqs = {max_num_seqs}\n')
    return repo


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The demo repository (real minilm + emulated), served once for the whole session."""
    server = start_server(demo_repository(), tmp_path_factory.mktemp("demo-server"))
    yield server
    server.stop()


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    servers: list[ServerProcess] = []

    def make(models_dir: Path, *extra: str) -> ServerProcess:
        server = start_server(models_dir, tmp_path, *extra)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def emulated_repo(tmp_path: Path) -> Callable[..., Path]:
    def make(**params: float) -> Path:
        repo = tmp_path / "models"
        shutil.rmtree(repo, ignore_errors=True)
        return write_emulated_model(repo, **params)

    return make


def start_redis(folder: Path, *args: str, port: int | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """A real `redis-server` with `args` on `port` (default: a free loopback port), its log and
    data in `folder`; returns once it accepts connections."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed; ./scripts/test installs it")
    port = port or free_port()
    process = subprocess.Popen([binary, *args, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)],
                               stdout=(folder / "log").open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return process, port
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"redis-server did not start:\n{(folder / 'log').read_text()}")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis (Debian's `redis-server`) on a free loopback port, for the whole session;
    tests keep apart by key prefix."""
    process, port = start_redis(tmp_path_factory.mktemp("redis"), "--save", "", "--appendonly", "no")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


def metric_total(server: ServerProcess | str, name: str, **labels: str) -> float:
    """The sum of a metric's samples on `server`'s /metrics (or a base url's) whose labels include `labels`."""
    url = server if isinstance(server, str) else server.url
    return sum(Scrape.parse(httpx.get(f"{url}/metrics").text, 0.0).grouped(name, (), **labels).values())


# A real PostgreSQL, started once per session from a temporary folder on a free loopback port with
# `initdb`/`pg_ctl` (found in PATH or `/usr/lib/postgresql/*/bin`). initdb refuses to run as root,
# so as root the server runs as the `postgres` OS user. `postgres_dsn` gives each test its own
# fresh database; `own_postgres` gives a test a server of its own to stop and start.
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


class PostgresServer:
    """A real PostgreSQL in a temporary folder on a free loopback port, that a test may stop and
    start again (its data kept): `sluice`'s job store must ride out its database restarting."""

    def __init__(self) -> None:
        initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        if initdb is None or pg_ctl is None:
            pytest.fail("PostgreSQL is not installed (initdb not found); ./scripts/test installs it")
        self._pg_ctl = pg_ctl
        self.root = Path(tempfile.mkdtemp(prefix="sluice-pg-"))
        os.chmod(self.root, 0o755)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        user = "postgres" if os.geteuid() == 0 else os.environ.get("USER", "postgres")
        self.port = free_port()
        self.url = f"postgresql://{user}@127.0.0.1:{self.port}"
        """The base DSN, without a database."""
        subprocess.run(_as_server_user([initdb, "-D", str(self.root / "data"), "-A", "trust", "-U", user,
                                        "--no-sync"]), check=True, capture_output=True)
        self.start()

    def _ctl(self, *args: str, check: bool = True) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(_as_server_user([self._pg_ctl, "-D", str(self.root / "data"), "-o", options, "-l",
                                        str(self.root / "log"), "-w", *args]), check=check, capture_output=True)

    def start(self) -> None:
        """Start it and wait until it accepts connections."""
        self._ctl("start")

    def stop(self, mode: str = "fast") -> None:
        """Stop it (`fast`: open sessions are terminated, as by a restart or a failover)."""
        self._ctl("-m", mode, "stop")

    def close(self) -> None:
        self._ctl("-m", "immediate", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """The base DSN (`postgresql://...@127.0.0.1:PORT`) of a server started for this session."""
    server = PostgresServer()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL of the test's own, for a test that stops and restarts it (its `postgres`
    database is empty at first)."""
    server = PostgresServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def postgres_dsn(postgres_server: str) -> str:
    """A fresh, empty database on the session's server."""
    import psycopg

    name = f"sluice_test_{os.getpid()}_{next(_DATABASES)}"
    with psycopg.connect(f"{postgres_server}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{postgres_server}/{name}"
