"""The model versions a worker serves (`ModelTable`): each one's runner, and the loop that runs a
generative or upstream one, from registration (`register`) to the moment it is freed (`free`).

    register ─▶ served (in `infos`: reported to gateways) ─▶ retire ─▶ retiring ─▶ free
                                                   └── dormant: loaded again on demand

A version taken off (`retire`) stops being reported at once, but keeps its runner until it has
answered what it holds (`syncing.ModelSyncer.free_retired` decides when).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from sluice import wire
from sluice.clock import Clock
from sluice.engines.base import Runner, is_generative
from sluice.engines.openai_upstream import OpenAIUpstreamRunner
from sluice.metrics import WorkerMetrics
from sluice.repository import ModelVersion
from sluice.scheduler import LatencyProfile, Scheduler
from sluice.scheduler.batcher import ModelKey
from sluice.worker.generation import GenerationLoop, OnOutputs
from sluice.worker.loading import LoadedModel
from sluice.worker.outbox import Outbox
from sluice.worker.upstream import UpstreamLoop

if TYPE_CHECKING:
    from sluice.engines.generative.runner import GenerativeRunner

log = logging.getLogger("sluice.worker")

RETIRE_AFTER_S = 0.5
"""A version taken off (`SyncModel`) still takes the requests sent before the gateways heard it
was (its report goes out at once, so within a few ms); it is freed once idle and this long after."""


class ModelTable:
    """The served versions by `ModelKey`. One-shot runners are also the scheduler's models (added
    and removed under `lock`, which the device thread shares); generative and upstream ones get a
    loop of their own once the worker serves (`attach`)."""

    def __init__(self, scheduler: Scheduler, lock: threading.Lock, clock: Clock, metrics: WorkerMetrics,
                 outbox: Outbox, on_generated: OnOutputs, on_idle: Callable[[], None],
                 dormant: dict[ModelKey, ModelVersion]) -> None:
        """`outbox`, `on_generated`, `on_idle`: for the loops of generative and upstream versions.
        `dormant`: versions loaded on demand, not loaded yet."""
        self._scheduler = scheduler
        self._lock = lock
        self._clock = clock
        self._metrics = metrics
        self._outbox = outbox
        self._on_generated = on_generated
        self._on_idle = on_idle
        self.generators: dict[ModelKey, GenerativeRunner] = {}
        self.upstreams: dict[ModelKey, OpenAIUpstreamRunner] = {}
        self.runners: dict[ModelKey, Runner] = {}
        """One-shot runners; the device thread reads it under `lock`."""
        self.infos: dict[ModelKey, wire.ModelInfo] = {}
        """What the served versions are reported as (`WorkerState.models`)."""
        self.typical_cost: dict[ModelKey, float] = {}
        self.retiring: dict[ModelKey, tuple[wire.ModelInfo, float]] = {}
        """Versions taken off: their info, and the earliest time they may be freed."""
        self.dormant = dormant
        """Versions loaded on demand (a `SyncModel` from a gateway that got a request for one)."""
        self.versions: dict[ModelKey, ModelVersion] = {}
        self.footprints: dict[ModelKey, int] = {}
        self.last_used: dict[ModelKey, float] = {}
        """When each loaded version last got a request (or was loaded): for `[loading] idle_unload_s`."""
        self.generation_loops: dict[ModelKey, GenerationLoop] = {}
        self.upstream_loops: dict[ModelKey, UpstreamLoop] = {}
        self._tenant_weights: dict[str, float] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def register(self, key: ModelKey, model: LoadedModel, timings: list[tuple[int, float]]) -> None:
        """Serve a loaded, warmed-up model version (its engine's loop starts in `attach`)."""
        runner = model.runner
        if is_generative(runner):
            self.generators[key] = runner
            self._metrics.engine_started(*key, runner.engine.stats())
        elif isinstance(runner, OpenAIUpstreamRunner):
            self.upstreams[key] = runner
        else:
            alpha, beta, ref = runner.prior()
            # measured warm-up batches outweigh the runner's guess, and the first real batches
            # outweigh them (a warm-up on a busy host is too slow); with none, the prior stands
            profile = LatencyProfile(alpha, beta, ref, prior_weight=0.5 if timings else 4.0, warmup=timings)
            with self._lock:
                self._scheduler.add_model(key, model.version.batching, profile)
                self.runners[key] = runner
            self.typical_cost[key] = float(ref)
        self.infos[key] = msgspec.structs.replace(runner.info, routing=model.version.routing)
        self.versions[key] = model.version
        self.footprints[key] = model.footprint_bytes
        self.last_used[key] = self._clock.now()
        self.dormant.pop(key, None)

    async def attach(self, key: ModelKey) -> None:
        """Start the loop of a generative or upstream model version registered while not serving."""
        loop = asyncio.get_running_loop()
        if key in self.generators and key not in self.generation_loops:
            generation_loop = self.generation_loops[key] = GenerationLoop(self.generators[key], self._on_generated,
                                                                          loop)
            if self._tenant_weights is not None:
                generation_loop.set_tenant_weights(self._tenant_weights)
        if key in self.upstreams and key not in self.upstream_loops:
            upstream = self.upstream_loops[key] = UpstreamLoop(self.upstreams[key], self._outbox.reply, self._clock,
                                                               self._on_idle)
            if self._tenant_weights is not None:
                upstream.set_tenant_weights(self._tenant_weights)
            await upstream.start()

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        """Weigh tenants so in every queue (raises `ValueError` for unusable weights)."""
        self._tenant_weights = weights
        with self._lock:
            self._scheduler.set_tenant_weights(weights)
        for generation_loop in self.generation_loops.values():
            generation_loop.set_tenant_weights(weights)
        for upstream in self.upstream_loops.values():
            upstream.set_tenant_weights(weights)

    def retire(self, key: ModelKey, *, dormant: bool = False) -> None:
        """Stop reporting a served version; it is freed once it holds no work
        (`ModelSyncer.free_retired`).
        `dormant`: it is loaded again on demand."""
        self.retiring[key] = (self.infos.pop(key), self._clock.now() + RETIRE_AFTER_S)
        if dormant:
            self.dormant[key] = self.versions[key]

    def free(self, key: ModelKey) -> None:
        runner = self.runners.get(key)
        if runner is not None:
            with self._lock:
                self._scheduler.remove_model(key)
                del self.runners[key]
            runner.close()
        generator = self.generators.pop(key, None)
        if generator is not None:
            generation_loop = self.generation_loops.pop(key, None)
            if generation_loop is not None:
                generation_loop.stop()  # its engine has nothing left: the thread ends at once
            generator.close()
        if self.upstreams.pop(key, None) is not None:
            upstream = self.upstream_loops.pop(key, None)
            if upstream is not None:
                task = asyncio.create_task(upstream.aclose())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        self.typical_cost.pop(key, None)
        self.versions.pop(key, None)
        self.footprints.pop(key, None)
        self.last_used.pop(key, None)
        log.info("unloaded %s v%s", *key)

    async def aclose(self) -> None:
        """Stop every loop and close every runner (the worker has drained)."""
        for upstream in self.upstream_loops.values():
            await upstream.aclose()
        for generation_loop in self.generation_loops.values():
            generation_loop.stop()
        for runner in self.runners.values():
            runner.close()
        for generator in self.generators.values():
            generator.close()
