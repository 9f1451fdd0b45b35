"""Which ready workers serve which model versions: the index the gateway routes and resolves by.

Built from the workers' connections (`ModelIndex.build`), and rebuilt only when a worker's
readiness or models change (`catalog.ModelCatalog.invalidate`), not on every request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from sluice import wire
from sluice.gateway.connection import WorkerConnection
from sluice.gateway.traffic import Split, version_order

log = logging.getLogger("sluice.gateway")


@dataclass(frozen=True, slots=True)
class ModelIndex:
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
    def build(cls, connections: Iterable[WorkerConnection]) -> ModelIndex:
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


def versions_of(connection: WorkerConnection) -> set[tuple[str, str]]:
    """The model versions a worker says it has: served, loading, refused, loaded on demand."""
    state = connection.state
    refused = {(r.name, r.version) for r in state.refused} if state is not None else set()
    return {(info.name, info.version) for info in connection.known_models} | set(connection.loading) \
        | set(connection.dormant) | refused
