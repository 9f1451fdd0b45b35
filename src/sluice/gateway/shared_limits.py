"""Tenant limits shared by every gateway, kept in Redis.

`TenantLimiter` (limits.py) keeps its buckets in one process: with N gateways behind a load
balancer a tenant would get N times its limits. `SharedLimiter` applies the same rules to one set
of buckets in Redis, each admission and settlement one Lua script, so the check-all-then-consume
rule holds across gateways too (a script runs atomically; no other client's command interleaves).

    sluice:limits:{tenant}            hash: request and token buckets (capacity, level, refilled-at),
                                      credit period index, device-seconds used in it and in total
    sluice:limits:{tenant}:inflight   sorted set: one member per admitted request, scored by the
                                      time its lease ends

Concurrency is counted from the in-flight set: a member counts while its lease has not ended.
A lease is short (`lease_s`, 10 s) and the gateway that holds it renews the leases of all its
requests still in flight every `renew_s` (2 s), in one pipelined round trip, so a gateway that
dies with requests in flight frees its tenants' concurrency within a lease. A member whose lease
ended stays in the set (not counted) for `settle_window_s` more, the gateway's longest request
timeout: a settlement applies while its request's member is in the set, and removes it, so one
that arrives late (Redis was away, and the lease ran out meanwhile) still charges its tokens and
device time, and one sent again because its reply was lost charges nothing more. Only a
settlement later than the window goes uncharged. The two keys
share the `{tenant}` hash tag, so a Redis Cluster keeps them on one shard. Times are wall-clock
seconds from the gateway's clock, so gateways must keep their clocks in sync (NTP); a skew of a
second or two only shifts refills by as much.

The semantics, including every edge (a request larger than a bucket, a changed limit starting a
fresh bucket, refunds), are those of `TenantLimiter`: tests/gateway/test_limits.py runs the same
cases against both.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import itertools
import logging
import math
import os
import socket
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import redis.asyncio as redis
from redis.exceptions import RedisError

from sluice.circuit import CircuitBreaker, CircuitConfig
from sluice.clock import Clock, WallClock
from sluice.gateway.limits import (
    REQUEST_S_WEIGHT,
    LimitStatus,
    Refusal,
    Reservation,
    Usage,
    likely_count,
    reserved_tokens,
    too_large,
)
from sluice.gateway.tenants import Tenant
from sluice.tasks import cancel_and_wait, sleep

__all__ = ["SharedLimiter"]

log = logging.getLogger("sluice.tenancy")

T = TypeVar("T")

REDIS_CIRCUIT = CircuitConfig(failure_threshold=1, open_s=5.0)
"""One failure opens the circuit: Redis is local infrastructure, and a second caller should not wait
for a timeout the first one just hit."""

# Shared by both scripts: load a bucket from the hash, refilled to `now` (a new limit starts full;
# a changed one keeps what was used of the old, as `limits._bucket` does).
_LOAD = """
local now = tonumber(ARGV[1])
local function bucket(cap, c, l, a)
  if cap <= 0 then return nil end
  c = tonumber(c); l = tonumber(l); a = tonumber(a)
  if c == nil or l == nil or a == nil then return {cap = cap, level = cap, at = now} end
  if now > a then l = math.min(c, l + (now - a) * c / 60.0); a = now end
  if c ~= cap then l = cap - (c - l) end
  return {cap = cap, level = l, at = a}
end
local rpm, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
local credits, period = tonumber(ARGV[4]), tonumber(ARGV[5])
local h = redis.call('HMGET', KEYS[1], 'rc', 'rl', 'ra', 'tc', 'tl', 'ta', 'pi', 'pu', 'tu', 'rd')
local req = bucket(rpm, h[1], h[2], h[3])
local tok = bucket(tpm, h[4], h[5], h[6])
local pi, pu, tu = tonumber(h[7]) or -1, tonumber(h[8]) or 0, tonumber(h[9]) or 0
local rd = tonumber(h[10])  -- mean request duration (limits.decayed_mean), nil until one ended
if credits > 0 then
  local index = math.floor(now / period)
  if index ~= pi then pi = index; pu = 0 end
end
local function save()
  local fields = {'pi', pi, 'pu', tostring(pu), 'tu', tostring(tu)}
  if rd then table.insert(fields, 'rd'); table.insert(fields, tostring(rd)) end
  if req then for _, v in ipairs({'rc', tostring(req.cap), 'rl', tostring(req.level), 'ra', tostring(req.at)}) do
    table.insert(fields, v) end end
  if tok then for _, v in ipairs({'tc', tostring(tok.cap), 'tl', tostring(tok.level), 'ta', tostring(tok.at)}) do
    table.insert(fields, v) end end
  redis.call('HSET', KEYS[1], unpack(fields))
end
local function status(b)
  if b == nil then return {'', '', ''} end
  return {tostring(b.cap), tostring(math.max(0, b.level)), tostring(math.max(0, b.cap - b.level) / (b.cap / 60.0))}
end
"""

# ARGV: now rpm tpm credits period max_concurrent estimated_tokens lease_id lease_until settle_window_s
_ADMIT = _LOAD + """
local maxc, est, lease_id, lease_until = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8], tonumber(ARGV[9])
local window = tonumber(ARGV[10])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)  -- past even a late settlement
local in_flight = redis.call('ZCOUNT', KEYS[2], '(' .. now, '+inf')  -- leases not ended
local function wait(b, amount)
  if b == nil then return 0 end
  local need = math.min(amount, b.cap) - b.level
  if need <= 0 then return 0 end
  return need / (b.cap / 60.0)
end
local refused, retry, final = '', 0, 0
if maxc > 0 and in_flight >= maxc then
  refused, retry = 'concurrency', rd and math.max(rd / (in_flight + 1), 0.001) or 1  -- limits.next_slot_s
elseif credits > 0 and pu >= credits then
  refused, retry, final = 'credits', math.max((pi + 1) * period - now, 1), 1
else
  local w = wait(req, 1)
  if w > 0 then refused, retry = 'requests', w
  else
    w = wait(tok, est)
    if w > 0 then refused, retry = 'tokens', w end
  end
end
if refused == '' then
  if req then req.level = math.min(req.cap, req.level - 1) end
  if tok then tok.level = math.min(tok.cap, tok.level - est) end
  redis.call('ZADD', KEYS[2], lease_until, lease_id)
  redis.call('PEXPIRE', KEYS[2], math.ceil((lease_until + window - now) * 1000))
end
save()
local reply = {refused, tostring(retry), final}
for _, v in ipairs(status(req)) do table.insert(reply, v) end
for _, v in ipairs(status(tok)) do table.insert(reply, v) end
return reply
"""

# ARGV: now rpm tpm credits period lease_id refund reserved_tokens tokens device_s held_s weight
_SETTLE = _LOAD + """
if redis.call('ZREM', KEYS[2], ARGV[6]) == 0 then return 0 end  -- settled already: a replay
if req and ARGV[7] == '1' then req.level = math.min(req.cap, req.level + 1) end
if tok then tok.level = math.min(tok.cap, tok.level + tonumber(ARGV[8]) - tonumber(ARGV[9])) end
local held = math.max(tonumber(ARGV[11]), 0)
if rd then rd = rd + tonumber(ARGV[12]) * (held - rd) else rd = held end
pu = pu + tonumber(ARGV[10])
tu = tu + tonumber(ARGV[10])
save()
return 1
"""


MAX_UNSETTLED = 100_000
"""Settlements kept while Redis is away; beyond it the oldest are dropped (their leases end anyway)."""


@dataclass(frozen=True, slots=True)
class _Settlement:
    reservation: Reservation
    tokens: float
    device_s: float
    refund_request: bool
    held_s: float
    """How long the request held its concurrency slot."""


class SharedLimiter:
    """`TenantLimiter`'s rules over buckets in Redis, shared by every gateway that uses the same
    Redis and prefix. Limits travel with every call (a changed limit starts a fresh bucket in the
    script), so there is nothing to configure on a reload.

    Raises `redis.RedisError` when Redis cannot be reached, and the caller decides whether to fall
    back. A circuit breaker stops calling a Redis that failed: while it is open every call fails at
    once, so during an outage only one request per `open_s` waits for the socket timeout."""

    def __init__(self, client: redis.Redis, clock: Clock | None = None, *, prefix: str = "sluice:limits",
                 lease_s: float = 10.0, renew_s: float = 2.0, settle_window_s: float = 3600.0,
                 circuit: CircuitConfig = REDIS_CIRCUIT) -> None:
        """`lease_s`: how long an admitted request holds its concurrency slot unless renewed;
        `renew_s`: how often this gateway renews the leases of its requests in flight;
        `settle_window_s`: how long after its lease ended a request's settlement still charges it
        (the gateway's longest request timeout)."""
        if not (0 < renew_s < lease_s and settle_window_s >= 0):
            raise ValueError("shared limits need 0 < renew_s < lease_s and settle_window_s >= 0")
        self._client = client
        self._clock = clock or WallClock()
        self._prefix = prefix
        self._lease_s = lease_s
        self._renew_s = renew_s
        self._settle_window_s = settle_window_s
        self._leases: dict[str, str] = {}
        """This gateway's requests in flight: lease id -> its tenant's in-flight key."""
        self._renewer: asyncio.Task[None] | None = None
        self._admit = client.register_script(_ADMIT)
        self._settle = client.register_script(_SETTLE)
        self._ids = itertools.count()
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
        self._breaker = CircuitBreaker(circuit, self._clock)
        self._unsettled: collections.deque[_Settlement] = collections.deque(maxlen=MAX_UNSETTLED)
        self._is_flushing = False
        self._down_since: float | None = None
        """When calls to Redis started failing (None: they succeed): an outage is logged when it
        starts and when it ends, not at every call that fails meanwhile."""

    @classmethod
    def from_url(cls, url: str, *, settle_window_s: float) -> SharedLimiter:
        return cls(redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0),
                   settle_window_s=settle_window_s)

    async def ping(self) -> None:
        await self._guarded(self._client.ping())

    async def aclose(self) -> None:
        """Stop renewing (the leases of requests still in flight then end on their own) and close."""
        if self._renewer is not None:
            await cancel_and_wait([self._renewer])
            self._renewer = None
        await self._client.aclose()

    async def renew_leases(self) -> None:
        """Extend the lease of every request of this gateway still in flight to `lease_s` from now,
        in one pipelined round trip. A lease already settled is not brought back (`XX`); one that
        ended while Redis was away is, and counts again. Raises `RedisError`."""
        if not self._leases:
            return
        now = self._clock.now()
        by_key: dict[str, dict[str, float]] = {}
        for lease_id, key in self._leases.items():
            by_key.setdefault(key, {})[lease_id] = now + self._lease_s
        pipeline = self._client.pipeline(transaction=False)
        for key, leases in by_key.items():
            pipeline.zadd(key, leases, xx=True)
            pipeline.pexpire(key, math.ceil((self._lease_s + self._settle_window_s) * 1000))
        await self._guarded(pipeline.execute())

    async def _renew_forever(self) -> None:
        while True:
            await sleep(self._renew_s)
            with contextlib.suppress(RedisError):  # the circuit and the outage log have it; tried again next round
                await self.renew_leases()

    async def admit(self, tenant: Tenant, estimated_tokens: float,
                    likely_tokens: float | None = None) -> Reservation | Refusal:
        """As `TenantLimiter.admit`, the limits held in Redis for every gateway."""
        if (refusal := too_large(tenant, likely_count(estimated_tokens, likely_tokens))) is not None:
            return refusal
        estimated_tokens = reserved_tokens(tenant, estimated_tokens)
        if self._unsettled:
            await self._flush_unsettled()  # frees the slots they hold before this request counts them
        now = self._clock.now()
        lease_id = f"{self._owner}:{next(self._ids)}"
        keys = self._keys(tenant.name)
        reply = await self._guarded(self._admit(keys=keys, args=[
            *self._limit_args(tenant, now), tenant.max_concurrent, estimated_tokens, lease_id, now + self._lease_s,
            self._settle_window_s]))
        refused, retry_after_s, is_final = _text(reply[0]), float(reply[1]), bool(int(reply[2]))
        statuses = _statuses([_text(v) for v in reply[3:9]])
        if refused:
            return Refusal(refused, retry_after_s, is_final, statuses)
        self._leases[lease_id] = keys[1]
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_forever(), name="sluice-renew-limit-leases")
        return Reservation(tenant.name, estimated_tokens, statuses, lease_id=lease_id, limits=tenant, admitted_at=now)

    async def settle(self, reservation: Reservation, tokens: float, device_s: float, *,
                     refund_request: bool = False) -> None:
        if reservation.is_settled:
            return
        reservation.is_settled = True
        if reservation.limits is None:
            return
        self._leases.pop(reservation.lease_id, None)  # ended: renewed no more, settled or not
        held_s = self._clock.now() - reservation.admitted_at
        settlement = _Settlement(reservation, tokens, device_s, refund_request, held_s)
        try:
            await self._run(settlement)
        except RedisError:
            self._unsettled.append(settlement)  # settled later, when Redis answers again
            raise

    @property
    def num_unsettled(self) -> int:
        """Settlements Redis missed, kept to be sent again."""
        return len(self._unsettled)

    async def _flush_unsettled(self) -> None:
        """Send the settlements Redis missed, oldest first. Each frees its request's concurrency
        slot now rather than when its lease runs out, and charges its tokens and device time.
        Raises `RedisError` (keeping the rest) if Redis still cannot be reached."""
        if self._is_flushing:
            return
        self._is_flushing = True
        try:
            while self._unsettled:
                await self._run(self._unsettled[0])
                self._unsettled.popleft()
        finally:
            self._is_flushing = False

    async def _run(self, settlement: _Settlement) -> None:
        reservation = settlement.reservation
        tenant = reservation.limits
        assert tenant is not None
        await self._guarded(self._settle(keys=self._keys(tenant.name), args=[
            *self._limit_args(tenant, self._clock.now()), reservation.lease_id,
            "1" if settlement.refund_request else "0", reservation.tokens, settlement.tokens, settlement.device_s,
            settlement.held_s, REQUEST_S_WEIGHT]))

    async def usage(self, tenant: Tenant) -> Usage:
        now = self._clock.now()
        key, inflight = self._keys(tenant.name)
        reply = cast(Awaitable[list[Any]], self._client.hmget(key, ["tu", "pu", "pi"]))  # (typed sync | async)
        total, period_used, period_index = await self._guarded(reply)
        in_flight = await self._guarded(self._client.zcount(inflight, f"({now}", "+inf"))  # leases not ended
        is_current = (tenant.credits_device_s > 0 and period_index is not None
                      and int(float(period_index)) == math.floor(now / tenant.credit_period_s))
        return Usage(float(total or 0.0), float(period_used or 0.0) if is_current else 0.0, int(in_flight))

    async def _guarded(self, call: Awaitable[T]) -> T:
        """Await a Redis call through the circuit breaker."""
        if not self._breaker.allow():
            if inspect.iscoroutine(call):
                call.close()
            raise RedisError(f"not calling Redis for {self._breaker.retry_after_s():.1f} s after a failure")
        try:
            result = await call
        except RedisError as exc:
            self._breaker.record_failure()
            if self._down_since is None:
                self._down_since = self._clock.now()
                log.warning("shared limits in Redis unavailable (%s): each gateway applies its own limits "
                            "until Redis is back", exc)
            raise
        self._breaker.record_success()
        if self._down_since is not None:
            log.info("shared limits in Redis reachable again after %.0f s: limits are shared again",
                     self._clock.now() - self._down_since)
            self._down_since = None
        return result

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self._prefix}:{{{tenant}}}"
        return [base, f"{base}:inflight"]

    @staticmethod
    def _limit_args(tenant: Tenant, now: float) -> list[float]:
        return [now, tenant.requests_per_min, tenant.tokens_per_min, tenant.credits_device_s, tenant.credit_period_s]


def _text(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _statuses(fields: list[str]) -> tuple[LimitStatus, ...]:
    statuses = []
    for name, (capacity, remaining, reset_s) in (("requests", fields[0:3]), ("tokens", fields[3:6])):
        if capacity:
            statuses.append(LimitStatus(name, float(capacity), float(remaining), float(reset_s)))
    return tuple(statuses)
