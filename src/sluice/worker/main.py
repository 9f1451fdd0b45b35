"""Entry point of a worker process: load and verify models, warm them up, serve gateways.

Started by the embedded supervisor (`sluice serve`) or on its own (`sluice worker`).
SIGTERM drains: stop admitting, finish what is queued, exit 0.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from sluice import wire
from sluice.clock import MonotonicClock
from sluice.engines import load_runner
from sluice.engines.base import Share
from sluice.errors import ConfigError
from sluice.metrics import WorkerMetrics
from sluice.registry import WorkerRegistration
from sluice.repository import ModelVersion, footprint_bytes, scan_repository, verify
from sluice.runtime import settle_garbage_collector
from sluice.worker.server import LoadedModel, ModelLoader, RepositoryModel, WorkerServer

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
    exit_with_parent: bool = False
    """Drain when the parent process dies (`exit_with_parent`): for the workers `sluice serve`
    supervises, not for one started on its own, which outlives the shell that started it."""


def load_models(config: WorkerConfig) -> tuple[dict[tuple[str, str], LoadedModel], list[wire.RefusedModel],
                                               list[ModelVersion]]:
    """Every model version of the repository this worker serves, loaded, those it refused, and
    those it loads on demand (`[loading] on_demand`), not loaded yet."""
    versions, refused = _scan(config)
    models: dict[tuple[str, str], LoadedModel] = {}
    dormant = [version for version in versions if version.loading.on_demand]
    for version in versions:
        if not version.loading.on_demand:
            _load_into(models, refused, version, config)
    return models, refused, dormant


def model_loader(config: WorkerConfig) -> ModelLoader:
    """How the worker loads a model again at run time (`WorkerServer` `SyncModel`): the versions the
    repository has of it now, those of them not in `skip` loaded, and the refused ones."""

    def load(name: str, skip: set[tuple[str, str]]) -> RepositoryModel:
        if config.model_names and name not in config.model_names:
            return RepositoryModel([], {}, [])  # not this worker's model
        present, refused = _scan(config, name)
        # a version whose settings cannot be read now is still in the folder: one already held is
        # kept as it is (its files are not read again), not taken off as if it had been removed
        folders = [version.version for version in present] + [r.version for r in refused if r.version != "-"]
        models: dict[tuple[str, str], LoadedModel] = {}
        for version in present:
            if version.key not in skip:
                _load_into(models, refused, version, config)
        return RepositoryModel(folders, models, refused)

    return load


def _scan(config: WorkerConfig, name: str | None = None) -> tuple[list[ModelVersion], list[wire.RefusedModel]]:
    """The repository's versions this worker serves and the refused ones (of model `name` only,
    if given)."""
    repository = scan_repository(config.models_dir)
    served = [version for version in repository.versions if name in (None, version.name)
              and (not config.model_names or version.name in config.model_names)]
    return served, [wire.RefusedModel(r.name, r.version, r.reason) for r in repository.refused
                    if name in (None, r.name)]


def _load_into(models: dict[tuple[str, str], LoadedModel], refused: list[wire.RefusedModel], version: ModelVersion,
               config: WorkerConfig) -> None:
    """Verify and load one version into `models`, or say why not in `refused`."""
    try:
        if version.generator == "tiny-lm":
            from sluice.engines.generative.tiny import ensure_tiny_lm

            ensure_tiny_lm(version.weights_dir)
        verify(version)
        runner = load_runner(version, config.device, config.share)
    except ConfigError as exc:
        log.error("refusing %s v%s: %s", version.name, version.version, exc.message)
        refused.append(wire.RefusedModel(version.name, version.version, exc.message))
        return
    except Exception as exc:  # a runner that cannot load (bad weights, no memory): refuse it alone
        log.exception("refusing %s v%s: loading failed", version.name, version.version)
        reason = f"loading failed: {type(exc).__name__}: {exc}"
        refused.append(wire.RefusedModel(version.name, version.version, reason))
        return
    models[version.key] = LoadedModel(version, runner, footprint_bytes(version))
    log.info("loaded %s v%s (%s) on %s", version.name, version.version, version.kind, config.device)


async def run_worker(config: WorkerConfig) -> None:
    models, refused, dormant = load_models(config)
    server = WorkerServer(config.worker_id, models, refused, MonotonicClock(), WorkerMetrics(config.worker_id),
                          model_loader(config), dormant,
                          None if config.memory_budget_mb is None else config.memory_budget_mb * 1024 * 1024)
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
