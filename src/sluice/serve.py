"""The embedded server: one gateway (HTTP) and one supervised worker process per device.

`sluice serve` calls `run()`. The CLI sets `PROMETHEUS_MULTIPROC_DIR` before this module is
imported so workers' metrics show up on the gateway's `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import urllib.parse
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import uvicorn
from redis.exceptions import RedisError
from rich.console import Console
from rich.markup import escape
from starlette.applications import Starlette

from sluice import __version__, logs, wire
from sluice.api import ApiConfig, batches, build_app, kserve_grpc
from sluice.api.http_protocol import BODY_TIMEOUT_S, stamping_protocol
from sluice.api.tls import TlsConfig
from sluice.clock import Clock, MonotonicClock, WallClock
from sluice.errors import ConfigError, SluiceError
from sluice.gateway import Gateway
from sluice.gateway.cache import CacheConfig, MemoryStore, ResultCache
from sluice.gateway.config import GatewayConfig
from sluice.gateway.shared_cache import RedisCacheStore
from sluice.gateway.shared_limits import SharedLimiter
from sluice.gateway.shared_traffic import SharedTraffic
from sluice.gateway.supervisor import Supervisor, SupervisorConfig, WorkerSpec
from sluice.gateway.tenancy import Tenancy
from sluice.gateway.traffic import version_order
from sluice.jobs.background import BackgroundResponses
from sluice.jobs.executor import ExecutorConfig, JobExecutor
from sluice.jobs.postgres_store import PostgresJobStore
from sluice.jobs.sqlite_store import SqliteJobStore
from sluice.jobs.store import JobStore
from sluice.metrics import GatewayMetrics
from sluice.registry import RegistryWatcher
from sluice.repository import fingerprints, model_names, scan_repository
from sluice.runtime import settle_garbage_collector
from sluice.tracing import Tracing
from sluice.tracing import from_environment as tracing_from_environment

log = logging.getLogger("sluice.serve")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    models_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    num_workers: int | None = None  # None: one per GPU, or one on a machine without a GPU
    device: str = "auto"
    tenants_file: Path | None = None
    """The tenants file (keys, weights, limits); None: one local tenant and no keys."""
    remote_workers: tuple[str, ...] = ()
    """Addresses of workers started elsewhere (`sluice worker`); none are spawned then."""
    registry: str | None = None
    """A Redis URL: also use the workers registered there (`sluice.registry`), as they come and go."""
    graceful_timeout_s: float = 30.0
    keep_alive_s: int = 75
    """How long an idle client connection is kept, advertised in `Keep-Alive: timeout=N`: longer
    than the idle timeouts of common load balancers (60 s), so that they, not sluice, close idle
    connections (no request meets a connection closing under it), and clients that read the
    header keep their connections instead of opening new ones for each burst."""
    body_timeout_s: float = BODY_TIMEOUT_S
    """How long a request's body may take to arrive once its head is in, plus a second for each
    16 KiB of it (`api.http_protocol`): past it, 408 and the connection closed, so a client
    trickling its body cannot hold a request for ever (as `keep_alive_s` bounds a head)."""
    ready_timeout_s: float = 120.0
    api: ApiConfig = field(default_factory=ApiConfig)
    data_dir: Path | None = None
    """Where batch jobs are kept (SQLite). None: a temporary folder, so jobs do not survive a restart."""
    jobs_db: str | None = None
    """A `postgresql://` DSN: keep batch jobs in PostgreSQL instead (shared by several gateways)."""
    jobs: ExecutorConfig = field(default_factory=ExecutorConfig)
    limits_redis: str | None = None
    """A `redis://` URL: keep tenants' rate limits, concurrency and credits there, shared by every
    gateway using it. None: each gateway keeps its own."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """The result cache for deterministic requests (`gateway.cache`)."""
    grpc_port: int | None = None
    """Also serve KServe v2 over gRPC on this port of `host` (`api.kserve_grpc`; 0: any free port)."""
    tls: TlsConfig | None = None
    """Serve HTTP and gRPC over TLS (and ask clients for certificates if it names CAs)."""
    prefix_affinity: bool = True
    """Send a generation to the worker that has its prompt's prefix cached (`gateway.router`)."""
    model_memory_mb: int | None = None
    """What the models may take on each worker (`sluice worker --model-memory-mb`); None: no bound."""
    load_concurrency: int | None = None
    """How many versions each worker loads at once when it starts (`sluice worker --load-concurrency`);
    None: the worker's default."""
    poll_repository_s: float | None = None
    """Look for changes in the model repository this often and load the models that changed
    (`Gateway.sync_model`); None: only when an admin asks."""
    poll_tenants_s: float | None = None
    """Look for a change of the tenants file this often and reload it; None: only on SIGHUP or
    `POST /admin/reload`."""


async def _check_registry(config: ServeConfig) -> None:
    """The worker registry answers: a gateway that cannot read it at start is a configuration
    error, said as one (as the shared limits' and cache's Redis are). Once running, it rides out
    the registry's outages (`registry.RegistryWatcher`)."""
    if config.registry is None:
        return
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(config.registry, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        raise ConfigError(f"cannot reach the worker registry at {_redacted(config.registry)}: {exc}") from exc
    finally:
        with contextlib.suppress(RedisError, OSError):
            await client.aclose()


async def _shared_limits(config: ServeConfig) -> SharedLimiter | None:
    if config.limits_redis is None:
        return None
    limiter = SharedLimiter.from_url(config.limits_redis, settle_window_s=GatewayConfig().max_timeout_s + 60.0)
    try:
        await limiter.ping()
    except RedisError as exc:
        await limiter.aclose()
        raise ConfigError(f"cannot reach the Redis for shared limits at {_redacted(config.limits_redis)}: {exc}"
                          ) from exc
    return limiter


async def _result_cache(config: CacheConfig, clock: Clock, metrics: GatewayMetrics) -> ResultCache | None:
    local = MemoryStore(config.capacity_bytes, config.ttl_s, clock) if config.capacity_bytes > 0 else None
    shared = None
    if config.redis_url is not None:
        shared = RedisCacheStore.from_url(config.redis_url, config.ttl_s, on_error=metrics.cache_error)
        try:
            await shared.ping()
        except RedisError as exc:
            await shared.aclose()
            raise ConfigError(f"cannot reach the Redis for the result cache at {_redacted(config.redis_url)}: "
                              f"{exc}") from exc
    if local is None and shared is None:
        return None
    return ResultCache(local, shared)


def detect_devices(device: str, num_workers: int | None) -> list[str]:
    """One device name per worker. Uses nvidia-smi so the gateway never imports torch."""
    gpus = _count_gpus() if device in ("auto", "cuda") else 0
    if device == "cuda" and gpus == 0:
        log.warning("--device cuda asked for, but no GPU was found; using the CPU")
    count = num_workers if num_workers is not None else max(gpus, 1)
    if gpus:
        return [f"cuda:{i % gpus}" for i in range(count)]
    return ["cpu"] * count


def _count_gpus() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


async def run(config: ServeConfig, console: Console | None = None) -> None:
    console = console or Console(file=logs.queued_stderr())  # never blocks the event loop
    if config.tls is not None:
        config.tls.check()
    await _check_registry(config)
    run_dir = Path(tempfile.mkdtemp(prefix="sluice-"))
    gateway_metrics = GatewayMetrics()
    clock = MonotonicClock()
    # a tenant's `models` must name the repository's (a cluster's gateway does not know its workers')
    known_models = None if config.remote_workers or config.registry else partial(model_names, config.models_dir)
    tenancy = Tenancy(clock, gateway_metrics, config.tenants_file, await _shared_limits(config),
                      limits_clock=WallClock(), known_models=known_models)
    tracing = tracing_from_environment(clock)
    cache = await _result_cache(config.cache, clock, gateway_metrics)
    gateway = Gateway(clock, gateway_metrics, GatewayConfig(prefix_affinity=config.prefix_affinity), tenancy=tenancy,
                      tracing=tracing, cache=cache)
    # Before anything else starts: a port it cannot have ends `sluice serve` with that error. Until
    # the workers are ready it answers ServerReady false and refuses inference as not ready.
    grpc_server, grpc_url = None, None
    if config.grpc_port is not None:
        try:
            grpc_server, grpc_port = await kserve_grpc.start_server(gateway, config.host, config.grpc_port,
                                                                    config.api.body_limit_bytes, config.tls,
                                                                    access_log=config.api.access_log)
        except ConfigError:
            await tenancy.aclose()
            if cache is not None:
                await cache.aclose()
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        grpc_url = f"{_host(config.host)}:{grpc_port}"
    if config.remote_workers or config.registry:
        devices = [f"remote {address}" for address in config.remote_workers]
        if config.registry:
            devices.append(f"those registered in {_redacted(config.registry)}")
        addresses = list(config.remote_workers)
        specs: list[WorkerSpec] = []
    else:
        gateway.expected_versions = {(v.name, v.version) for v in scan_repository(config.models_dir).versions
                                     if not v.loading.on_demand}
        gateway.workers_share_repository = True
        devices = detect_devices(config.device, config.num_workers)
        addresses = [f"ipc://{run_dir}/worker-{i}.sock" for i in range(len(devices))]
        specs = [WorkerSpec(str(i), addresses[i], config.models_dir, d, (i, len(devices)), config.model_memory_mb,
                            config.load_concurrency)
                 for i, d in enumerate(devices)]
    store = await _open_job_store(config, run_dir)
    executor = JobExecutor(store, config.jobs)
    background = BackgroundResponses(store)
    supervisor = Supervisor(specs, on_exit=gateway.worker_lost,
                            on_restart=lambda worker_id: gateway_metrics.worker_restarted(),
                            config=SupervisorConfig(stop_timeout_s=config.graceful_timeout_s))

    registry = None if config.registry is None else RegistryWatcher(
        config.registry, gateway.add_worker, gateway.remove_worker, serving=gateway.is_serving,
        named=config.remote_workers)
    if config.registry is not None:  # the gateways of a cluster share their traffic splits and canaries
        gateway.shared_traffic = SharedTraffic(config.registry, f"{socket.gethostname()}:{os.getpid()}",
                                               gateway.traffic, gateway.canary_event)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for i, address in enumerate(addresses):
            await gateway.add_worker(str(i), address)
        if registry is not None:
            await registry.start()
        if gateway.shared_traffic is not None:
            await gateway.shared_traffic.start()
        await supervisor.start()
        settle_garbage_collector()
        announcer = asyncio.create_task(_announce(config, server, gateway, devices, console, grpc_url))
        poller = None if config.poll_repository_s is None or not specs else asyncio.create_task(
            _poll_repository(config.models_dir, config.poll_repository_s, gateway))
        tenants_poller = None if config.poll_tenants_s is None or config.tenants_file is None else \
            asyncio.create_task(_poll_tenants(config.tenants_file, config.poll_tenants_s, tenancy))
        await executor.start(asgi_app)  # the full app, middleware included (first: it frees a single server's leases)
        await background.start(asgi_app)
        try:
            yield
        finally:
            announcer.cancel()
            for task in (poller, tenants_poller):
                if task is not None:
                    task.cancel()
            if grpc_server is not None:  # calls in progress finish; new ones are refused
                await grpc_server.stop(config.graceful_timeout_s)
            if registry is not None:
                await registry.aclose()
            if gateway.shared_traffic is not None:
                await gateway.shared_traffic.aclose()
            await background.aclose()
            await executor.aclose()
            await store.aclose()
            gateway.is_draining = True
            await supervisor.aclose()
            await gateway.aclose()
            await tenancy.aclose()
            if cache is not None:
                await cache.aclose()
            await _flush_traces(tracing)
            shutil.rmtree(run_dir, ignore_errors=True)

    asgi_app = build_app(gateway, config.api, lifespan,
                          extra_routes=batches.routes(store, executor.notify, config.api.body_limit_bytes),
                          responses_store=store, background_responses=background)
    server = _Server(uvicorn.Config(
        asgi_app, host=config.host, port=config.port, loop="uvloop",
        http=stamping_protocol(clock, asgi_app.answer_early, config.body_timeout_s, asgi_app.refused),
        access_log=False, log_config=None, backlog=4096,
        timeout_graceful_shutdown=math.ceil(config.graceful_timeout_s + ANSWER_AFTER_GRACE_S),
        timeout_keep_alive=config.keep_alive_s, headers=[("keep-alive", f"timeout={config.keep_alive_s}")],
        **(config.tls.uvicorn_options if config.tls is not None else {}),  # type: ignore[arg-type]
    ), config.graceful_timeout_s, gateway.end_grace)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.handle_exit, sig, None)
    loop.add_signal_handler(signal.SIGHUP, _reload_tenants, tenancy)
    try:
        await server.serve()
    finally:
        if grpc_server is not None:
            await grpc_server.stop(0)


async def _poll_repository(root: Path, interval_s: float, gateway: Gateway) -> None:
    """Every `interval_s`, load again each model whose folder changed (`--poll-repository`),
    except one an admin unloaded. A load that fails (no worker yet) is tried at the next look."""
    seen = await asyncio.to_thread(_fingerprints, root, {})
    while True:
        await asyncio.sleep(interval_s)
        now = await asyncio.to_thread(_fingerprints, root, seen)
        for name in sorted(set(seen) | set(now)):
            if seen.get(name) == now.get(name) or name in gateway.unloaded:
                continue
            try:
                synced = await gateway.sync_model(name)
            except SluiceError as exc:
                log.warning("model %s changed in the repository but could not be loaded yet: %s", name, exc.message)
                continue
            except Exception:  # a bug: logged, and the poller goes on looking (it tries this model again)
                log.exception("model %s changed in the repository; loading it again failed", name)
                continue
            log.warning("model %s changed in the repository: serving version(s) %s%s", name,
                        ", ".join(synced.versions) or "none",
                        "".join(f"; version {version} refused: {why}" for version, why in synced.refused))
            if name in now:
                seen[name] = now[name]
            else:
                seen.pop(name, None)


def _fingerprints(root: Path, before: dict[str, int]) -> dict[str, int]:
    """The repository's fingerprints (`repository.fingerprints`), or `before` if it cannot be read
    now (a folder removed while it was walked, a volume remounting): the next look tries again,
    rather than the poller ending and never looking again."""
    try:
        return fingerprints(root)
    except OSError as exc:
        log.warning("model repository %s not read this time: %s", root, exc)
        return before


async def _poll_tenants(path: Path, interval_s: float, tenancy: Tenancy) -> None:
    """Every `interval_s`, reload the tenants file if it changed (`--poll-tenants`): another file
    at its path (a Kubernetes Secret's update swaps the link to a new one), or the same one
    written. A file that does not load is logged and counted once (`Tenancy.reload`), not at
    every look, and the tenants before it serve until it changes again."""
    seen = await asyncio.to_thread(_file_identity, path)
    while True:
        await asyncio.sleep(interval_s)
        now = await asyncio.to_thread(_file_identity, path)
        if now != seen:
            seen = now
            with contextlib.suppress(ConfigError):
                tenancy.reload()


def _file_identity(path: Path) -> tuple[int, int, int, int] | None:
    """What changes when the file at `path` (through its links) is replaced or written; None: no file."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size


async def _flush_traces(tracing: Tracing) -> None:
    """Send the spans still buffered; an unreachable collector must not hold up the exit."""
    try:
        await asyncio.wait_for(asyncio.to_thread(tracing.shutdown), 5.0)
    except Exception as exc:  # telemetry never fails a shutdown (timeouts included)
        log.warning("tracing: spans not flushed at exit: %s", exc)


def _reload_tenants(tenancy: Tenancy) -> None:
    """SIGHUP: read the tenants file again; requests in flight are not disturbed."""
    with contextlib.suppress(ConfigError):  # logged and counted by `reload`; the old tenants stay
        tenancy.reload()
async def _open_job_store(config: ServeConfig, run_dir: Path) -> JobStore:
    if config.jobs_db is not None:
        return await PostgresJobStore.connect(config.jobs_db)
    if config.data_dir is None:
        log.warning("no --data-dir given: batch jobs are kept in %s and will not survive a restart", run_dir)
    return SqliteJobStore(config.data_dir or run_dir / "data")


ANSWER_AFTER_GRACE_S = 2.0
"""After the grace period, how long requests still in flight have to send their 503 before the
HTTP server closes their connections."""


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM after its graceful shutdown; a drained sluice exits 0 instead.

    When the grace period (`grace_s`) ends with requests still in flight, `on_grace_ended` ends
    them with a 503 (`ShuttingDown`); uvicorn, whose own timeout is `ANSWER_AFTER_GRACE_S`
    longer, would otherwise cancel them and drop their connections."""

    def __init__(self, config: uvicorn.Config, grace_s: float, on_grace_ended: Callable[[], None]) -> None:
        super().__init__(config)
        self._grace_s = grace_s
        self._on_grace_ended = on_grace_ended

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self._grace_s, self._on_grace_ended)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


async def _announce(config: ServeConfig, server: uvicorn.Server, gateway: Gateway, devices: list[str],
                    console: Console, grpc_url: str | None) -> None:
    """Print where we listen and what is ready, once the socket is bound and every model is
    either ready or refused (or after the ready timeout, naming those still loading)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + config.ready_timeout_s
    while loop.time() < give_up and not (server.started and _is_loaded(gateway)):
        await asyncio.sleep(0.1)
    for line in _banner(_url(config, server), gateway, devices, grpc_url):
        console.print(line, soft_wrap=True)  # never wrapped: a broken line breaks a copied command


def _redacted(url: str) -> str:
    """A URL without its password, for the banner."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")).geturl()


def _is_loaded(gateway: Gateway) -> bool:
    """Every expected model is ready or refused, and some worker has reported (it may serve none:
    an empty repository, or models loaded on demand)."""
    return not gateway.loading_models() and bool(gateway.models() or gateway.refused() or gateway.ready_workers())


def _url(config: ServeConfig, server: uvicorn.Server) -> str:
    """The address clients use, with the port the socket really got (`--port 0` picks one)."""
    port = config.port
    sockets = [sock for listening in getattr(server, "servers", []) for sock in listening.sockets]
    if sockets:
        port = sockets[0].getsockname()[1]
    return f"{'http' if config.tls is None else 'https'}://{_host(config.host)}:{port}"


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _banner(url: str, gateway: Gateway, devices: list[str], grpc_url: str | None = None) -> list[str]:
    """`devices` says where the workers are (one entry per worker started here); the count is the
    workers the gateway has, which with a registry are those found there, not its one entry."""
    lines = [f"[bold]sluice {__version__}[/bold] listening on [cyan]{url}[/cyan] "
             f"with {gateway.num_workers()} worker(s) on {', '.join(sorted(set(devices)))}"]
    if grpc_url is not None:
        lines.append(f"  KServe v2 over gRPC on [cyan]{grpc_url}[/cyan] (tritonclient.grpc, KServe's client)")
    models = gateway.models()
    for name, versions in sorted(models.items()):
        for version, info in sorted(versions.items()):
            lines.append(f"  ready: [green]{name}[/green] v{version} ({info.kind}, "
                         f"max batch {info.max_batch_size}, SLO {info.slo_s * 1000:g} ms)")
    for refused in gateway.refused():
        lines.append(f"  [red]refused[/red]: {escape(refused.name)} v{refused.version}: {escape(refused.reason)}")
    for name, version in sorted(gateway.dormant_versions(), key=lambda key: (key[0], version_order(key[1]))):
        lines.append(f"  on demand: [green]{escape(name)}[/green] v{version} (loaded by its first request)")
    if not models and not gateway.refused() and not gateway.dormant_versions() and not gateway.loading_models():
        lines.append("  [yellow]no models[/yellow]: the repository has none (add one, then `sluice models load NAME`)")
    for name in sorted(gateway.loading_models()):
        lines.append(f"  [yellow]not ready[/yellow]: {escape(name)} (still loading)")
    tenancy = gateway.tenancy
    if tenancy.is_open:
        lines.append("  tenants: [yellow]none[/yellow] (no --tenants file): one local tenant, no API keys asked for")
    else:
        lines.append(f"  tenants: {len(tenancy.directory.tenants)} from {escape(str(tenancy.directory.path))} "
                     "(send 'Authorization: Bearer <key>'; SIGHUP reloads the file)")
    lines.append(f"  result cache: {_describe_cache(gateway)}")
    return lines + _examples(url, models, needs_key=not tenancy.is_open, metrics_need_key=tenancy.guards_metrics)


def _describe_cache(gateway: Gateway) -> str:
    cache = gateway.cache
    if cache is None:
        return "[yellow]off[/yellow] (--cache-mb 0)"
    where = [f"{cache.local.capacity_bytes // (1024 * 1024)} MB in memory"] if cache.local is not None else []
    where += ["shared in Redis"] if cache.shared is not None else []
    cached = sorted({name for name, versions in gateway.models().items()
                     if any(info.cache_revision for info in versions.values())})
    return f"{' + '.join(where)}, for {', '.join(cached) or 'no model'} (deterministic answers; " \
           "'Cache-Control: no-cache' skips it)"


def _one_row(info: wire.ModelInfo) -> str:
    """A KServe body of one row for a model of named inputs: zeros (a word for BYTES), each
    variable dimension 2 long."""
    inputs = []
    for spec in info.inputs:
        shape = [1, *(2 if d < 0 else d for d in spec.shape[1:])]
        value: object = "hello" if spec.datatype == "BYTES" else False if spec.datatype == "BOOL" else 0
        inputs.append({"name": spec.name, "shape": shape, "datatype": spec.datatype,
                       "data": [value] * math.prod(shape)})
    return json.dumps({"inputs": inputs})


def _examples(url: str, models: dict[str, dict[str, wire.ModelInfo]], *, needs_key: bool = False,
              metrics_need_key: bool = False) -> list[str]:
    """Commands to try the server with; under a tenants file they send a key (from the
    environment: the banner never holds one), as the server will ask for it."""
    key = ' -H "Authorization: Bearer $SLUICE_API_KEY"' if needs_key else ""
    metrics_key = ' -H "Authorization: Bearer $SLUICE_METRICS_KEY"' if metrics_need_key else ""
    text_model = next((n for n, v in models.items() if any(i.kind == "embedding" for i in v.values())),
                      next((n for n, v in models.items() if any(i.accepts_text for i in v.values())), None))
    tensor = next((i for v in models.values() for i in v.values()
                   if i.accepts_tensor and not i.named_io and i.inputs[0].datatype == "FP32"), None)
    lines = ["Try:"]
    if text_model:
        lines.append(escape(f"  curl {url}/v1/embeddings{key} -H 'Content-Type: application/json' "
                            f"-d '{{\"model\": \"{text_model}\", \"input\": \"hello world\"}}'"))
    named = next((i for v in models.values() for i in v.values() if i.named_io), None)
    if tensor:
        lines.append(escape(f"  curl {url}/v2/models/{tensor.name}/infer{key} -d '{{\"inputs\": [{{\"name\": "
                            f"\"{tensor.inputs[0].name}\", \"shape\": [1, 4], \"datatype\": \"FP32\", "
                            f"\"data\": [1, 2, 3, 4]}}]}}'"))
    elif named:
        lines.append(escape(f"  curl {url}/v2/models/{named.name}/infer{key} -d '{_one_row(named)}'"))
    lines.append(escape(f"  curl {url}/metrics{metrics_key}"))
    top_key = ' --key "$SLUICE_METRICS_KEY"' if metrics_need_key else ""
    lines.append(escape(f"  sluice top --url {url}{top_key}        # batches, queues and latency, live"))
    return lines
