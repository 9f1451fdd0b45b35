"""Traffic splits and canaries shared by the gateways of a cluster, through Redis.

Each model's state (`traffic.Published`: the split set by an operator or a canary, and a running
canary's description) is one JSON record in the hash `sluice:traffic`, with a revision per model
in `sluice:traffic:rev`. A gateway that changes a model's state publishes it, but only over the
revision it last saw (a Lua script checks it), so a change made elsewhere in the meantime is never
overwritten: the later writer is told to look again. Every gateway reads both hashes every
`poll_s` and follows the records that others wrote since.

A canary is run by the gateway it was started on (its *owner*), which republishes it at each
poll (its lease, `lease_s`) and at each step. The others follow its split; an operator's
`promote` or `rollback` sent to one of them is handed to the owner through `sluice:traffic:cmd`
and answered once the owner has published the result. If the owner stops republishing (it died,
or lost Redis), the first gateway to notice rolls the canary back to the split it started from.

With Redis unreachable, each gateway keeps the state it has and goes on alone (logged); it
publishes again when Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from sluice.gateway.traffic import CanaryEvent, Published, Traffic
from sluice.tasks import cancel_and_wait, sleep

log = logging.getLogger("sluice.gateway")

RECORDS, REVISIONS, COMMANDS = "sluice:traffic", "sluice:traffic:rev", "sluice:traffic:cmd"

_PUBLISH = """
local seen = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if seen ~= tonumber(ARGV[3]) then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
"""


class Stale(Exception):
    """Another gateway changed the model's state since this one last read it."""


class SharedTraffic:
    def __init__(self, url: str, owner: str, traffic: Traffic, on_event: Callable[[CanaryEvent], None],
                 poll_s: float = 0.5, lease_s: float = 5.0) -> None:
        self._redis = aioredis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._publish_script = self._redis.register_script(_PUBLISH)
        self.owner = owner
        self._traffic = traffic
        self._on_event = on_event
        self._poll_s, self._lease_s = poll_s, lease_s
        self._seen: dict[str, int] = {}
        """Each model's revision this gateway has taken (or written)."""
        self._task: asyncio.Task[None] | None = None
        self._publishing: set[asyncio.Task[None]] = set()  # held so they are not collected mid-flight
        self._lock = asyncio.Lock()  # one sync or publish at a time, so revisions are read in order

    async def start(self) -> None:
        await self.sync()
        self._task = asyncio.create_task(self._run())

    async def aclose(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
        await self._redis.aclose()

    async def _run(self) -> None:
        while True:
            await sleep(self._poll_s)
            try:
                await self.sync()
            except (RedisError, OSError) as exc:
                log.warning("cannot reach the shared traffic state in Redis; going on with this gateway's: %s", exc)

    async def publish(self, model: str) -> None:
        """Share this gateway's state of `model`. Raises `Stale` if another gateway changed it
        since this one last read it (this gateway has followed that change when it returns)."""
        async with self._lock:
            await self._publish(model)

    async def _publish(self, model: str) -> None:
        state = self._traffic.published(model, self.owner, time.time())
        record = {**state.to_json(), "by": self.owner, "lease_until": time.time() + self._lease_s}
        revision = int(await self._publish_script(keys=[RECORDS, REVISIONS],
                                                  args=[model, json.dumps(record), self._seen.get(model, 0)]))
        if revision < 0:
            await self._sync()
            raise Stale(f"the traffic of model {model!r} was changed on another gateway meanwhile; "
                        "look at it again (GET /admin/models/...) and retry")
        self._seen[model] = revision

    async def sync(self) -> None:
        async with self._lock:
            await self._sync()

    async def _sync(self) -> None:
        """Follow others' newer records; as a canary's owner, renew it and take operators' commands;
        roll back a canary whose owner went quiet."""
        async with self._redis.pipeline(transaction=True) as pipe:
            records, revisions, commands = await pipe.hgetall(RECORDS).hgetall(REVISIONS).hgetall(COMMANDS).execute()
        now = time.time()
        for raw_model, raw in records.items():
            model, revision = raw_model.decode(), int(revisions.get(raw_model, 0))
            if revision <= self._seen.get(model, 0):
                continue
            self._seen[model] = revision
            try:
                record = json.loads(raw)
                state = Published.from_json(record)
            except (ValueError, KeyError, TypeError) as exc:
                log.error("ignoring an unreadable shared traffic record for model %s: %s", model, exc)
                continue
            if record.get("by") == self.owner:
                continue
            event = self._traffic.follow(model, state)
            if event is not None:
                self._on_event(event)
        for canary in self._traffic.running():  # renew what this gateway runs, or act on commands
            command = commands.get(canary.model.encode())
            if command is not None:
                await self._redis.hdel(COMMANDS, canary.model)
                self._command(canary.model, command.decode())
            with contextlib.suppress(Stale):
                await self._publish(canary.model)
        for raw_model, raw in records.items():  # canaries whose gateway stopped renewing them
            model = raw_model.decode()
            remote = self._traffic.remote_canary(model)
            if remote is None:
                continue
            record = json.loads(raw)
            if float(record.get("lease_until", now)) < now - self._poll_s:
                self._abandoned(model, remote, str(record.get("by")))

    def _command(self, model: str, action: str) -> None:
        try:
            event = self._traffic.promote(model) if action == "promote" else self._traffic.roll_back(model)
        except KeyError:
            return
        if event is not None:
            self._on_event(event)

    def _abandoned(self, model: str, remote: Published, owner: str) -> None:
        """The gateway running `model`'s canary stopped renewing it: back to the split it started from."""
        version = None if remote.canary is None else remote.canary.get("version")
        self._traffic.follow(model, Published(remote.before, "rollback"))
        self._on_event(CanaryEvent(model, "rolled_back", 0.0,
                                   f"gateway {owner}, which ran the canary of version {version}, stopped renewing it"))
        self.publish_soon(model)

    async def _publish_quietly(self, model: str) -> None:
        try:
            await self.publish(model)
        except Stale:
            pass  # followed the newer state instead
        except (RedisError, OSError) as exc:
            log.warning("cannot share model %s's traffic state in Redis: %s", model, exc)

    def publish_soon(self, model: str) -> None:
        """`publish` from synchronous code (a canary's step or end, judged as a request ends)."""
        task = asyncio.get_running_loop().create_task(self._publish_quietly(model))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def command(self, model: str, action: str, timeout_s: float = 5.0) -> bool:
        """Ask the gateway running `model`'s canary to `promote` or `rollback` it; True once it has
        published the result, False if it did not within `timeout_s`."""
        before = self._seen.get(model, 0)
        await self._redis.hset(COMMANDS, model, action)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            await self.sync()
            if self._seen.get(model, 0) > before and self._traffic.remote_canary(model) is None:
                return True
        return False
