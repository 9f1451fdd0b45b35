"""The gateway's view of the models: which versions the workers serve, which are coming, and
what a request for a model gets (`ModelCatalog.resolve`).

It also has workers load models: on demand, when a request comes for a model a worker loads
only then, and on an admin's word (`sync_model`: `api.triton`'s repository extension,
`sluice models load|unload`), while they serve.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

from sluice import wire
from sluice.clock import Clock
from sluice.errors import ModelNotFound, ModelNotReady, ModelRefused, ModelVersionUnavailable, Unavailable
from sluice.gateway.connection import WorkerConnection
from sluice.gateway.model_index import ModelIndex, versions_of
from sluice.gateway.tenancy import Tenancy
from sluice.gateway.traffic import CanaryEvent, Split, Traffic, version_order

log = logging.getLogger("sluice.gateway")


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


class ModelCatalog:
    """The model versions of the workers in `connections` (the gateway's own table, shared),
    indexed (`indexed`) and resolved for requests (`resolve`)."""

    def __init__(self, clock: Clock, tenancy: Tenancy, traffic: Traffic, connections: dict[str, WorkerConnection],
                 rng: random.Random, on_canary_moved: Callable[[CanaryEvent], None]) -> None:
        self._clock = clock
        self._tenancy = tenancy
        self._traffic = traffic
        self._connections = connections
        self._rng = rng
        self._on_canary_moved = on_canary_moved
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
        self._index: ModelIndex | None = None  # rebuilt lazily after a worker's change

    def cancel_loads(self) -> None:
        """Stop the loads on demand under way (the gateway is closing)."""
        for task, _ in list(self._on_demand_loads.values()):
            task.cancel()

    def invalidate(self) -> None:
        self._index = None

    def worker_changed(self, connection: WorkerConnection) -> None:
        """A worker's readiness or models changed. One that serves a model unloaded through this
        gateway (it restarted, and loaded its whole repository) is told to unload it again."""
        self.invalidate()
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
        has = versions_of(connection)
        names = {name for name, _ in has}
        gone = {key for key in self.expected_versions
                if (self.workers_share_repository or key[0] in names) and key not in has}
        if not gone:
            return
        for other in self._connections.values():
            if other is not connection and other.state is not None:
                gone -= versions_of(other)
        if gone:
            log.info("no longer expecting %s: removed from the repository",
                     ", ".join(f"{name} v{version}" for name, version in sorted(gone)))
            self.expected_versions -= gone

    def _load_on_demand(self, name: str, version: str | None, *, start: bool) -> None:
        """If a worker loads `name` (`version`, if given) on demand and none serves it, have the
        least busy such worker load it (`start`; once, whatever the number of requests meanwhile),
        and raise the 503 that tells the caller when to try again."""
        offers = self.indexed().dormant
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
        self.invalidate()
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
        self.invalidate()
        return ModelSync(name, versions, sorted(refused), sorted(set(asked) - set(answers)))

    def indexed(self) -> ModelIndex:
        if self._index is None:
            self._index = index = ModelIndex.build(self._connections.values())
            for canary in self._traffic.running():  # a version gone ends its canary
                event = self._traffic.check_served(canary.model, index.with_recovering.get(canary.model, {}))
                if event is not None:
                    self._on_canary_moved(event)
        return self._index

    def models(self, *, include_recovering: bool = False) -> dict[str, dict[str, wire.ModelInfo]]:
        """Model versions served by a ready worker (or one being restarted): name -> version -> info."""
        index = self.indexed()
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
        split gives its `route_key` (`gateway.traffic`; a 503 if the split names no served version),
        else (no split, or without `by_split`) the newest.
        One that a worker loads on demand and none serves is loaded now (`on_demand`; not for a
        readiness check), and the request answered 503 with when to try again. With `tenant`,
        the tenant's permission for `name` comes first: a model it may not use is its 403, not a
        503 while the workers start (nor a load on demand it would trigger)."""
        if tenant is not None:
            self._tenancy.authorize(self._tenancy.tenant(tenant), name)
        versions = self.models(include_recovering=True).get(name)
        if versions and version is None:
            split = self.split(name) if by_split else None
            if split is None:
                return versions[max(versions, key=version_order)]
            chosen = split.choose(versions, None if route_key is None else f"{name}\0{route_key}", self._rng)
            if chosen is None:
                raise self._split_unserved(name, split, versions)
            return versions[chosen]
        if versions and version in versions:
            return versions[version]
        if any(model == name and version in (None, v) for model, v in self.indexed().loading):
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

    def _split_unserved(self, name: str, split: Split, served: dict[str, wire.ModelInfo]) -> ModelVersionUnavailable:
        """The 503 for a request that names no version when no version of `name`'s split is served:
        which split, who set it, and how to mend it (or when to try again, if one is loading)."""
        named = [version for version, _ in split.shares]
        source = self._traffic.source(name)
        who = {None: "declared in its model.toml [routing]", "operator": "set by an operator",
               "canary": "of its running canary", "canary result": "left by its last canary",
               "rollback": "left by a rollback"}.get(source, f"set by {source}")
        newest = max(served, key=version_order)
        message = (f"model {name!r} serves none of the versions its traffic split names (the split {who}: "
                   f"version{'s' if len(named) > 1 else ''} {', '.join(named)}; it serves "
                   f"{', '.join(sorted(served, key=version_order))}), so a request that names no version is refused")
        loading = sorted((v for n, v in self.indexed().loading if n == name and v in named), key=version_order)
        if loading:
            return ModelVersionUnavailable(f"{message} until version {loading[0]} is loaded; try again shortly",
                                           retry_after_s=1.0)
        if source is None:
            fix = (f"name a served version in model.toml's [routing] and reload it (`sluice models load {name}`), "
                   f"set a split (`sluice models traffic {name} {newest}=100`)")
        else:
            fix = (f"set a split of served versions (`sluice models traffic {name} {newest}=100`), go back to the "
                   f"model's declared one (`sluice models traffic {name} --reset`)")
        return ModelVersionUnavailable(f"{message}: {fix}, or load one of its versions again; a request may also "
                                       f"name its version (`{name}:{newest}`, /v2/models/{name}/versions/{newest})")

    @property
    def expected_models(self) -> set[str]:
        """The models of `expected_versions`."""
        return {name for name, _ in self.expected_versions}

    def split(self, name: str) -> Split | None:
        """The traffic split requests to `name` that name no version follow (None: the newest)."""
        return self._traffic.split(name, self.indexed().declared.get(name))

    def declared_split(self, name: str) -> Split | None:
        """The split the model declares (`model.toml` [routing]), whatever operators changed."""
        return self.indexed().declared.get(name)

    def traffic_shares(self, name: str | None = None) -> dict[tuple[str, str], float]:
        """(model, version) -> the share (0-1) of the model's unversioned requests it gets now, for
        every served version of every model (or of `name`): as `resolve` draws them (all 0 when
        `resolve` refuses them: no version of the model's split is served)."""
        shares: dict[tuple[str, str], float] = {}
        for model, versions in self.models(include_recovering=True).items():
            if name is not None and model != name:
                continue
            split = self.split(model)
            weights = {max(versions, key=version_order): 1.0} if split is None else dict(split.live(versions))
            total = sum(weights.values())  # 0: no version of the split is served, every request refused
            for version in versions:
                shares[(model, version)] = weights.get(version, 0.0) / total if total else 0.0
        return shares

    def loading_models(self) -> set[str]:
        """Expected models that no ready worker serves yet, that were not refused at load and that
        are not left to be loaded on demand (unloaded after they were idle)."""
        ready = self.models()
        refused = {r.name for r in self.refused()}
        dormant = {name for name, _ in self.indexed().dormant}
        expected = self.expected_models | {name for name, _ in self.indexed().loading}
        return {name for name in expected if name not in ready and name not in refused | dormant}

    def loading_versions(self) -> set[tuple[str, str]]:
        """(model, version) that a ready worker is loading now and none serves."""
        return set(self.indexed().loading)

    def dormant_versions(self) -> set[tuple[str, str]]:
        """(model, version) that a ready worker loads on demand and none serves."""
        return set(self.indexed().dormant)
