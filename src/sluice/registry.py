"""The worker registry in Redis (DESIGN's cluster mode): workers announce where they listen,
gateways find them there, so neither needs the other's address in its configuration.

    sluice:workers:<address>  =  <worker id>      one key per worker, with a TTL (default 10 s)
                                                  that the worker renews every TTL / 5

    sluice worker --bind tcp://0.0.0.0:7000 --advertise tcp://10.0.0.5:7000 --registry redis://r:6379/0
    sluice gateway --registry redis://r:6379/0

A worker registers once it listens, before its models are loaded (gateways see them loading:
their requests go to another worker, or get 503 "try again", meanwhile), and deletes its key
when it starts draining (SIGTERM), so gateways stop sending it work before it goes; a worker
that dies without that drops out when its key expires. Gateways read the registry every second:
a new address is connected to, one whose key is gone is disconnected (requests it had not
started are sent to another worker) — unless the gateway still hears it serving (connected,
reporting, not draining): then it was the registry that lost the key (Redis restarted without
its data, or was flushed), not the worker, which registers again within TTL / 5. Redis being
unreachable changes nothing: workers keep serving, and gateways keep the workers they know until
Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Coroutine
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from sluice.tasks import cancel_and_wait, sleep

log = logging.getLogger("sluice.registry")

PREFIX = "sluice:workers:"
DEFAULT_TTL_S = 10.0


class WorkerRegistration:
    """A worker's entry in the registry, kept alive while it serves."""

    def __init__(self, url: str, worker_id: str, address: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        self._redis = aioredis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._key = PREFIX + address
        self._worker_id = worker_id
        self._ttl_ms = int(ttl_s * 1000)
        self._task: asyncio.Task[None] | None = None
        self._closing: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Register, and keep the entry alive; nothing if the worker already began to drain."""
        if self._closing is None and self._task is None:
            self._task = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        failing = False
        while True:
            try:
                await self._redis.set(self._key, self._worker_id, px=self._ttl_ms)
                if failing:
                    log.warning("worker registry reachable again; %s registered", self._key)
                failing = False
            except (RedisError, OSError) as exc:
                if not failing:
                    log.warning("cannot register in the worker registry (retrying): %s", exc)
                failing = True
            await sleep(self._ttl_ms / 5000)

    def withdraw(self) -> None:
        """Stop renewing and delete the entry (in the background): the worker is draining."""
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._close())

    async def aclose(self) -> None:
        """Withdraw (if not already) and wait until the entry is deleted."""
        self.withdraw()
        assert self._closing is not None
        await self._closing

    async def _close(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
            try:
                await self._redis.delete(self._key)
            except (RedisError, OSError) as exc:  # it expires on its own
                log.warning("could not remove %s from the worker registry: %s", self._key, exc)
        with contextlib.suppress(RedisError, OSError):
            await self._redis.aclose()


async def registered_workers(client: aioredis.Redis) -> dict[str, str]:
    """Every registered worker: address -> worker id."""
    keys = [key async for key in client.scan_iter(match=PREFIX + "*", count=500)]
    if not keys:
        return {}
    ids = await client.mget(keys)
    return {key.decode()[len(PREFIX):]: worker_id.decode() for key, worker_id in zip(keys, ids, strict=True)
            if worker_id is not None}


class RegistryWatcher:
    """A gateway's view of the registry: calls `add(worker_id, address)` for each new worker and
    `remove(worker_id)` for each one whose entry is gone, unless `serving(worker_id)` says the
    gateway still hears that worker serve (the registry lost the entry, not the worker)."""

    def __init__(self, url: str, add: Callable[[str, str], Coroutine[Any, Any, None]],
                 remove: Callable[[str], Coroutine[Any, Any, None]], poll_s: float = 1.0,
                 serving: Callable[[str], bool] = lambda worker_id: False, named: Collection[str] = ()) -> None:
        self._redis = aioredis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._add, self._remove, self._serving = add, remove, serving
        self._named = frozenset(named)
        """Addresses the gateway was given (`--worker`) and connects to already: never a second time."""
        self._unlisted: set[str] = set()
        """Addresses of workers kept although the registry does not list them (logged once)."""
        self._poll_s = poll_s
        self.workers: dict[str, str] = {}
        """Address -> the worker id given to the gateway."""
        self._task: asyncio.Task[None] | None = None
        self._removals: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Read the registry once (the workers known at start-up), then keep watching it."""
        await self.refresh()
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await sleep(self._poll_s)
            await self.refresh()

    async def refresh(self) -> None:
        try:
            registered = await registered_workers(self._redis)
        except (RedisError, OSError) as exc:
            log.warning("cannot read the worker registry; keeping the %d workers known: %s", len(self.workers), exc)
            return
        for address in [a for a in self.workers if a not in registered]:
            if self._serving(self.workers[address]):
                if address not in self._unlisted:
                    self._unlisted.add(address)
                    log.warning("worker %s is missing from the registry but still serving: keeping it "
                                "(Redis lost its entry; it registers again)", self.workers[address])
                continue
            self._unlisted.discard(address)
            worker_id = self.workers.pop(address)
            log.warning("worker %s left the registry", worker_id)
            removal = asyncio.create_task(self._remove(worker_id))  # a draining worker first finishes its work
            self._removals.add(removal)
            removal.add_done_callback(self._removals.discard)
        self._unlisted.intersection_update(a for a in self.workers if a not in registered)
        for address, worker_id in registered.items():
            if address in self._named:
                continue
            if address not in self.workers:
                self.workers[address] = name = f"{worker_id}@{address}"
                log.info("worker %s joined from the registry", name)
                await self._add(name, address)

    async def aclose(self) -> None:
        await cancel_and_wait(task for task in [self._task, *self._removals] if task is not None)
        with contextlib.suppress(RedisError, OSError):
            await self._redis.aclose()
