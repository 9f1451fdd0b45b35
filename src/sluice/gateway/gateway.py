"""The gateway core (`Gateway`): the workers it sends to, and a request's way through it.

    infer / generate ─▶ Admission.admit ─▶ result cache ─▶ Dispatcher.dispatch ─▶ worker
    resolve, models, is_ready, sync_model ─▶ ModelCatalog (what the workers serve)

`infer()` always ends in a result or one of the errors in `sluice.errors`; it never leaves a
request hanging (`gateway.dispatch`). The API layer talks to this class alone; the pieces it is
made of each own one part of the work: `admission` (who, which deadline, refused early under
overload), `dispatch` (replica choice, sending, re-sending after a crash), `catalog` (which
model versions are served or coming, loads on demand and an admin's loads and unloads).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from redis.exceptions import RedisError

from sluice import wire
from sluice.clock import Clock, WallClock
from sluice.errors import (
    Conflict,
    DeadlineExceeded,
    InvalidInput,
    ModelRefused,
    ShuttingDown,
    SluiceError,
    Unavailable,
)
from sluice.gateway import router
from sluice.gateway.admission import LOCAL_CALLER, Admission, Caller, default_timeout_s, num_batches
from sluice.gateway.cache import CACHE_HEADER, CachedResult, CachePolicy, ResultCache, cache_key
from sluice.gateway.catalog import ModelCatalog, ModelSync
from sluice.gateway.config import GatewayConfig
from sluice.gateway.connection import WorkerConnection
from sluice.gateway.dispatch import Dispatcher
from sluice.gateway.mirror import Mirror
from sluice.gateway.shadow import Shadows
from sluice.gateway.shared_traffic import SharedTraffic, Stale
from sluice.gateway.statistics import InferenceStatistics, Ran
from sluice.gateway.tenancy import Tenancy
from sluice.gateway.ticket import InferResult, Ticket
from sluice.gateway.traffic import CanaryEvent, Split, Traffic
from sluice.metrics import GatewayMetrics
from sluice.tracing import Tracing

log = logging.getLogger("sluice.gateway")


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
        rng = self._rng = random.Random()
        self._ejections = router.Ejections()
        self.is_draining = False
        self.tenancy.on_weights(self._send_weights)
        self.traffic = Traffic()
        """Operators' traffic splits and canaries (`api.admin`), over the splits models declare."""
        self.shared_traffic: SharedTraffic | None = None
        """Where `traffic` is shared with the other gateways of a cluster (`serve` sets it)."""
        self.statistics = InferenceStatistics(wall_clock or WallClock())
        """Triton-style per-version counts and durations of the requests this gateway answered."""
        self.catalog = ModelCatalog(clock, self.tenancy, self.traffic, self._connections, rng, self._canary_moved)
        self._admission = Admission(clock, metrics, self._tracing, self.tenancy, self.statistics, cache,
                                    self._config.max_timeout_s, self._replicas, self._observe)
        self._dispatcher = Dispatcher(clock, metrics, self._config, self._connections, self.catalog.indexed,
                                      rng, self._ejections)
        self.mirror = Mirror(clock, metrics, self.tenancy, Shadows(), rng,
                             lambda name: self.catalog.models().get(name, {}), self._run_copy)
        """Shadow copies of requests that name no version (`gateway.shadow`; `api.admin` sets them)."""

    # -- workers -------------------------------------------------------------------------------

    async def add_worker(self, worker_id: str, address: str) -> None:
        connection = WorkerConnection(worker_id, address, self.gateway_id)
        connection.on_change = functools.partial(self.catalog.worker_changed, connection)
        connection.on_batch_stats = functools.partial(self.statistics.executions, source=worker_id)
        self._connections[worker_id] = connection
        await connection.start()
        connection.set_weights(self.tenancy.weights())

    def _send_weights(self, weights: dict[str, float]) -> None:
        for connection in self._connections.values():
            connection.set_weights(weights)

    def end_grace(self) -> None:
        """The shutdown's grace period is over: requests still in flight end with `ShuttingDown`."""
        self.is_draining = True
        self._dispatcher.end_grace()

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
        self.catalog.expected_versions |= {(info.name, info.version) for info in connection.known_models}
        self.catalog.expected_versions |= set(connection.loading)
        lost = connection.mark_lost()
        if lost:
            log.warning("worker %s removed with %d requests in flight", worker_id, len(lost))
        self.catalog.invalidate()
        await connection.aclose()

    async def aclose(self) -> None:
        self.catalog.cancel_loads()
        await self.mirror.aclose()
        for connection in self._connections.values():
            await connection.aclose()

    def num_replicas(self, name: str, version: str) -> int:
        """How many ready workers serve this model version."""
        return len(self.catalog.indexed().replicas.get((name, version), ()))

    def _replicas(self, info: wire.ModelInfo) -> tuple[WorkerConnection, ...]:
        return self.catalog.indexed().replicas.get((info.name, info.version), ())

    def num_workers(self) -> int:
        """Workers this gateway sends to: its own, those named, those found in the registry."""
        return len(self._connections)

    def ready_workers(self) -> list[WorkerConnection]:
        return [c for c in self._connections.values() if c.is_ready]

    def refresh_metrics(self) -> None:
        """Update gauges that are cheaper to compute on scrape than on every change."""
        self._metrics.workers_ready(len(self.ready_workers()))
        self._metrics.traffic_shares(self.traffic_shares())
        self._metrics.ejections(self._ejections.known(self._clock.now()))
        if self.cache is not None:
            self._metrics.cache_state(self.cache)

    # -- models (`catalog.ModelCatalog`) -------------------------------------------------------

    @property
    def expected_versions(self) -> set[tuple[str, str]]:
        """(model, version) of the repository's versions (`ModelCatalog.expected_versions`)."""
        return self.catalog.expected_versions

    @expected_versions.setter
    def expected_versions(self, versions: set[tuple[str, str]]) -> None:
        self.catalog.expected_versions = versions

    @property
    def workers_share_repository(self) -> bool:
        """Every worker serves the whole of one repository (`ModelCatalog.workers_share_repository`)."""
        return self.catalog.workers_share_repository

    @workers_share_repository.setter
    def workers_share_repository(self, value: bool) -> None:
        self.catalog.workers_share_repository = value

    @property
    def unloaded(self) -> dict[str, list[str]]:
        """Models unloaded through this gateway, with the versions they had (`ModelCatalog.unloaded`)."""
        return self.catalog.unloaded

    @property
    def expected_models(self) -> set[str]:
        return self.catalog.expected_models

    async def sync_model(self, name: str, *, unload: bool = False, timeout_s: float = 600.0) -> ModelSync:
        return await self.catalog.sync_model(name, unload=unload, timeout_s=timeout_s)

    def models(self, *, include_recovering: bool = False) -> dict[str, dict[str, wire.ModelInfo]]:
        return self.catalog.models(include_recovering=include_recovering)

    def refused(self) -> list[wire.RefusedModel]:
        return self.catalog.refused()

    def refusal(self, name: str, version: str | None) -> ModelRefused | None:
        return self.catalog.refusal(name, version)

    def resolve(self, name: str, version: str | None, route_key: str | None = None, *,
                by_split: bool = True, on_demand: bool = True, tenant: str | None = None) -> wire.ModelInfo:
        return self.catalog.resolve(name, version, route_key, by_split=by_split, on_demand=on_demand,
                                    tenant=tenant)

    def split(self, name: str) -> Split | None:
        return self.catalog.split(name)

    def declared_split(self, name: str) -> Split | None:
        return self.catalog.declared_split(name)

    def traffic_shares(self, name: str | None = None) -> dict[tuple[str, str], float]:
        return self.catalog.traffic_shares(name)

    def loading_models(self) -> set[str]:
        return self.catalog.loading_models()

    def loading_versions(self) -> set[tuple[str, str]]:
        return self.catalog.loading_versions()

    def dormant_versions(self) -> set[tuple[str, str]]:
        return self.catalog.dormant_versions()

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

    # -- statistics and canaries ---------------------------------------------------------------

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

    # -- inference -----------------------------------------------------------------------------

    def cache_key(self, info: wire.ModelInfo, request: wire.Payload | bytes, caller: Caller) -> bytes | None:
        """The result-cache key of `caller`'s request to `info` (its payload, or the bytes its
        answer depends on: `cache.cache_key`); None when the cache has nothing to do with it."""
        return self._cache_key(info, request, self.tenancy.tenant(caller.tenant).name, caller.cache)

    def shed_if_overloaded(self, info: wire.ModelInfo, timeout_s: float | None, arrived_at: float,
                           caller: Caller | None = None, key: bytes | None = None, num_batches: int = 1) -> None:
        """Refuse now, before the body is parsed, a request that cannot meet its deadline
        (`Admission.shed_if_overloaded`). Its refusal names the version chosen, as later ones do.
        `num_batches`: without a `timeout_s`, the batches the request needs (`admission.num_batches`:
        at most that, before its body is read), for the deadline `infer` gives it (`default_deadline_s`)."""
        default_s = None if timeout_s is not None else self.default_deadline_s(info, num_batches)
        with _routed_to(info):
            self._admission.shed_if_overloaded(info, timeout_s, arrived_at, caller, key, default_s)

    def default_deadline_s(self, info: wire.ModelInfo, num_batches: int) -> float:
        """A request's deadline when its client sets none: the model's SLO for each batch it needs
        (`admission.default_timeout_s`), up to the longest a client may ask for: 2,048 texts in
        batches of 32 get 64 times the SLO of one text."""
        return max(info.slo_s, min(default_timeout_s(info, num_batches), self._config.max_timeout_s))

    def reading(self, info: wire.ModelInfo, tenant: str, arrived_at: float,
                trace: wire.TraceContext | None = None) -> AbstractContextManager[None]:
        """Around the reading of a request's body (`Admission.reading`)."""
        return self._admission.reading(info, tenant, arrived_at, trace)

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
        routed: bool = False,
    ) -> InferResult:
        """Run one request on `info` (from `resolve`) for `caller`. The deadline counts from
        `arrived_at`, the moment the request reached the gateway (default: now). `key`: its cache
        key if the caller computed it already (`cache_key`).

        The tenant's permission and limits are checked first (403/429, nothing else consumed);
        tokens are reserved from the estimate and settled with the worker's count.

        Without a `timeout_s`, the deadline is the model's SLO for each batch the request needs
        (`default_deadline_s`). `routed`: the request named no version (its traffic split chose
        `info`), so the model's shadow may copy it (`gateway.mirror`)."""
        default_s = None if timeout_s is not None else self.default_deadline_s(info, num_batches(info, payload))
        with _routed_to(info):
            ticket = await self._admit(info, timeout_s, arrived_at, caller, default_s)
            ticket.about(payload)
            policy = (caller or LOCAL_CALLER).cache
            async with ticket:
                copy = self.mirror.copy(info, payload, ticket.tenant, ticket.started, ticket.deadline) \
                    if routed else None
                try:
                    key = key or self._cache_key(info, payload, ticket.tenant, policy)
                    if key is None:
                        result = await self._dispatcher.dispatch(info, payload, ticket)
                    else:
                        result = await self._cached(key, info, ticket, policy,
                                                    lambda: self._dispatcher.dispatch(info, payload, ticket))
                except BaseException:
                    if copy is not None:
                        copy.answered(None)  # nothing to compare the copy with
                    raise
                if copy is not None:
                    copy.answered(result.payload)
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
            ticket.about(payload)
            if limit_headers is not None:
                limit_headers.update(ticket.limit_headers())
            policy = (caller or LOCAL_CALLER).cache
            async with ticket:
                key = self._cache_key(info, payload, ticket.tenant, policy)
                if key is not None:  # a whole greedy answer
                    result = await self._cached(key, info, ticket, policy,
                                                lambda: self._dispatcher.whole(info, payload, ticket))
                    ticket.done(result)
                    yield ticket.with_limits(result)
                    return
                async for event in self._dispatcher.dispatch_stream(info, payload, ticket):
                    if isinstance(event, InferResult):
                        ticket.done(event)
                        event = ticket.with_limits(event)
                    yield event

    async def _run_copy(self, info: wire.ModelInfo, payload: wire.Payload, ticket: Ticket) -> InferResult:
        """A shadow copy's run (`gateway.mirror`): straight to the workers, never the result cache."""
        if self.is_draining:
            raise ShuttingDown("server is shutting down")
        return await self._dispatcher.dispatch(info, payload, ticket)

    async def _admit(self, info: wire.ModelInfo, timeout_s: float | None, arrived_at: float | None,
                     caller: Caller | None, default_s: float | None = None) -> Ticket:
        """`Admission.admit`, unless this gateway is shutting down."""
        if self.is_draining:
            raise Unavailable("server is shutting down", retry_after_s=1.0)
        return await self._admission.admit(info, timeout_s, arrived_at, caller, default_s)

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


def _repeats(error: BaseException) -> bool:
    """The same input would fail the same way: identical requests waiting on it get this error too."""
    return isinstance(error, InvalidInput)  # a malformed item (ItemFailed), an upstream's 4xx, ...


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
