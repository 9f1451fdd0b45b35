"""The `sluice` command line. Environment variables and flags are read here and nowhere else."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from sluice import __version__
from sluice.errors import ConfigError
from sluice.server_url import check_server_url

if TYPE_CHECKING:
    from sluice.api.tls import TlsConfig
    from sluice.gateway.cache import CacheConfig

F = TypeVar("F", bound=Callable[..., Any])


def _log_level_option(command: F) -> F:
    """The gateway's log level, shared by `serve` and `gateway`."""
    return click.option("--log-level", default="warning", show_default=True,
                        type=click.Choice(["debug", "info", "warning", "error"]))(command)


def _limits_option(command: F) -> F:
    """Where tenants' limits are kept, shared by `serve` and `gateway`."""
    return click.option("--limits-redis", default=None, metavar="redis://...",
                        help="Keep tenants' rate limits, concurrency and credits in this Redis, shared by every "
                             "gateway that uses it (default: each gateway keeps its own).")(command)


def _cache_options(command: F) -> F:
    """The result cache's options, shared by `serve` and `gateway`."""
    for option in reversed([
        click.option("--cache-mb", default=256, show_default=True, type=click.IntRange(0, 1 << 20),
                     help="Memory for this gateway's cache of deterministic results (0: none)."),
        click.option("--cache-ttl", "cache_ttl_s", default=3600.0, show_default=True,
                     type=click.FloatRange(min=1.0), help="Seconds a cached result is kept."),
        click.option("--cache-redis", default=None, metavar="redis://...",
                     help="Also keep cached results in this Redis, shared by every gateway that uses it."),
    ]):
        command = option(command)
    return command


def _jobs_options(command: F) -> F:
    """Where batch jobs are kept, shared by `serve` and `gateway`."""
    for option in reversed([
        click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="Keep batch jobs and stored responses here (SQLite) so they survive restarts (default: a "
                          "temporary folder)."),
        click.option("--jobs-db", default=None, metavar="postgresql://...", callback=_postgres_url,
                     help="Keep batch jobs and stored responses in this PostgreSQL database instead (several "
                          "gateways may share it)."),
    ]):
        command = option(command)
    return command


def _grpc_option(command: F) -> F:
    """KServe v2 over gRPC, shared by `serve` and `gateway`."""
    return click.option("--grpc-port", type=click.IntRange(0, 65535), default=None,
                        help="Also serve KServe v2 over gRPC on this port (Triton's is 8001; 0: any free port). "
                             "Default: HTTP only.")(command)


def _access_log_option(command: F) -> F:
    """The access log (`api.access_log`), shared by `serve` and `gateway`."""
    return click.option("--access-log/--no-access-log", default=True, show_default=True,
                        help="Log one JSON line on stderr per finished request (method, path, status, "
                             "duration, request id, tenant, model, outcome; never its body), whatever "
                             "--log-level.")(command)


def _memory_option(command: F) -> F:
    """The memory that models may take, and how many load at once at start, shared by `serve` and `worker`."""
    command = click.option("--load-concurrency", type=click.IntRange(min=1), default=None, metavar="N",
                           help="How many model versions each worker loads at once when it starts (each is "
                                "served as soon as it is ready). Default: 2.")(command)
    return click.option("--model-memory-mb", type=click.IntRange(min=1), default=None, metavar="MB",
                        help="Memory the models may take on each worker (their weights and KV caches): the "
                             "versions loaded at start that do not fit are not loaded (each model's newest "
                             "first); to load a model on demand, the least recently used idle ones that load "
                             "on demand again are unloaded first. Default: no bound.")(command)


def _routing_option(command: F) -> F:
    """Prefix affinity for generations, shared by `serve` and `gateway`."""
    return click.option("--prefix-affinity/--no-prefix-affinity", default=True, show_default=True,
                        help="Send a generation to the worker that has its prompt's start cached, unless "
                             "that worker is busier than another.")(command)


def _graceful_timeout_option(command: F) -> F:
    """How long a stopping server waits for requests in flight, shared by `serve` and `gateway`."""
    return click.option("--graceful-timeout", "graceful_timeout_s", type=click.FloatRange(min=0.0), default=30.0,
                        metavar="SECONDS",
                        help="On SIGTERM, how long requests in flight may take to finish; those still running "
                             "then get a 503 (code server_shutting_down) and the server exits.")(command)


def _poll_tenants_option(command: F) -> F:
    """Reloading the tenants file when it changes, shared by `serve` and `gateway`."""
    return click.option("--poll-tenants", "poll_tenants_s", type=click.FloatRange(min=0.1), default=None,
                        metavar="SECONDS",
                        help="Look for a change of the --tenants file this often and reload it (as SIGHUP does): "
                             "for a file that changes under the server, such as a mounted Kubernetes Secret. "
                             "Default: only on SIGHUP or POST /admin/reload.")(command)


def _tls_options(command: F) -> F:
    """TLS for the HTTP and gRPC listeners, shared by `serve` and `gateway`."""
    file = click.Path(exists=True, dir_okay=False, path_type=Path)
    command = click.option("--ssl-ca-certs", type=file, default=None,
                           help="Require client certificates signed by these CAs (mutual TLS).")(command)
    command = click.option("--ssl-keyfile", type=file, default=None,
                           help="The certificate's private key (PEM).")(command)
    return click.option("--ssl-certfile", type=file, default=None,
                        help="Serve HTTP and gRPC over TLS with this certificate (PEM, chain included).")(command)


def _tls_config(certfile: Path | None, keyfile: Path | None, ca_certs: Path | None) -> TlsConfig | None:
    from sluice.api.tls import TlsConfig

    if certfile is None and keyfile is None:
        if ca_certs is not None:
            raise click.UsageError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile")
        return None
    if certfile is None or keyfile is None:
        raise click.UsageError("give both --ssl-certfile and --ssl-keyfile")
    return TlsConfig(certfile.resolve(), keyfile.resolve(), ca_certs.resolve() if ca_certs else None)


def _kept_path(path: Path | None) -> Path | None:
    """A file read again while serving (the tenants file, on SIGHUP), made absolute but not
    resolved: through its links, as given. A Kubernetes Secret or ConfigMap volume is a link to a
    link (`tenants.toml` -> `..data/tenants.toml`, `..data` -> `..2026_11_27_...`) whose target
    folder is replaced, and the old one deleted, when the Secret changes."""
    return path.absolute() if path is not None else None


def _postgres_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not value.startswith(("postgresql://", "postgres://")):
        raise click.BadParameter("must be a postgresql:// URL")
    return value


@click.group(context_settings={"show_default": True})
@click.version_option(__version__, prog_name="sluice")
def main() -> None:
    """sluice: batch inference requests onto devices, within their deadlines.

    Every option can also be set in the environment, as SLUICE_<COMMAND>_<OPTION> (the flag's
    name): for example SLUICE_GATEWAY_REGISTRY=redis://... for `sluice gateway --registry`
    (secrets stay out of the process list and can come from a Kubernetes Secret).
    """


@main.command()
@click.option("--models", "models_dir", type=click.Path(path_type=Path), default=None,
              help="Model repository folder (default: the demo repository shipped with sluice).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--workers", "num_workers", type=click.IntRange(1, 64), default=None,
              help="Worker processes (default: one per GPU, or one on a machine without a GPU).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--tenants", "tenants_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Tenants file (API keys, weights, limits). Without one: a single local tenant.")
@_log_level_option
@_jobs_options
@_limits_option
@_cache_options
@_grpc_option
@_tls_options
@_routing_option
@_memory_option
@_access_log_option
@_poll_tenants_option
@_graceful_timeout_option
@click.option("--poll-repository", "poll_repository_s", type=click.FloatRange(min=0.1), default=None,
              metavar="SECONDS", help="Look for changes in the model repository this often and load the models "
                                      "that changed. Default: only on `sluice models load`.")
def serve(models_dir: Path | None, host: str, port: int, num_workers: int | None, device: str,
          tenants_file: Path | None, log_level: str, data_dir: Path | None, jobs_db: str | None,
          limits_redis: str | None, cache_mb: int, cache_ttl_s: float, cache_redis: str | None,
          grpc_port: int | None, ssl_certfile: Path | None, ssl_keyfile: Path | None,
          ssl_ca_certs: Path | None, prefix_affinity: bool, model_memory_mb: int | None,
          load_concurrency: int | None, access_log: bool, poll_tenants_s: float | None,
          graceful_timeout_s: float, poll_repository_s: float | None) -> None:
    """Start the embedded server: an HTTP gateway and supervised worker processes."""
    _metrics_dir()
    _no_grpc_fork_handlers()
    os.environ["SLUICE_LOG_LEVEL"] = log_level
    import uvloop

    from sluice import logs, metrics
    from sluice.api import ApiConfig
    from sluice.repository import demo_repository
    from sluice.serve import ServeConfig, run

    logs.configure(log_level, on_dropped=metrics.log_lines_dropped("gateway"))
    config = ServeConfig(models_dir=(models_dir or demo_repository()).resolve(), host=host, port=port,
                         num_workers=num_workers, device=device,
                         tenants_file=_kept_path(tenants_file),
                         data_dir=data_dir.resolve() if data_dir else None, jobs_db=jobs_db,
                         limits_redis=_redis_url(limits_redis),
                         cache=_cache_config(cache_mb, cache_ttl_s, cache_redis), grpc_port=grpc_port,
                         tls=_tls_config(ssl_certfile, ssl_keyfile, ssl_ca_certs), prefix_affinity=prefix_affinity,
                         poll_repository_s=poll_repository_s, poll_tenants_s=poll_tenants_s,
                         model_memory_mb=model_memory_mb, load_concurrency=load_concurrency,
                         graceful_timeout_s=graceful_timeout_s, api=ApiConfig(access_log=access_log))
    try:
        uvloop.run(run(config))
    except ConfigError as exc:
        raise click.ClickException(exc.message) from exc


@main.command()
@click.option("--worker", "workers", multiple=True, callback=lambda ctx, param, value: _addresses(value, "--worker"),
              help="A worker's address, e.g. tcp://10.0.0.5:7000 (repeat for each worker).")
@click.option("--registry", default=None, metavar="redis://...",
              help="Also use the workers registered in this Redis (`sluice worker --registry`), as they "
                   "come and go.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--tenants", "tenants_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Tenants file (API keys, weights, limits).")
@_log_level_option
@_limits_option
@_jobs_options
@_cache_options
@_grpc_option
@_tls_options
@_routing_option
@_access_log_option
@_poll_tenants_option
@_graceful_timeout_option
def gateway(workers: tuple[str, ...], registry: str | None, host: str, port: int, tenants_file: Path | None,
            log_level: str, data_dir: Path | None, jobs_db: str | None, limits_redis: str | None, cache_mb: int,
            cache_ttl_s: float, cache_redis: str | None, grpc_port: int | None, ssl_certfile: Path | None,
            ssl_keyfile: Path | None, ssl_ca_certs: Path | None, prefix_affinity: bool, access_log: bool,
            poll_tenants_s: float | None, graceful_timeout_s: float) -> None:
    """Run a gateway in front of workers started elsewhere with `sluice worker --bind ...`."""
    import uvloop

    from sluice import logs, metrics
    from sluice.api import ApiConfig
    from sluice.repository import demo_repository
    from sluice.serve import ServeConfig, run

    if not workers and not registry:
        raise click.UsageError("name the workers (--worker ADDR) or where they register (--registry redis://...)")
    _no_grpc_fork_handlers()
    logs.configure(log_level, on_dropped=metrics.log_lines_dropped("gateway"))
    config = ServeConfig(models_dir=demo_repository(), host=host, port=port, remote_workers=workers,
                         registry=_redis_url(registry, "--registry"),
                         tenants_file=_kept_path(tenants_file),
                         data_dir=data_dir.resolve() if data_dir else None, jobs_db=jobs_db,
                         limits_redis=_redis_url(limits_redis),
                         cache=_cache_config(cache_mb, cache_ttl_s, cache_redis), grpc_port=grpc_port,
                         tls=_tls_config(ssl_certfile, ssl_keyfile, ssl_ca_certs), prefix_affinity=prefix_affinity,
                         poll_tenants_s=poll_tenants_s, graceful_timeout_s=graceful_timeout_s,
                         api=ApiConfig(access_log=access_log))
    try:
        uvloop.run(run(config))
    except ConfigError as exc:
        raise click.ClickException(exc.message) from exc


@main.command()
@click.option("--id", "worker_id", default="0", show_default=True)
@click.option("--bind", "address", required=True, callback=lambda ctx, param, value: _addresses(value, "--bind"),
              help="Address to listen on for gateways, e.g. tcp://0.0.0.0:7000 or ipc:///run/sluice/w0.sock.")
@click.option("--models", "models_dir", type=click.Path(path_type=Path), required=True)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve this worker's /metrics on this port, and /ready: 200 once the models it "
                   "starts with are loaded, until it drains (a readiness probe's).")
@click.option("--registry", default=None, metavar="redis://...",
              help="Announce this worker in this Redis, where `sluice gateway --registry` finds it.")
@click.option("--advertise", default=None, callback=lambda ctx, param, value: _addresses(value, "--advertise"),
              help="The address gateways reach this worker at, as registered (default: --bind's).")
@click.option("--share", default="0/1", show_default=True, callback=lambda ctx, param, value: _share(value),
              help="I/N: this is worker I of N sharing each external upstream's concurrency limit "
                   "(openai-upstream, http-single); it takes its part. `sluice serve` sets it.")
@click.option("--exit-with-parent", is_flag=True, hidden=True,
              help="Drain and exit when the parent process dies (`sluice serve` sets it for its workers; a "
                   "worker started on its own outlives the shell or script that started it).")
@_memory_option
def worker(worker_id: str, address: str, models_dir: Path, device: str, metrics_port: int | None,
           registry: str | None, advertise: str | None, share: tuple[int, int], exit_with_parent: bool,
           model_memory_mb: int | None, load_concurrency: int | None) -> None:
    """Run one worker process (started for you by `sluice serve`)."""
    from sluice import logs, metrics

    process = f"worker-{worker_id}"
    logs.configure(os.environ.get("SLUICE_LOG_LEVEL", "warning"), process=process,
                   on_dropped=metrics.log_lines_dropped(process))
    from sluice.worker.main import WorkerConfig
    from sluice.worker.main import main as worker_main
    from sluice.worker.syncing import DEFAULT_LOAD_CONCURRENCY

    try:
        worker_main(WorkerConfig(worker_id, address, models_dir, device, share=share,
                                 registry=_redis_url(registry, "--registry"),
                                 advertise=_advertised(address, advertise, registry),
                                 memory_budget_mb=model_memory_mb, metrics_port=metrics_port,
                                 exit_with_parent=exit_with_parent,
                                 load_concurrency=load_concurrency or DEFAULT_LOAD_CONCURRENCY))
    except ConfigError as exc:
        raise click.ClickException(exc.message) from exc


@main.group()
def models() -> None:
    """Model repository tools."""


@models.command("manifest")
@click.argument("version_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def manifest(version_dir: Path) -> None:
    """Write VERSION_DIR/SHA256SUMS over every file in the version folder."""
    from sluice.repository import MANIFEST, write_manifest

    text = write_manifest(version_dir, version_dir / MANIFEST)
    click.echo(text, nl=False)


def _admin_options(command: F) -> F:
    command = click.option("--admin-key", envvar="SLUICE_ADMIN_KEY", show_envvar=True, default=None,
                           help="An admin key (`sluice keys create --admin`); none for a server without "
                                "tenants.")(command)
    return click.option("--url", default="http://127.0.0.1:8000", show_default=True, callback=check_server_url,
                        help="Base URL of the server.")(command)


@models.command("status")
@click.argument("name", required=False)
@_admin_options
@click.option("--json", "as_json", is_flag=True, help="Print the server's JSON answer.")
def models_status(name: str | None, url: str, admin_key: str | None, as_json: bool) -> None:
    """Each model's versions, where its traffic goes, and its latest canary (or NAME's)."""
    from sluice.routing_cli import admin_call, model_path, show

    answer = admin_call(url, admin_key, "GET", model_path(name) if name else "/admin/models")
    show(answer, as_json)


_LOAD_TIMEOUT = click.option(
    "--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=660.0, show_default=True,
    help="Seconds to wait for the answer: the server waits up to 600 s for its workers to load or unload.")


@models.command("load")
@click.argument("name")
@_admin_options
@_LOAD_TIMEOUT
def models_load(name: str, url: str, admin_key: str | None, timeout_s: float) -> None:
    """Bring NAME in line with the model repository on every worker, while they serve: versions
    added to its folder are loaded, versions removed from it are unloaded (a new model is loaded
    whole)."""
    from sluice.routing_cli import admin_call, repository_path

    answer = admin_call(url, admin_key, "POST", repository_path(name, "load"), {}, timeout_s=timeout_s)
    click.echo(f"{name}: serving version{'s' if len(answer['versions']) > 1 else ''} {', '.join(answer['versions'])}")


@models.command("unload")
@click.argument("name")
@_admin_options
@_LOAD_TIMEOUT
def models_unload(name: str, url: str, admin_key: str | None, timeout_s: float) -> None:
    """Take every version of NAME off every worker (after they answer what they hold), until it
    is loaded again."""
    from sluice.routing_cli import admin_call, repository_path

    admin_call(url, admin_key, "POST", repository_path(name, "unload"), {}, timeout_s=timeout_s)
    click.echo(f"{name}: unloaded")


@models.command("traffic")
@click.argument("name")
@click.argument("shares", nargs=-1)
@click.option("--sticky/--no-sticky", default=True, show_default=True,
              help="Keep each caller (X-Sluice-Route-Key or `user`) on one version.")
@click.option("--reset", is_flag=True, help="Go back to the split the model declares in its model.toml.")
@_admin_options
def models_traffic(name: str, shares: tuple[str, ...], sticky: bool, reset: bool, url: str,
                   admin_key: str | None) -> None:
    """Split NAME's requests that name no version: SHARES as VERSION=WEIGHT, e.g. 1=90 2=10."""
    from sluice.routing_cli import admin_call, model_path, parse_shares, show

    if reset == bool(shares):
        raise click.UsageError("give SHARES (e.g. 1=90 2=10) or --reset")
    if reset:
        show(admin_call(url, admin_key, "DELETE", model_path(name, "/traffic")))
    else:
        body = {"traffic": parse_shares(shares), "sticky": sticky}
        show(admin_call(url, admin_key, "PUT", model_path(name, "/traffic"), body))


@models.command("canary")
@click.argument("name")
@click.argument("version")
@click.option("--baseline", default=None, help="The version to compare with [default: the one with most traffic].")
@click.option("--steps", default=None, help="The canary's percent of traffic at each step [default: 5,25,50].")
@click.option("--step-seconds", type=float, default=None, help="Shortest time per step [default: 60].")
@click.option("--min-requests", type=int, default=None, help="Canary answers a step needs [default: 100].")
@click.option("--max-error-rate", type=float, default=None,
              help="Failure rate allowed above the baseline's [default: 0.01].")
@click.option("--max-latency-ratio", type=float, default=None, help="p95 against the baseline's [default: 1.25].")
@_admin_options
def models_canary(name: str, version: str, baseline: str | None, steps: str | None, step_seconds: float | None,
                  min_requests: int | None, max_error_rate: float | None, max_latency_ratio: float | None,
                  url: str, admin_key: str | None) -> None:
    """Move NAME's traffic to VERSION step by step; it is rolled back on its own if it fails more
    often or answers slower than the baseline."""
    from sluice.routing_cli import admin_call, model_path, parse_steps, show

    body = {"version": version, "baseline": baseline, "steps": parse_steps(steps), "step_seconds": step_seconds,
            "min_requests": min_requests, "max_error_rate": max_error_rate,
            "max_latency_ratio": max_latency_ratio}
    show(admin_call(url, admin_key, "POST", model_path(name, "/canary"),
                    {key: value for key, value in body.items() if value is not None}))


@models.command("shadow")
@click.argument("name")
@click.argument("version", required=False)
@click.option("--share", type=float, default=None, help="Share (0-1] of NAME's routed requests copied [default: 1].")
@click.option("--stop", is_flag=True, help="Stop copying NAME's requests to its shadow version.")
@_admin_options
def models_shadow(name: str, version: str | None, share: float | None, stop: bool, url: str,
                  admin_key: str | None) -> None:
    """Copy NAME's requests that name no version to VERSION as well: clients are answered by the
    version their traffic split chose; the copy's answer is only measured (sluice_shadow_* metrics)."""
    from sluice.routing_cli import admin_call, model_path, show

    if stop == (version is not None):
        raise click.UsageError("give VERSION (and --share), or --stop")
    if stop:
        show(admin_call(url, admin_key, "DELETE", model_path(name, "/shadow")))
    else:
        body: dict[str, object] = {"version": version}
        if share is not None:
            body["share"] = share
        show(admin_call(url, admin_key, "PUT", model_path(name, "/shadow"), body))


@models.command("promote")
@click.argument("name")
@_admin_options
def models_promote(name: str, url: str, admin_key: str | None) -> None:
    """Give NAME's running canary its baseline's traffic now."""
    from sluice.routing_cli import admin_call, model_path, show

    show(admin_call(url, admin_key, "POST", model_path(name, "/promote")))


@models.command("rollback")
@click.argument("name")
@_admin_options
def models_rollback(name: str, url: str, admin_key: str | None) -> None:
    """Stop NAME's running canary; else give a promoted canary's traffic back to its baseline, or
    undo an operator's last change of NAME's split."""
    from sluice.routing_cli import admin_call, model_path, show

    show(admin_call(url, admin_key, "POST", model_path(name, "/rollback")))


@main.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, callback=check_server_url,
              help="Base URL of the server.")
@click.option("--key", default=None, help="A metrics or admin key, if the server's /metrics asks for one.")
@click.option("--interval", "interval_s", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between refreshes; each shows what happened over the last interval.")
@click.option("--once", is_flag=True, help="Print one view (two scrapes an interval apart) and exit.")
@click.option("--json", "as_json", is_flag=True, help="With --once: print the view as JSON.")
@click.option("--ca-certs", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="For an https server: check its certificate against these CAs instead of the system's.")
def top(url: str, key: str | None, interval_s: float, once: bool, as_json: bool, ca_certs: Path | None) -> None:
    """Watch a running server: per model answers/s, latency, batch sizes, queues; generation;
    tenants; how busy each worker's device is. Read from its /metrics."""
    import ssl

    from sluice.top import TopError, print_once, watch_live

    if as_json and not once:
        raise click.UsageError("--json needs --once")
    try:
        tls = ssl.create_default_context(cafile=ca_certs) if ca_certs else None
    except ssl.SSLError as exc:
        raise click.BadParameter(f"{ca_certs} holds no PEM certificate that can be read ({exc.reason})",
                                 param_hint="--ca-certs") from None
    try:
        if once:
            print_once(url, key, interval_s, tls, as_json=as_json)
        else:
            watch_live(url, key, interval_s, tls)
    except TopError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--rate", "rate_per_s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Requests per second, all devices together.")
@click.option("--rpm", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Requests per minute instead.")
@click.option("--slo-ms", type=click.FloatRange(min=0, min_open=True), required=True,
              help="Each request's time budget, from its arrival to its answer.")
@click.option("--alpha-ms", type=click.FloatRange(min=0), default=None,
              help="The device's fixed cost of a batch (its latency profile's alpha).")
@click.option("--beta-ms", type=click.FloatRange(min=0), default=None,
              help="The device's cost per unit of a batch's padded cost (its profile's beta).")
@click.option("--url", default=None, callback=lambda ctx, param, value: value and check_server_url(ctx, param, value),
              help="Read alpha and beta from this running server's /metrics instead (with --model).")
@click.option("--model", default=None, help="With --url: the model whose learned latency profile to read.")
@click.option("--version", "model_version", default=None,
              help="With --url: its version (default: the newest one a worker reports).")
@click.option("--key", default=None, help="With --url: a metrics or admin key, if /metrics asks for one.")
@click.option("--cost", "cost_per_item", type=click.IntRange(min=1), default=1, show_default=True,
              help="Each item's cost in the profile's unit (values per row, tokens per input).")
@click.option("--items", "items_per_request", type=click.IntRange(min=1), default=1, show_default=True,
              help="Items (rows, inputs) per request.")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--max-batch-cost", type=click.IntRange(min=1), default=8192, show_default=True)
@click.option("--on-time", "on_time_target", type=click.FloatRange(0, 1, min_open=True), default=0.99,
              show_default=True, help="The share of requests that must be answered within the SLO.")
@click.option("--duration", "duration_s", type=click.FloatRange(min=5), default=30.0, show_default=True,
              help="Simulated seconds per device count.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(rate_per_s: float | None, rpm: float | None, slo_ms: float, alpha_ms: float | None,
         beta_ms: float | None, url: str | None, model: str | None, model_version: str | None, key: str | None,
         cost_per_item: int, items_per_request: int, max_batch_size: int, max_batch_cost: int,
         on_time_target: float, duration_s: float, seed: int, as_json: bool) -> None:
    """How many devices serve a load within its SLO: a formula's estimate, then sluice's own
    scheduler on a virtual clock with the load spread over device counts around it."""
    from sluice.plan_cli import as_json as plan_json
    from sluice.plan_cli import as_text, profile_from
    from sluice.scheduler.plan import Load
    from sluice.scheduler.plan import plan as make_plan

    if (rate_per_s is None) == (rpm is None):
        raise click.UsageError("give the load as --rate (requests/s) or --rpm (requests/min)")
    if url is not None:
        from sluice.top import TopError, fetch

        if model is None or alpha_ms is not None or beta_ms is not None:
            raise click.UsageError("--url reads the profile of --model: give --model, and not --alpha-ms/--beta-ms")
        try:
            _, alpha_s, beta_s = profile_from(fetch(url, key), model, model_version)
        except (TopError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
    elif alpha_ms is None or beta_ms is None:
        raise click.UsageError("describe the device with --alpha-ms and --beta-ms, or read them with --url and --model")
    else:
        alpha_s, beta_s = alpha_ms / 1e3, beta_ms / 1e3
    try:
        load = Load(rate_per_s if rate_per_s is not None else (rpm or 0.0) / 60, slo_ms / 1e3, alpha_s, beta_s,
                    cost_per_item, items_per_request, max_batch_size, max_batch_cost, on_time_target)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    result = make_plan(load, duration_s, seed)
    click.echo(plan_json(result) if as_json else as_text(result, duration_s))


@main.group()
def keys() -> None:
    """API keys in a tenants file."""


@keys.command("create")
@click.argument("tenant", required=False)
@click.option("--tenants", "tenants_file", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("tenants.toml"), show_default=True, help="The tenants file to add the key to.")
@click.option("--admin", "is_admin", is_flag=True, help="Create an admin key instead of a tenant's.")
@click.option("--metrics", "is_metrics", is_flag=True,
              help="Create a key that may only read /metrics (which from then on needs one).")
def create_key(tenant: str | None, tenants_file: Path, is_admin: bool, is_metrics: bool) -> None:
    """Create an API key for TENANT (adding the tenant if new), store its hash, print the key once."""
    from sluice.gateway.keyfile import add_key

    if sum((bool(tenant), is_admin, is_metrics)) != 1:
        raise click.UsageError("name a TENANT, or pass --admin or --metrics (one of them)")
    try:
        key = add_key(tenants_file, tenant, metrics=is_metrics)
    except ConfigError as exc:
        raise click.ClickException(exc.message) from exc
    click.echo(key)
    who = "an admin key" if is_admin else "a metrics key" if is_metrics else f"a key for tenant {tenant!r}"
    click.echo(f"Stored the hash of {who} in {tenants_file}. This is the only time the key is shown.", err=True)
    if not tenant:
        from sluice.gateway.tenants import load_tenants

        try:
            load_tenants(tenants_file)
        except ConfigError as exc:
            needs = ("`sluice serve --tenants` needs at least one tenant: add one with `sluice keys create NAME`"
                     if "defines no tenants" in exc.message else
                     "`sluice serve --tenants` (and a SIGHUP) will refuse the file until that is fixed")
            click.echo(f"Note: {exc.message}. {needs}.", err=True)


_TENANTS_FILE = click.option("--tenants", "tenants_file", type=click.Path(dir_okay=False, path_type=Path),
                             default=Path("tenants.toml"), show_default=True, help="The tenants file.")


@keys.command("list")
@_TENANTS_FILE
def list_keys(tenants_file: Path) -> None:
    """Each key in the tenants file: who it belongs to and the start of its hash (the keys
    themselves are not stored anywhere)."""
    from sluice.gateway.keyfile import list_keys as stored_keys

    try:
        found = stored_keys(tenants_file)
    except ConfigError as exc:
        raise click.ClickException(exc.message) from exc
    for stored in found:
        click.echo(f"{stored.owner:<30} {stored.digest[:23]}")
    if not found:
        click.echo(f"{tenants_file} lists no keys", err=True)


@keys.command("revoke")
@click.argument("key")
@_TENANTS_FILE
def revoke_key(key: str, tenants_file: Path) -> None:
    """Take KEY out of the tenants file: the key itself, or its hash as `sluice keys list` shows it
    (sha256: and at least 8 hex digits). A running server stops taking it at its next reload
    (SIGHUP, or POST /admin/reload)."""
    from sluice.gateway.keyfile import revoke_key as revoke

    try:
        revoked = revoke(tenants_file, key)
    except ConfigError as exc:
        raise click.ClickException(exc.message) from exc
    click.echo(f"Revoked the key {revoked.digest[:23]} ({revoked.owner}) in {tenants_file}. A running server "
               "stops taking it when it reloads the file (SIGHUP, or POST /admin/reload).", err=True)


def _advertised(bind: str, advertise: str | None, registry: str | None) -> str | None:
    """The address to register: --advertise, else --bind's unless it names no reachable host."""
    if advertise or registry is None:
        return advertise
    if any(host in bind for host in ("://0.0.0.0", "://*", "://[::]")):
        raise click.UsageError(f"--bind {bind} listens on every interface: give --advertise with the address "
                               "gateways should use, e.g. tcp://10.0.0.5:7000")
    return None


def _addresses(value: str | tuple[str, ...] | None, option: str) -> Any:
    """A worker's address (or each of several) as the transport reads it: a usage error, not a
    traceback at start-up."""
    from sluice.transport import Address

    addresses: tuple[str, ...] = (value,) if isinstance(value, str) else value or ()
    for address in addresses:
        try:
            Address.parse(address)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint=option) from None
    return value


def _share(value: str) -> tuple[int, int]:
    index, _, count = value.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise click.BadParameter(f"must be I/N with 0 <= I < N, got {value!r}", param_hint="--share")
    return int(index), int(count)


def _no_grpc_fork_handlers() -> None:
    """Before grpc is imported: a gateway starts worker processes (fork and exec) while its gRPC
    server runs; gRPC's fork handlers are for children that use gRPC, which these never do (with
    them on, gRPC logs that it skipped them at every start)."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def _metrics_dir() -> None:
    """Share one Prometheus multiprocess folder between the gateway and its workers."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="sluice-metrics-")
    if "sluice.metrics" in sys.modules:
        raise RuntimeError("sluice.metrics was imported before the metrics folder was set")


try:
    from sluice.bench.cli import bench

    main.add_command(bench)
except ImportError:  # pragma: no cover - the bench package is optional at import time
    pass

from sluice.jobs.cli import batch  # noqa: E402

main.add_command(batch)


def _environment_names(group: click.Group, prefix: str) -> None:
    """Name each option's environment variable after its command and flag, `SLUICE_GATEWAY_JOBS_DB`
    for `sluice gateway --jobs-db` (click's automatic names follow the Python parameter instead,
    `--tenants` would be `..._TENANTS_FILE`). Options that name shared variables of their own
    (`SLUICE_API_KEY`, `SLUICE_ADMIN_KEY`) take those too, after this one, which wins: the rule
    that `--help` states holds for every option."""
    for name, command in group.commands.items():
        path = f"{prefix}_{name.upper().replace('-', '_')}"
        if isinstance(command, click.Group):
            _environment_names(command, path)
            continue
        for param in command.params:
            if not isinstance(param, click.Option):
                continue
            flag = max(param.opts, key=len).lstrip("-").split("/")[0]
            own = f"{path}_{flag.upper().replace('-', '_')}"
            shared = [] if param.envvar is None else [param.envvar] if isinstance(param.envvar, str) else param.envvar
            param.envvar = own if not shared else [own, *(n for n in shared if n != own)]
            param.show_envvar = True


def _redis_url(url: str | None, option: str = "--limits-redis") -> str | None:
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        raise click.BadParameter("must be a redis://, rediss:// or unix:// URL", param_hint=option)
    return url


def _cache_config(cache_mb: int, ttl_s: float, redis_url: str | None) -> CacheConfig:
    from sluice.gateway.cache import CacheConfig

    return CacheConfig(capacity_bytes=cache_mb * 1024 * 1024, ttl_s=ttl_s,
                       redis_url=_redis_url(redis_url, "--cache-redis"))


_environment_names(main, "SLUICE")
