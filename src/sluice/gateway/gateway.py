"""The gateway core: model lookup, deadline, replica choice, dispatch, re-dispatch after a crash.

`infer()` always ends in a result or one of the errors in `sluice.errors`; it never leaves a
request hanging: the worker answers every request it accepted, a worker that dies resolves its
in-flight requests at once (re-dispatched if they had not started and the deadline allows), and
a last-resort timer covers a worker that goes silent.

`sync_model()` loads and unloads models on the workers while they serve (`api.triton`'s
repository extension, `sluice models load|unload`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from redis.exceptions import RedisError

from sluice import wire
from sluice.clock import Clock, WallClock
from sluice.errors import (
    Conflict,
    DeadlineExceeded,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    ModelRefused,
    Overloaded,
    RateLimited,
    SluiceError,
    Unavailable,
    WorkerLost,
)
from sluice.gateway import router
from sluice.gateway.cache import CACHE_HEADER, CachedResult, CachePolicy, ResultCache, cache_key
from sluice.gateway.connection import InFlight, WorkerConnection
from sluice.gateway.shared_traffic import SharedTraffic, Stale
from sluice.gateway.statistics import InferenceStatistics, Ran
from sluice.gateway.tenancy import RequestGroup, Tenancy
from sluice.gateway.ticket import InferResult, Ticket, interpret, is_device_failure
from sluice.gateway.traffic import CanaryEvent, Split, Traffic, version_order
from sluice.metrics import GatewayMetrics
from sluice.priority import Priority, effective_priority
from sluice.tracing import Tracing

log = logging.getLogger("sluice.gateway")


MAX_TIMEOUT_S = 600.0
"""The longest deadline a request may ask for; the API layer checks it against each source
(`X-Request-Timeout-Ms`, the KServe `timeout` parameter) so that the error names that source."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    max_timeout_s: float = MAX_TIMEOUT_S
    answer_grace_s: float = 5.0
    """How long past a deadline to wait for a silent worker before giving up on it."""
    redispatch_poll_s: float = 0.02
    prefix_affinity: bool = True
    """A generation goes to the replica that has its prompt's prefix cached, unless that one is
    busier (`router.PrefixAffinity`); False: by load alone."""


@dataclass(frozen=True, slots=True)
class ModelSync:
    """What the workers did on `Gateway.sync_model`."""

    model: str
    versions: list[str]
    """The versions the workers that answered serve now."""
    refused: list[tuple[str, str]]
    """(version, why) of the versions they could not load."""
    unanswered: list[str]
    """Workers that did not answer in time, or died meanwhile."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request is for, as the API layer learned it."""

    tenant: str = ""
    priority: Priority | None = None
    """The class the request asked for; it can only lower the tenant's default."""
    estimated_tokens: float = 0.0
    """A bound on the request's tokens, reserved against the tenant's tokens-per-minute limit until
    the real count is known."""
    traceparent: str | None = None
    """The caller's W3C trace context, if it sent one: the request's span joins that trace."""
    cache: CachePolicy = CachePolicy.USE
    """What the request lets the result cache do (its `Cache-Control` header)."""
    group: RequestGroup | None = None
    """One part of a client request made of several (a batch of prompts): the tenant's limits
    count the whole request once (`tenancy.RequestGroup`)."""
    background: bool = False
    """A batch job's item (the job executor's, never a client's say): it yields to online work
    on the device (`sluice.scheduler.backlog`)."""
    likely_tokens: float | None = None
    """A guess at its tokens (`estimated_tokens` is a bound): a request likely to need more than a
    minute's worth is refused for good. None: the bound is the guess."""


class Gateway:
    def __init__(self, clock: Clock, metrics: GatewayMetrics, config: GatewayConfig | None = None,
                 tenancy: Tenancy | None = None, tracing: Tracing | None = None,
                 cache: ResultCache | None = None, wall_clock: Clock | None = None) -> None:
        self._clock = clock
        self.cache = cache
        self._metrics = metrics
        self._tracing = tracing or Tracing()
        self._config = config or GatewayConfig()
        self.tenancy = tenancy or Tenancy(clock, metrics)
        self.gateway_id = f"gw-{uuid.uuid4().hex[:12]}"
        self._connections: dict[str, WorkerConnection] = {}
        self._next_id = 0
        self._rng = random.Random()
        self._affinity = router.PrefixAffinity()
        self._ejections = router.Ejections()
        self.is_draining = False
        self.unloaded: dict[str, list[str]] = {}
        """Models unloaded through this gateway (`sync_model`), that a restarted worker must not
        serve, with the versions they had."""
        self._next_sync_id = 0
        self._on_demand_loads: dict[str, tuple[asyncio.Task[None], float]] = {}
        """Each model being loaded on demand: the load, and when it started."""
        self._load_seconds: dict[str, float] = {}
        """How long each model's loads on demand take (a moving average): the `Retry-After` of the next."""
        self._syncing: dict[str, int] = {}
        """Models an admin's load is bringing in line with the repository now (`sync_model`): how many loads."""
        self._on_demand_refusals: dict[str, str] = {}
        """Why the last load on demand of each model loaded nothing (its worker's memory budget)."""
        self.expected_versions: set[tuple[str, str]] = set()
        """(model, version) of the repository's versions: one asked for before it is ready is a
        503 ("not ready yet"), not a 404. Those removed from the repository are forgotten as the
        workers' reports show it (`_forget_removed`)."""
        self.workers_share_repository = False
        """Every worker serves the whole of one repository (`sluice serve`): a worker's report says
        all it has, so a model it does not report at all was removed too."""
        self._index: _ModelIndex | None = None  # rebuilt lazily after a worker's change
        self.tenancy.on_weights(self._send_weights)
        self.traffic = Traffic()
        """Operators' traffic splits and canaries (`api.admin`), over the splits models declare."""
        self.shared_traffic: SharedTraffic | None = None
        """Where `traffic` is shared with the other gateways of a cluster (`serve` sets it)."""
        self.statistics = InferenceStatistics(wall_clock or WallClock())
        """Triton-style per-version counts and durations of the requests this gateway answered."""

    # -- workers -------------------------------------------------------------------------------

    async def add_worker(self, worker_id: str, address: str) -> None:
        connection = WorkerConnection(worker_id, address, self.gateway_id)
        connection.on_change = functools.partial(self._worker_changed, connection)
        connection.on_batch_stats = functools.partial(self.statistics.executions, source=worker_id)
        self._connections[worker_id] = connection
        await connection.start()
        connection.set_weights(self.tenancy.weights())

    def _send_weights(self, weights: dict[str, float]) -> None:
        for connection in self._connections.values():
            connection.set_weights(weights)

    def worker_lost(self, worker_id: str) -> None:
        """Called when a worker process is known to have died (e.g. by the supervisor)."""
        connection = self._connections.get(worker_id)
        if connection is None:
            return
        lost = connection.mark_lost()
        if lost:
            log.warning("worker %s lost with %d requests in flight", worker_id, len(lost))

    def is_serving(self, worker_id: str) -> bool:
        """The worker is connected, reports within `STALE_AFTER_S` and is not draining: it is still
        there, whatever the registry says (`registry.RegistryWatcher`)."""
        connection = self._connections.get(worker_id)
        return (connection is not None and connection.is_alive() and connection.state is not None
                and not connection.state.is_draining)

    async def remove_worker(self, worker_id: str) -> None:
        """Stop using a worker for good (it left the registry). It is sent nothing new from now
        on; while it still reports (a draining worker, whose report saying so may not have
        arrived yet), it first answers what it has. One that went silent is dropped at once:
        what it had not started goes to another worker, what it had is answered 503."""
        connection = self._connections.get(worker_id)
        if connection is None:
            return
        connection.mark_leaving()
        until = time.monotonic() + self._config.max_timeout_s
        while connection.num_in_flight and connection.is_alive() and time.monotonic() < until:
            await asyncio.sleep(0.05)
        if self._connections.get(worker_id) is not connection:
            return
        del self._connections[worker_id]
        # what it served exists, with no worker for now (a rolling restart): 503 "try again", not 404
        self.expected_versions |= {(info.name, info.version) for info in connection.known_models}
        self.expected_versions |= set(connection.loading)
        lost = connection.mark_lost()
        if lost:
            log.warning("worker %s removed with %d requests in flight", worker_id, len(lost))
        self._invalidate()
        await connection.aclose()

    async def aclose(self) -> None:
        for task, _ in list(self._on_demand_loads.values()):
            task.cancel()
        for connection in self._connections.values():
            await connection.aclose()

    def num_replicas(self, name: str, version: str) -> int:
        """How many ready workers serve this model version."""
        return len(self._indexed().replicas.get((name, version), ()))

    def ready_workers(self) -> list[WorkerConnection]:
        return [c for c in self._connections.values() if c.is_ready]

    def refresh_metrics(self) -> None:
        """Update gauges that are cheaper to compute on scrape than on every change."""
        self._metrics.workers_ready(len(self.ready_workers()))
        self._metrics.traffic_shares(self.traffic_shares())
        self._metrics.ejections(self._ejections.known(self._clock.now()))
        if self.cache is not None:
            self._metrics.cache_state(self.cache)

    # -- models --------------------------------------------------------------------------------

    def _invalidate(self) -> None:
        self._index = None

    def _worker_changed(self, connection: WorkerConnection) -> None:
        """A worker's readiness or models changed. One that serves a model unloaded through this
        gateway (it restarted, and loaded its whole repository) is told to unload it again."""
        self._invalidate()
        for name in {info.name for info in connection.known_models} & self.unloaded.keys():
            connection.sync_model(self._new_sync_id(), name, unload=True)
        self._forget_removed(connection)

    def _forget_removed(self, connection: WorkerConnection) -> None:
        """Stop expecting the versions removed from the repository: those of a model the worker
        reports (served, loading, refused or loaded on demand; any model, if the workers share
        one repository) that it does not have, and that no worker has. Else a request for one
        would be answered 503 "no ready worker yet" forever rather than 404, and a model removed
        whole would keep the server not ready."""
        if not connection.is_ready or connection.state is None:
            return
        has = _versions_of(connection)
        names = {name for name, _ in has}
        gone = {key for key in self.expected_versions
                if (self.workers_share_repository or key[0] in names) and key not in has}
        if not gone:
            return
        for other in self._connections.values():
            if other is not connection and other.state is not None:
                gone -= _versions_of(other)
        if gone:
            log.info("no longer expecting %s: removed from the repository",
                     ", ".join(f"{name} v{version}" for name, version in sorted(gone)))
            self.expected_versions -= gone

    def _load_on_demand(self, name: str, version: str | None, *, start: bool) -> None:
        """If a worker loads `name` (`version`, if given) on demand and none serves it, have the
        least busy such worker load it (`start`; once, whatever the number of requests meanwhile),
        and raise the 503 that tells the caller when to try again."""
        offers = self._indexed().dormant
        keys = [key for key in offers if key[0] == name and (version is None or key[1] == version)]
        if not keys:
            return
        if not start and name not in self._on_demand_loads:
            raise ModelNotReady(f"model {name!r} is not loaded: its first inference request loads it",
                                retry_after_s=1.0)
        if name not in self._on_demand_loads:
            workers = sorted({c for key in keys for c in offers[key]}, key=lambda c: c.num_in_flight)
            task = asyncio.get_running_loop().create_task(self._load_one(name, workers[0]))
            self._on_demand_loads[name] = (task, self._clock.now())
            task.add_done_callback(lambda _: self._on_demand_loads.pop(name, None))
        # what is left of the time loads of this model have taken (of 2 s before the first)
        left_s = self._load_seconds.get(name, 2.0) - (self._clock.now() - self._on_demand_loads[name][1])
        retry_s = max(0.25, min(left_s, 30.0))
        last = self._on_demand_refusals.get(name)
        raise ModelNotReady(f"model {name!r} is being loaded on demand; try again in {retry_s:.1f} s"
                            + (f" (the last try did not load it: {last})" if last else ""), retry_after_s=retry_s)

    async def _load_one(self, name: str, connection: WorkerConnection) -> None:
        started = self._clock.now()
        future = connection.sync_model(self._new_sync_id(), name)
        if future is None:
            return
        await asyncio.wait({future}, timeout=600.0)
        if not future.done() or future.cancelled():  # too slow, or the worker died meanwhile
            log.warning("worker %s did not finish loading model %s on demand", connection.worker_id, name)
            return
        synced = future.result()
        if synced.refused and not synced.versions:  # e.g. no room in the worker's model memory budget
            self._on_demand_refusals[name] = "; ".join(dict.fromkeys(r.reason for r in synced.refused))
            log.warning("model %s was not loaded on demand on worker %s: %s", name, connection.worker_id,
                        self._on_demand_refusals[name])
            return
        self._on_demand_refusals.pop(name, None)
        took_s = self._clock.now() - started
        self._load_seconds[name] = 0.5 * (self._load_seconds.get(name, took_s) + took_s)
        self._invalidate()
        log.info("model %s loaded on demand on worker %s in %.1f s: versions %s", name, connection.worker_id,
                 took_s, ", ".join(synced.versions) or "none")

    def _new_sync_id(self) -> int:
        self._next_sync_id += 1
        return self._next_sync_id

    async def sync_model(self, name: str, *, unload: bool = False, timeout_s: float = 600.0) -> ModelSync:
        """Have every connected worker bring `name` in line with its model repository (`unload`:
        take it off; `wire.SyncModel`), and wait for their answers: new versions are loaded and
        warmed up while the others keep serving. An unloaded model stays unloaded on workers that
        restart, until it is loaded again through this gateway."""
        if unload:
            had = {version for model, version in self.expected_versions if model == name}
            had |= set(self.models(include_recovering=True).get(name, {}))
            self.unloaded[name] = sorted(had | set(self.unloaded.get(name, ())), key=version_order)
        else:
            self.unloaded.pop(name, None)
        sync_id = self._new_sync_id()
        asked = {worker_id: future for worker_id, connection in self._connections.items()
                 if (future := connection.sync_model(sync_id, name, unload=unload)) is not None}
        if not asked:
            raise Unavailable("no worker is connected to load or unload models on", retry_after_s=1.0)
        if not unload:
            self._syncing[name] = self._syncing.get(name, 0) + 1
        try:
            await asyncio.wait(asked.values(), timeout=timeout_s)
        finally:
            if not unload and (left := self._syncing.pop(name) - 1):
                self._syncing[name] = left
        answers = {worker_id: future.result() for worker_id, future in asked.items()
                   if future.done() and not future.cancelled()}
        versions = sorted({v for answer in answers.values() for v in answer.versions}, key=version_order)
        self.expected_versions = {key for key in self.expected_versions if key[0] != name} | \
                                 {(name, version) for version in versions}
        refused = {(r.version, r.reason) for answer in answers.values() for r in answer.refused}
        self._invalidate()
        return ModelSync(name, versions, sorted(refused), sorted(set(asked) - set(answers)))

    def _indexed(self) -> _ModelIndex:
        if self._index is None:
            self._index = index = _ModelIndex.build(self._connections.values())
            for canary in self.traffic.running():  # a version gone ends its canary
                event = self.traffic.check_served(canary.model, index.with_recovering.get(canary.model, {}))
                if event is not None:
                    self._canary_moved(event)
        return self._index

    def models(self, *, include_recovering: bool = False) -> dict[str, dict[str, wire.ModelInfo]]:
        """Model versions served by a ready worker (or one being restarted): name -> version -> info."""
        index = self._indexed()
        return index.with_recovering if include_recovering else index.ready

    def refused(self) -> list[wire.RefusedModel]:
        """Model versions the workers refused to load, and why, that no worker serves instead."""
        served = self.models(include_recovering=True)
        seen: dict[tuple[str, str], wire.RefusedModel] = {}
        for connection in self._connections.values():
            for refused in connection.state.refused if connection.state else ():
                if refused.version not in served.get(refused.name, {}):
                    seen[(refused.name, refused.version)] = refused
        return [seen[key] for key in sorted(seen, key=lambda key: (key[0], version_order(key[1])))]

    def refusal(self, name: str, version: str | None) -> ModelRefused | None:
        """The error for a request to a model version (None: any) that was refused at load and
        is not served, saying why; None if it was not refused."""
        reasons = {r.version: r.reason for r in self.refused() if r.name == name}
        if version is not None:
            reason = reasons.get(version, reasons.get("-"))
            return None if reason is None else ModelRefused(
                f"model {name!r} version {version!r} failed to load and is not served: {reason}")
        if not reasons:
            return None
        why = "; ".join(reason if v == "-" else f"version {v}: {reason}" for v, reason in reasons.items())
        return ModelRefused(f"model {name!r} failed to load and is not served: {why}")

    def resolve(self, name: str, version: str | None, route_key: str | None = None, *,
                by_split: bool = True, on_demand: bool = True, tenant: str | None = None) -> wire.ModelInfo:
        """The model version a request goes to: the one it names, else the one the model's traffic
        split gives its `route_key` (`gateway.traffic`), else the newest (also without `by_split`).
        One that a worker loads on demand and none serves is loaded now (`on_demand`; not for a
        readiness check), and the request answered 503 with when to try again. With `tenant`,
        the tenant's permission for `name` comes first: a model it may not use is its 403, not a
        503 while the workers start (nor a load on demand it would trigger)."""
        if tenant is not None:
            self.tenancy.authorize(self.tenancy.tenant(tenant), name)
        versions = self.models(include_recovering=True).get(name)
        if versions and version is None:
            split = self.split(name) if by_split else None
            chosen = None if split is None else split.choose(
                versions, None if route_key is None else f"{name}\0{route_key}", self._rng)
            return versions[chosen or max(versions, key=version_order)]
        if versions and version in versions:
            return versions[version]
        if any(model == name and version in (None, v) for model, v in self._indexed().loading):
            which = "" if version is None else f": version {version!r} is not ready yet"
            raise ModelNotReady(f"model {name!r} is being loaded by its worker{which}; try again shortly",
                                retry_after_s=1.0)
        refusal = self.refusal(name, version)
        if refusal is not None:
            raise refusal
        if (not versions or (version is not None and version not in versions)) and name not in self.unloaded:
            self._load_on_demand(name, version, start=on_demand)  # raises ModelNotReady if it loads on demand
        which = "" if version is None else f": version {version!r} is not ready (yet, if the repository has it)"
        being_loaded = ModelNotReady(f"model {name!r} is being loaded{which}", retry_after_s=1.0)
        if not versions:
            if name in self.expected_models:
                raise ModelNotReady(f"model {name!r} has no ready worker yet", retry_after_s=1.0)
            if name in self._syncing:
                raise being_loaded
            if name in self.unloaded:
                raise ModelNotFound(f"model {name!r} is unloaded (an admin may load it again: "
                                    f"POST /v2/repository/models/{name}/load)")
            if not self.expected_versions and not any(c.state is not None or c.known_models or c.dormant
                                                      for c in self._connections.values()):
                raise ModelNotReady(f"no worker has said what it serves yet, so model {name!r} is not known "
                                    "yet", retry_after_s=1.0)
            raise ModelNotFound(f"model {name!r} does not exist")
        if (name, version) in self.expected_versions:
            raise ModelNotReady(f"model {name!r} version {version!r} has no ready worker yet", retry_after_s=1.0)
        if name in self._syncing:
            raise being_loaded
        raise ModelNotFound(f"model {name!r} has no version {version!r}")

    @property
    def expected_models(self) -> set[str]:
        """The models of `expected_versions`."""
        return {name for name, _ in self.expected_versions}

    def split(self, name: str) -> Split | None:
        """The traffic split requests to `name` that name no version follow (None: the newest)."""
        return self.traffic.split(name, self._indexed().declared.get(name))

    def declared_split(self, name: str) -> Split | None:
        """The split the model declares (`model.toml` [routing]), whatever operators changed."""
        return self._indexed().declared.get(name)

    def traffic_shares(self, name: str | None = None) -> dict[tuple[str, str], float]:
        """(model, version) -> the share (0-1) of the model's unversioned requests it gets now, for
        every served version of every model (or of `name`): as `resolve` draws them."""
        shares: dict[tuple[str, str], float] = {}
        for model, versions in self.models(include_recovering=True).items():
            if name is not None and model != name:
                continue
            split = self.split(model)
            live = [] if split is None else split.live(versions)
            weights = dict(live) if live else {max(versions, key=version_order): 1.0}
            total = sum(weights.values())
            for version in versions:
                shares[(model, version)] = weights.get(version, 0.0) / total
        return shares

    def _observe(self, ticket: Ticket, outcome: str, result: InferResult | None) -> None:
        """A request ended: into its model's statistics, and evidence for its canary, if one runs
        (not an answer from the cache: nothing ran; nor a deadline the client set that was
        missed: too short, maybe)."""
        info = ticket.info
        if result is None or not isinstance(result.payload, wire.TokenizeResult):  # the tokenizer alone is not one
            self._record_inference(info, outcome, result, self._clock.now() - ticket.started)
        if not self.traffic.has_canary(info.name) or (result is not None and result.is_cached) \
                or (outcome == "expired" and ticket.client_deadline):
            return
        event = self.traffic.observe(info.name, info.version, outcome, result.exec_s if result else 0.0,
                                     self._clock.now())
        if event is not None:
            self._canary_moved(event)

    def _record_inference(self, info: wire.ModelInfo, outcome: str, result: InferResult | None,
                          duration_s: float) -> None:
        if outcome != "ok" or result is None:
            self.statistics.failed(info.name, info.version, duration_s)
            return
        ran = None if result.is_cached else Ran(wire.num_items(result.payload), result.queue_s, result.exec_s)
        self.statistics.succeeded(info.name, info.version, duration_s, ran,
                                  is_cacheable=self.cache is not None and bool(info.cache_revision))

    def canary_event(self, event: CanaryEvent) -> None:
        """Log and count a canary's step or end. Sharing the change is up to where it was made:
        one followed from another gateway is not published again."""
        log.warning("canary of model %s: %s, now at %g%% of its traffic: %s", event.model,
                    event.kind.replace("_", " "), event.share, event.reason)
        self._metrics.canary_event(event.model, event.kind)

    def judge_canary(self, name: str) -> None:
        """Judge `name`'s canary, if one runs here, on the answers since the last request."""
        event = self.traffic.evaluate(name, self._clock.now())
        if event is not None:
            self._canary_moved(event)

    def _canary_moved(self, event: CanaryEvent) -> None:
        """A canary running here stepped or ended on its own (judged as requests end, or its
        version went away): report it and tell the cluster's other gateways."""
        self.canary_event(event)
        if self.shared_traffic is not None:
            self.shared_traffic.publish_soon(event.model)

    async def share_traffic(self, name: str) -> None:
        """Tell the cluster's other gateways about a change of `name`'s traffic made here. Raises
        `Conflict` if one of them changed it meanwhile (this gateway now follows that change)."""
        if self.shared_traffic is None:
            return
        try:
            await self.shared_traffic.publish(name)
        except Stale as exc:
            raise Conflict(str(exc)) from None
        except (RedisError, OSError) as exc:
            log.warning("cannot share model %s's traffic change with the other gateways: %s", name, exc)

    def loading_models(self) -> set[str]:
        """Expected models that no ready worker serves yet, that were not refused at load and that
        are not left to be loaded on demand (unloaded after they were idle)."""
        ready = self.models()
        refused = {r.name for r in self.refused()}
        dormant = {name for name, _ in self._indexed().dormant}
        expected = self.expected_models | {name for name, _ in self._indexed().loading}
        return {name for name in expected if name not in ready and name not in refused | dormant}

    def loading_versions(self) -> set[tuple[str, str]]:
        """(model, version) that a ready worker is loading now and none serves."""
        return set(self._indexed().loading)

    def dormant_versions(self) -> set[tuple[str, str]]:
        """(model, version) that a ready worker loads on demand and none serves."""
        return set(self._indexed().dormant)

    def is_ready(self) -> bool:
        """Every model that could load is served by a ready worker. Models refused at load are not
        waited for (unlike Triton's strict readiness): requests for them answer why (404). With
        every model unloaded by an admin, left to be loaded on demand, or none in the repository, a
        ready worker suffices: the server stays reachable behind a readiness probe, for the requests
        that load a model on demand or an admin's call to load one. Not while every model was refused."""
        if self.is_draining:
            return False
        serves = bool(self.models()) or (bool(self.ready_workers()) and bool(
            self.unloaded or self.dormant_versions() or not self.refused()))
        return serves and not self.loading_models()

    # -- inference -----------------------------------------------------------------------------

    def cache_key(self, info: wire.ModelInfo, request: wire.Payload | bytes, caller: Caller) -> bytes | None:
        """The result-cache key of `caller`'s request to `info` (its payload, or the bytes its
        answer depends on: `cache.cache_key`); None when the cache has nothing to do with it."""
        return self._cache_key(info, request, self.tenancy.tenant(caller.tenant).name, caller.cache)

    def _holds_answer(self, key: bytes | None, policy: CachePolicy) -> bool:
        """This gateway's own store holds an answer for `key` that a request with this
        `Cache-Control` policy may be given: it needs no device, so it is not refused for overload."""
        return (key is not None and policy is CachePolicy.USE and self.cache is not None
                and self.cache.local is not None and key in self.cache.local)

    def shed_if_overloaded(self, info: wire.ModelInfo, timeout_s: float | None, arrived_at: float,
                           caller: Caller | None = None, key: bytes | None = None) -> None:
        """Refuse now, before the body is parsed, when every ready replica already reports more
        work ahead of this tenant's class than the request's deadline allows: under overload the
        excess costs the gateway as little as possible and gets its answer at once. A request
        whose cache `key` (`cache_key`) this gateway holds an answer for is not refused: it needs
        no device."""
        caller = caller or _LOCAL_CALLER
        allowed = self.tenancy.tenant(caller.tenant)
        self.tenancy.authorize(allowed, info.name)  # a 403 is the answer, not a 503
        if self._holds_answer(key, caller.cache):
            return
        deadline = arrived_at + (timeout_s if timeout_s is not None else info.slo_s)
        now = self._clock.now()
        tenant, priority = allowed.name, effective_priority(allowed.priority, caller.priority)
        if now >= deadline:
            self._refused_early(info, tenant, priority, caller, arrived_at, now, "expired",
                                client_deadline=timeout_s is not None)
            raise DeadlineExceeded("the deadline passed before the request could be dispatched")
        replicas = self._indexed().replicas.get((info.name, info.version), ())
        excesses = [(self._excess_s(c, tenant, priority, info, now, deadline), c) for c in replicas if c.is_ready]
        if not excesses:
            return
        excess_s, connection = min(excesses, key=lambda pair: pair[0])
        if excess_s <= 0:
            return
        self._refused_early(info, tenant, priority, caller, arrived_at, now, "rejected")
        raise self._overloaded(connection, info, excess_s)

    @contextmanager
    def reading(self, info: wire.ModelInfo, tenant: str, arrived_at: float,
                traceparent: str | None = None) -> Iterator[None]:
        """Around the reading of a request to `info` (from `resolve`) before it is sent on with
        `infer`: the tenant must be allowed the model first (its 403, not a 400 about its input),
        and an `InvalidInput` raised inside (the client's malformed body, wrong input name, type or
        shape) is counted as the outcome `invalid` and a failed inference in the model's
        statistics, as a `Ticket` counts one the worker refuses. The one place for both
        protocols and transports; `infer` is not called inside (its ticket counts its own).
        With tracing on, the refused request is a span too (in the caller's `traceparent` trace)."""
        allowed = self.tenancy.tenant(tenant)
        self.tenancy.authorize(allowed, info.name)
        try:
            yield
        except InvalidInput:
            duration_s = self._clock.now() - arrived_at
            self._metrics.request_done(info.name, info.version, "invalid", duration_s)
            self.statistics.failed(info.name, info.version, duration_s)
            if self._tracing.is_enabled:
                self._tracing.request(model=info.name, version=info.version, tenant=allowed.name,
                                      priority=allowed.priority.label, traceparent=traceparent,
                                      started=arrived_at, outcome="invalid")
            raise

    def _refused_early(self, info: wire.ModelInfo, tenant: str, priority: Priority, caller: Caller,
                       arrived_at: float, now: float, outcome: str, *, client_deadline: bool = False) -> None:
        """The accounting of a request answered before admission, as a `Ticket` does it for the rest."""
        self._metrics.request_done(info.name, info.version, outcome, now - arrived_at,
                                   client_deadline=client_deadline)
        self.statistics.failed(info.name, info.version, now - arrived_at)
        self._metrics.tenant_rejected(tenant, priority.label, "overloaded" if outcome == "rejected" else outcome)
        if self._tracing.is_enabled:
            self._tracing.request(model=info.name, version=info.version, tenant=tenant, priority=priority.label,
                                  traceparent=caller.traceparent, started=arrived_at, outcome=outcome)

    @staticmethod
    def _excess_s(connection: WorkerConnection, tenant: str, priority: Priority, info: wire.ModelInfo,
                  now: float, deadline: float) -> float:
        """How far past `deadline` a request sent to `connection` now is predicted to finish: its
        wait (`_tenant_wait_s`) and its own batch, as the worker's admission counts them. 0 when
        it fits, when nothing is queued ahead of it, when the worker has not reported yet, or
        when its own batch alone would miss the deadline (the worker answers that one: it is a
        deadline too short, not an overload)."""
        if connection.state is None:
            return 0.0
        wait_s = Gateway._tenant_wait_s(connection, tenant, priority, info)
        own_s = connection.newcomer_s(info.name, info.version)
        if wait_s <= 0 or now + own_s > deadline:
            return 0.0
        return max(now + wait_s + own_s - deadline, 0.0)

    @staticmethod
    def _tenant_wait_s(connection: WorkerConnection, tenant: str, priority: Priority, info: wire.ModelInfo) -> float:
        """Until a new request's batch could start: the worker's last report for this tenant's
        class, less the time since (the device has been working), plus what this gateway has sent
        for the same tenant and class that the report does not count (it queues behind), at the
        reported drain rate."""
        state = connection.state
        if state is None:
            return 0.0
        wait_s = predicted_wait_s(state, tenant, priority, info)
        if info.kind == "openai-upstream":
            return wait_s
        elapsed_s = max(time.monotonic() - connection.state_at, 0.0)
        sent_s = connection.sent_flow_work_s(tenant, int(priority)) / max(state.drain_rate, 0.05)
        return max(wait_s - elapsed_s, 0.0) + sent_s

    @property
    def is_tracing(self) -> bool:
        """Traces are exported: requests' span context is worth reading."""
        return self._tracing.is_enabled

    def now(self) -> float:
        """The gateway's clock, on which deadlines are set."""
        return self._clock.now()

    @property
    def max_timeout_s(self) -> float:
        return self._config.max_timeout_s

    async def infer(
        self, info: wire.ModelInfo, payload: wire.Payload, timeout_s: float | None = None,
        *, arrived_at: float | None = None, caller: Caller | None = None, key: bytes | None = None,
    ) -> InferResult:
        """Run one request on `info` (from `resolve`) for `caller`. The deadline counts from
        `arrived_at`, the moment the request reached the gateway (default: now). `key`: its cache
        key if the caller computed it already (`cache_key`).

        The tenant's permission and limits are checked first (403/429, nothing else consumed);
        tokens are reserved from the estimate and settled with the worker's count.

        Without a `timeout_s`, the deadline is the model's SLO for each batch the request fills
        (`default_timeout_s`), up to the longest a client may ask for: 2,048 texts in batches of
        32 get 64 times the SLO of one text."""
        default_s = None if timeout_s is not None else \
            max(info.slo_s, min(default_timeout_s(info, payload), self._config.max_timeout_s))
        with _routed_to(info):
            ticket = await self._admit(info, timeout_s, arrived_at, caller, default_s)
            policy = (caller or _LOCAL_CALLER).cache
            async with ticket:
                key = key or self._cache_key(info, payload, ticket.tenant, policy)
                if key is None:
                    result = await self._dispatch(info, payload, ticket)
                else:
                    result = await self._cached(key, info, ticket, policy,
                                                lambda: self._dispatch(info, payload, ticket))
                ticket.done(result)
                return ticket.with_limits(result)

    async def generate(
        self, info: wire.ModelInfo, payload: wire.GeneratePayload, timeout_s: float | None = None,
        *, arrived_at: float | None = None, caller: Caller | None = None,
        limit_headers: dict[str, str] | None = None,
    ) -> AsyncGenerator[wire.TokenChunk | InferResult, None]:
        """Stream a generation: its `TokenChunk`s as they come (only if `payload.stream`), then
        the `InferResult` (payload `GenerationResult`). Errors before the first chunk are raised
        from the first `__anext__`, so the API can still answer them with an HTTP status.
        Closing the iterator early (client gone) withdraws the request from its worker.
        `limit_headers`, if given, receives the tenant's `x-ratelimit-*` headers once admitted
        (a stream's HTTP headers are sent before its final result)."""
        with _routed_to(info):
            ticket = await self._admit(info, timeout_s, arrived_at, caller)
            if limit_headers is not None:
                limit_headers.update(ticket.limit_headers())
            policy = (caller or _LOCAL_CALLER).cache
            async with ticket:
                key = self._cache_key(info, payload, ticket.tenant, policy)
                if key is not None:  # a whole greedy answer
                    result = await self._cached(key, info, ticket, policy, lambda: self._whole(info, payload, ticket))
                    ticket.done(result)
                    yield ticket.with_limits(result)
                    return
                async for event in self._dispatch_stream(info, payload, ticket):
                    if isinstance(event, InferResult):
                        ticket.done(event)
                        event = ticket.with_limits(event)
                    yield event

    def _cache_key(self, info: wire.ModelInfo, payload: wire.Payload | bytes, tenant: str,
                   policy: CachePolicy) -> bytes | None:
        """The request's result-cache key; None when the cache has nothing to do with it."""
        if self.cache is None or policy is CachePolicy.BYPASS:
            return None
        return cache_key(info, payload, tenant)

    async def _cached(self, key: bytes, info: wire.ModelInfo, ticket: Ticket, policy: CachePolicy,
                      run: Callable[[], Awaitable[InferResult]]) -> InferResult:
        """`run`'s result, or the cache's answer for `key` (`gateway.cache`): a stored one, or an
        identical request's that was running. Those used no device time for this request; their
        tokens count against the tenant's limits like any answer's."""
        assert self.cache is not None
        if self._clock.now() >= ticket.deadline:
            raise DeadlineExceeded("the deadline passed before the request could be answered")

        def keep(result: InferResult) -> CachedResult | None:
            if result.model.cache_revision != info.cache_revision:
                return None  # a worker still on other weights or settings answered: not this key's answer
            return CachedResult(result.payload, result.num_tokens)

        try:
            answer = self.cache.answer(key, policy, info.name, ticket.deadline - self._clock.now(), run, keep, _repeats)
            value, source = await answer
        except TimeoutError:
            raise DeadlineExceeded("the deadline passed while an identical request was still running") from None
        if not source:
            assert isinstance(value, InferResult)
            return value
        assert isinstance(value, CachedResult)
        ticket.charge(value.num_tokens, 0.0)
        return InferResult(info, value.payload, value.num_tokens, 0.0, 0.0, 0, headers={CACHE_HEADER: source},
                           is_cached=True)

    async def _whole(self, info: wire.ModelInfo, payload: wire.Payload, ticket: Ticket) -> InferResult:
        """The final result of an unstreamed generation."""
        events = self._dispatch_stream(info, payload, ticket)
        try:
            async for event in events:
                if isinstance(event, InferResult):
                    return event
        finally:
            await events.aclose()
        raise RuntimeError("a generation ended without a result")

    async def _admit(self, info: wire.ModelInfo, timeout_s: float | None, arrived_at: float | None,
               caller: Caller | None, default_s: float | None = None) -> Ticket:
        """`default_s`: the deadline without a `timeout_s` (default: the model's SLO)."""
        started = self._clock.now() if arrived_at is None else arrived_at
        caller = caller or _LOCAL_CALLER
        if self.is_draining:
            raise Unavailable("server is shutting down", retry_after_s=1.0)
        if timeout_s is not None and not 0 < timeout_s <= self._config.max_timeout_s:
            raise InvalidInput(f"timeout must be in (0, {self._config.max_timeout_s:g}] seconds", param="timeout")
        tenant = self.tenancy.tenant(caller.tenant)
        self.tenancy.authorize(tenant, info.name)
        priority = effective_priority(tenant.priority, caller.priority)
        try:
            if caller.group is None:
                reservation = await self.tenancy.admit(tenant, priority, caller.estimated_tokens, caller.likely_tokens)
            else:
                reservation = await caller.group.admit(self.tenancy, tenant, priority)
        except RateLimited as refusal:  # counted by tenant and limit in /metrics; traced here
            if self._tracing.is_enabled:
                self._tracing.request(model=info.name, version=info.version, tenant=tenant.name,
                                      priority=priority.label, traceparent=caller.traceparent, started=started,
                                      outcome="rate_limited", attributes={"sluice.limit": refusal.limit})
            raise
        deadline = started + (timeout_s if timeout_s is not None else default_s or info.slo_s)
        return Ticket(self._metrics, self.tenancy, self._clock, info, tenant.name, priority, reservation, started,
                      deadline, self._tracing, caller.traceparent, observer=self._observe,
                      client_deadline=timeout_s is not None, group=caller.group, background=caller.background)

    async def _dispatch(self, info: wire.ModelInfo, payload: wire.Payload, ticket: Ticket) -> InferResult:
        tried_lost = False
        failed_on: set[str] = set()  # replicas whose device failed this request
        while True:
            connection, in_flight = await self._send(info, payload, ticket, tried_lost, failed_on)
            result = await self._await_answer(connection, in_flight, ticket.deadline)
            if _is_refused_draining(connection, result):
                continue
            if result is not None:
                if ((result.outcome is not wire.Outcome.OK or not self._ejections.is_clear)
                        and self._device_failed(connection, info, result) and self._clock.now() < ticket.deadline):
                    failed_on.add(connection.worker_id)
                    if self._has_replica_besides(info, failed_on):  # another may well succeed
                        self._metrics.retried(info.name, info.version)
                        continue
                ticket.used(result)
                return interpret(connection.served(info), result)
            self._check_restartable(connection, in_flight)
            tried_lost = True

    def _device_failed(self, connection: WorkerConnection, info: wire.ModelInfo, result: wire.Result) -> bool:
        """Whether the replica's device failed the request; counted towards its ejection."""
        key = (connection.worker_id, info.name, info.version)
        if not is_device_failure(result):
            self._ejections.succeeded(key)
            return False
        ejected_s = self._ejections.failed(key, self._clock.now())
        if ejected_s:
            log.warning("worker %s failed %d requests of %s v%s in a row on its device: it gets none of "
                        "them for %.0f s while another replica serves the model", connection.worker_id,
                        self._ejections.threshold, info.name, info.version, ejected_s)
        return True

    def _has_replica_besides(self, info: wire.ModelInfo, excluded: set[str]) -> bool:
        return any(c.is_ready and c.worker_id not in excluded
                   for c in self._indexed().replicas.get((info.name, info.version), ()))

    async def _dispatch_stream(
        self, info: wire.ModelInfo, payload: wire.Payload, ticket: Ticket
    ) -> AsyncGenerator[wire.TokenChunk | InferResult, None]:
        tried_lost = False
        while True:
            connection, in_flight = await self._send(info, payload, ticket, tried_lost)
            timer = connection.resolve_after(in_flight, ticket.deadline - self._clock.now()
                                             + self._config.answer_grace_s)
            try:
                while in_flight.chunks is not None and (chunk := await in_flight.chunks.get()) is not None:
                    ticket.chunk(chunk)
                    yield chunk
                result = await in_flight.future
            finally:  # also when the consumer stops early (the client went away)
                timer.cancel()
                # an unstreamed generation waits on the future itself, which its cancellation
                # cancels (done, with no answer): that too is a request to withdraw
                if not in_flight.future.done() or in_flight.future.cancelled():
                    connection.cancel(in_flight.submit.request_id)
            if in_flight.is_timed_out:
                raise DeadlineExceeded("the worker did not answer before the deadline")
            if _is_refused_draining(connection, result):
                continue
            if result is not None:
                if result.outcome is not wire.Outcome.OK or not self._ejections.is_clear:
                    self._device_failed(connection, info, result)  # counted; a stream is not sent again
                ticket.used(result)
                yield interpret(connection.served(info), result)
                return
            self._check_restartable(connection, in_flight)
            tried_lost = True

    async def _send(self, info: wire.ModelInfo, payload: wire.Payload, ticket: Ticket,
                    tried_lost: bool, avoid: set[str] | None = None) -> tuple[WorkerConnection, InFlight]:
        """Submit to the best ready replica (not one in `avoid`, whose device failed the request),
        waiting (within the deadline) for one to recover if the one that had the request died."""
        self._next_id += 1
        request_id = self._next_id
        while True:
            now = self._clock.now()
            if now >= ticket.deadline:
                if tried_lost:
                    raise WorkerLost("the worker serving this model died and none recovered before the "
                                     "request's deadline", retry_after_s=1.0)
                raise DeadlineExceeded("deadline passed before a worker could take the request")
            connection = self._choose(info, ticket, payload, avoid)
            if connection is None:
                if tried_lost or self._is_recovering(info):
                    tried_lost = True
                    await asyncio.sleep(self._config.redispatch_poll_s)
                    continue
                raise ModelNotReady(f"no ready worker serves {info.name} v{info.version}", retry_after_s=1.0)
            submit = wire.Submit(request_id, info.name, info.version, payload, ticket.deadline - now,
                                 ticket.tenant, int(ticket.priority), ticket.background)
            in_flight = connection.submit(submit)
            if in_flight is not None:
                return connection, in_flight
            await asyncio.sleep(self._config.redispatch_poll_s)  # not connected at this instant

    def _check_restartable(self, connection: WorkerConnection, in_flight: InFlight) -> None:
        """The worker was lost with the request: send it again only if it had not started."""
        if in_flight.is_started:
            raise WorkerLost(f"worker {connection.worker_id} died while executing this request; "
                             "it was not completed", retry_after_s=1.0)
        self._metrics.redispatched(1)

    def _is_recovering(self, info: wire.ModelInfo) -> bool:
        """A worker that served this model is down but expected back (e.g. being restarted)."""
        return info.name in self._indexed().with_recovering and any(
            c.is_lost and info in c.known_models for c in self._connections.values())

    def _choose(self, info: wire.ModelInfo, ticket: Ticket, payload: wire.Payload,
                avoid: set[str] | None = None) -> WorkerConnection | None:
        replicas = self._indexed().replicas.get((info.name, info.version), ())
        ready = [router.Candidate(c.worker_id, c.predicted_wait_for(info.name, info.version))
                 for c in replicas if c.is_ready and not (avoid and c.worker_id in avoid)]
        candidates = self._ejections.healthy(ready, info.name, info.version, self._clock.now())
        by_id = {c.worker_id: c for c in replicas}
        prompt = None
        if self._config.prefix_affinity and len(candidates) > 1:
            prompt = router.prompt_bytes(payload, self._affinity.max_bytes)
        keys: list[bytes] = []
        if prompt is None:
            chosen = router.choose(candidates, self._rng)
        else:  # a generation among several replicas: where its prompt's prefix is cached, if not too busy
            keys = self._affinity.keys(f"{ticket.tenant}\0{info.name}\0{info.version}", prompt)
            chosen, by_affinity = self._affinity.choose(candidates, keys, self._rng)
            self._metrics.prefix_routed(info.name, info.version, by_affinity)
        if chosen is None:
            return None
        connection = by_id[chosen.worker_id]
        # The worker's admission stays the authority; refusing here what it would refuse spares
        # the round trip (most of a rejection's latency under overload).
        excess_s = self._excess_s(connection, ticket.tenant, ticket.priority, info, self._clock.now(), ticket.deadline)
        if excess_s > 0:
            raise self._overloaded(connection, info, excess_s, wire.num_items(payload))
        if keys:
            self._affinity.record(keys, chosen.worker_id)
        return connection

    def _overloaded(self, connection: WorkerConnection, info: wire.ModelInfo, excess_s: float,
                    num_items: int = 1) -> Overloaded:
        """The early refusal: retry once the excess has drained at the worker's reported rate. The
        demand it turns away is counted as `num_items` typical items (one when the body is not
        read yet: `shed_if_overloaded`)."""
        work_s = connection.item_s(info.name, info.version) * num_items
        self._metrics.refused_work(info.name, info.version, work_s)
        drain_rate = connection.state.drain_rate if connection.state is not None else 1.0
        return Overloaded("the work queued ahead would make this request miss its deadline",
                          retry_after_s=max(excess_s / max(drain_rate, 0.05), 0.001))

    async def _await_answer(
        self, connection: WorkerConnection, in_flight: InFlight, deadline: float
    ) -> wire.Result | None:
        budget = deadline - self._clock.now() + self._config.answer_grace_s
        timer = connection.resolve_after(in_flight, budget)
        try:
            result = await in_flight.future
        except asyncio.CancelledError:  # the client went away: withdraw the request
            connection.cancel(in_flight.submit.request_id)
            raise
        finally:
            timer.cancel()
        if in_flight.is_timed_out:
            raise DeadlineExceeded("the worker did not answer before the deadline")
        return result


_LOCAL_CALLER = Caller()


def _is_refused_draining(connection: WorkerConnection, result: wire.Result | None) -> bool:
    """The worker did not take the request because it is draining: it goes to another worker."""
    if result is None or result.outcome is not wire.Outcome.DRAINING:
        return False
    connection.mark_draining()
    return True


def _repeats(error: BaseException) -> bool:
    """The same input would fail the same way: identical requests waiting on it get this error too."""
    return isinstance(error, InvalidInput)  # a malformed item (ItemFailed), an upstream's 4xx, ...


@dataclass(frozen=True, slots=True)
class _ModelIndex:
    """Which ready workers serve which model versions; rebuilt only when a worker changes."""

    ready: dict[str, dict[str, wire.ModelInfo]]
    with_recovering: dict[str, dict[str, wire.ModelInfo]]
    replicas: dict[tuple[str, str], tuple[WorkerConnection, ...]]
    declared: dict[str, Split]
    """Each model's `[routing]` split, as its newest served version reports it."""
    dormant: dict[tuple[str, str], tuple[WorkerConnection, ...]]
    """The ready workers that load each model version on demand and have not loaded it."""
    loading: frozenset[tuple[str, str]]
    """The model versions a ready worker is loading now and none serves yet."""

    @classmethod
    def build(cls, connections: Iterable[WorkerConnection]) -> _ModelIndex:
        ready: dict[str, dict[str, wire.ModelInfo]] = {}
        with_recovering: dict[str, dict[str, wire.ModelInfo]] = {}
        replicas: dict[tuple[str, str], list[WorkerConnection]] = {}
        dormant: dict[tuple[str, str], list[WorkerConnection]] = {}
        loading: set[tuple[str, str]] = set()
        for connection in connections:
            if connection.is_ready:
                for name, version in connection.dormant:
                    dormant.setdefault((name, version), []).append(connection)
                loading.update(connection.loading)
            if not (connection.is_ready or connection.is_lost):
                continue
            for info in connection.known_models:
                with_recovering.setdefault(info.name, {})[info.version] = info
                if connection.is_ready:
                    ready.setdefault(info.name, {})[info.version] = info
                    replicas.setdefault((info.name, info.version), []).append(connection)
        declared = {}
        for name, versions in with_recovering.items():
            routing = versions[max(versions, key=version_order)].routing
            try:
                if routing is not None:
                    declared[name] = Split.of(routing.traffic, routing.sticky)
            except ValueError as exc:  # the repository checks it; a worker of another release might not
                log.error("model %s declares an unusable traffic split, ignored: %s", name, exc)
        return cls(ready, with_recovering, {key: tuple(value) for key, value in replicas.items()}, declared,
                   {key: tuple(value) for key, value in dormant.items()},
                   frozenset(key for key in loading if key[1] not in ready.get(key[0], {})))


def predicted_wait_s(state: wire.WorkerState, tenant: str, priority: Priority,
                     model: wire.ModelInfo | None = None) -> float:
    """What the worker reported for this tenant's class: behind the tenant's own queued work if it
    has some, else what a newcomer to the class waits (higher classes and the running batch).
    For a model served by an upstream server, the wait for a slot to that upstream instead."""
    if model is not None and model.kind == "openai-upstream":
        for load in state.upstreams:
            if (load.model, load.version) == (model.name, model.version):
                return load.waits_s[priority] if priority < len(load.waits_s) else load.waits_s[-1]
        return 0.0
    newcomer: float | None = None
    for wait in state.waits:
        if wait.priority == priority:
            if wait.tenant == tenant:
                return wait.wait_s
            if wait.tenant is None:
                newcomer = wait.wait_s
    return state.work_ahead_s if newcomer is None else newcomer


def default_timeout_s(info: wire.ModelInfo, payload: wire.Payload) -> float:
    """A request's deadline when its client sets none: the model's SLO (the latency of one batch's
    worth) for each batch its items fill at the model's max batch size. One text gets the SLO;
    2,048 texts, which no device runs in one batch's time, get 64 of them instead of a 504."""
    return info.slo_s * max(1, math.ceil(wire.num_items(payload) / max(info.max_batch_size, 1)))


@contextmanager
def _routed_to(info: wire.ModelInfo) -> Iterator[None]:
    """An error raised inside names the version the request was routed to (`SluiceError.model_version`):
    its answer says which version failed, as a success's does which one answered (a canary's failures)."""
    try:
        yield
    except SluiceError as exc:
        if exc.model_version is None:
            exc.model_version = info.version
        raise


def _versions_of(connection: WorkerConnection) -> set[tuple[str, str]]:
    """The model versions a worker says it has: served, loading, refused, loaded on demand."""
    state = connection.state
    refused = {(r.name, r.version) for r in state.refused} if state is not None else set()
    return {(info.name, info.version) for info in connection.known_models} | set(connection.loading) \
        | set(connection.dormant) | refused
