"""Entry point of a worker process: list its models, listen, then load, verify and warm them up
while gateways already see it (and what it is loading).

Started by the embedded supervisor (`sluice serve`) or on its own (`sluice worker`).
SIGTERM drains: stop admitting, finish what is queued, exit 0.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from sluice import wire
from sluice.clock import MonotonicClock
from sluice.engines import load_runner
from sluice.engines.base import TORCH_KINDS, Share
from sluice.engines.device_gate import one_load_at_a_time
from sluice.errors import ConfigError
from sluice.metrics import WorkerMetrics, worker_registry
from sluice.registry import WorkerRegistration
from sluice.repository import ModelVersion, footprint_bytes, scan_repository, verify
from sluice.runtime import settle_garbage_collector
from sluice.worker.loading import LoadedModel, RepositoryModel
from sluice.worker.probes import serve_probes
from sluice.worker.server import WorkerServer
from sluice.worker.syncing import DEFAULT_LOAD_CONCURRENCY

log = logging.getLogger("sluice.worker")
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    worker_id: str
    address: str
    models_dir: Path
    device: str = "cpu"
    model_names: tuple[str, ...] = ()  # empty: every model in the repository
    share: Share = (0, 1)
    """Worker `index` of `count`: its part of each external upstream's concurrency."""
    registry: str | None = None
    """A Redis URL: announce `advertise` there for gateways to find (`sluice.registry`)."""
    advertise: str | None = None
    """The address gateways reach this worker at (default: `address`)."""
    memory_budget_mb: int | None = None
    """What its models may take (`WorkerServer`'s `memory_budget_bytes`); None: no bound."""
    load_concurrency: int = DEFAULT_LOAD_CONCURRENCY
    """How many of its versions it loads at once when it starts (`sluice worker --load-concurrency`)."""
    metrics_port: int | None = None
    """Serve `/metrics` and the readiness probe's `/ready` on this port (`worker.probes`)."""
    exit_with_parent: bool = False
    """Drain when the parent process dies (`exit_with_parent`): for the workers `sluice serve`
    supervises, not for one started on its own, which outlives the shell that started it."""


def load_models(config: WorkerConfig) -> tuple[dict[tuple[str, str], LoadedModel], list[wire.RefusedModel],
                                               list[ModelVersion]]:
    """Every model version of the repository this worker serves, loaded, those it refused, and
    those it loads on demand (`[loading] on_demand`), not loaded yet. (A worker process lists
    them and loads them once it listens: `run_worker`.)"""
    startup, refused, dormant = scan_models(config)
    source = RepositorySource(config)
    models: dict[tuple[str, str], LoadedModel] = {}
    for version in startup:
        loaded = source.load(version)
        if isinstance(loaded, LoadedModel):
            models[version.key] = loaded
        else:
            refused.append(loaded)
    return models, refused, dormant


def scan_models(config: WorkerConfig) -> tuple[list[ModelVersion], list[wire.RefusedModel], list[ModelVersion]]:
    """The versions this worker loads when it starts, those it refused, and those it loads on demand."""
    versions, refused = _scan(config)
    return [v for v in versions if not v.loading.on_demand], refused, [v for v in versions if v.loading.on_demand]


class RepositorySource:
    """The worker's models from its repository folder (`worker.loading.ModelSource`)."""

    def __init__(self, config: WorkerConfig) -> None:
        self._config = config

    def scan(self, name: str) -> RepositoryModel:
        """What the repository has of `name` now: a version whose settings cannot be read is still
        in the folder (one already held is kept as it is, not taken off as if it had been removed)."""
        if self._config.model_names and name not in self._config.model_names:
            return RepositoryModel([], [], [])  # not this worker's model
        present, refused = _scan(self._config, name)
        folders = [version.version for version in present] + [r.version for r in refused if r.version != "-"]
        return RepositoryModel(folders, present, refused)

    def load(self, version: ModelVersion) -> LoadedModel | wire.RefusedModel:
        """Verify and load one version, or say why not."""
        if version.kind in TORCH_KINDS and "torch" not in sys.modules:
            # torch is imported by the first load that needs it (a worker of other models starts
            # without it, seconds sooner); its module graph is then taken out of the garbage
            # collector's full walks, as start-up's objects were (before this version's own
            # objects). No collection first: on a load thread its full walk would stall the loop
            # serving the other models for as long.
            import torch  # noqa: F401

            gc.freeze()
        try:
            if version.generator == "tiny-lm":
                from sluice.engines.generative.tiny import ensure_tiny_lm

                ensure_tiny_lm(version.weights_dir)
            verify(version)
            with one_load_at_a_time(self._config.device):
                runner = load_runner(version, self._config.device, self._config.share)
        except ConfigError as exc:
            log.error("refusing %s v%s: %s", version.name, version.version, exc.message)
            return wire.RefusedModel(version.name, version.version, exc.message)
        except Exception as exc:  # a runner that cannot load (bad weights, no memory): refuse it alone
            log.exception("refusing %s v%s: loading failed", version.name, version.version)
            return wire.RefusedModel(version.name, version.version, f"loading failed: {type(exc).__name__}: {exc}")
        log.info("loaded %s v%s (%s) on %s", version.name, version.version, version.kind, self._config.device)
        return LoadedModel(version, runner, footprint_bytes(version))


def _scan(config: WorkerConfig, name: str | None = None) -> tuple[list[ModelVersion], list[wire.RefusedModel]]:
    """The repository's versions this worker serves and the refused ones (of model `name` only,
    if given)."""
    repository = scan_repository(config.models_dir)
    served = [version for version in repository.versions if name in (None, version.name)
              and (not config.model_names or version.name in config.model_names)]
    return served, [wire.RefusedModel(r.name, r.version, r.reason) for r in repository.refused
                    if name in (None, r.name)]


async def run_worker(config: WorkerConfig) -> None:
    startup, refused, dormant = scan_models(config)  # loaded once it listens: gateways see them loading
    server = WorkerServer(config.worker_id, {}, refused, MonotonicClock(), WorkerMetrics(config.worker_id),
                          RepositorySource(config), dormant,
                          None if config.memory_budget_mb is None else config.memory_budget_mb * 1024 * 1024,
                          startup=startup, load_concurrency=config.load_concurrency)
    probes = None
    if config.metrics_port is not None:
        try:
            probes = serve_probes(config.metrics_port, worker_registry(), server.not_ready)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on port {config.metrics_port}: {exc.strerror or exc}") from None
    settle_garbage_collector()
    registration = None if config.registry is None else WorkerRegistration(
        config.registry, config.worker_id, config.advertise or config.address)

    def drain() -> None:
        server.drain()
        if registration is not None:
            registration.withdraw()  # gateways stop sending work before the worker goes

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, drain)
    loop.add_signal_handler(signal.SIGINT, drain)
    try:  # registered once it listens: a gateway that reads the registry can connect at once
        await server.serve(config.address, registration.start if registration is not None else lambda: None)
    finally:
        if registration is not None:
            await registration.aclose()
        if probes is not None:
            await asyncio.to_thread(probes.shutdown)
            probes.server_close()


def exit_with_parent() -> None:
    """Have the kernel SIGTERM this worker when its parent dies (Linux), so a `kill -9`ed
    `sluice serve` leaves no orphan holding the device. SIGTERM drains, as usual."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("could not ask to exit with the parent process (errno %d)", ctypes.get_errno())
    elif os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main(config: WorkerConfig) -> None:
    import uvloop

    if config.exit_with_parent:
        exit_with_parent()
    log.info("worker %s starting (pid %d)", config.worker_id, os.getpid())
    uvloop.run(run_worker(config))
