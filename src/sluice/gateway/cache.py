"""The result cache: a deterministic request asked again is answered without the device.

    Gateway ─▶ admitted (auth, limits) ─▶ cache_key ─┬─ stored? ──────────────▶ answer ("hit")
                                                      ├─ same request running? ─▶ its answer ("coalesced")
                                                      └─ run it ─▶ store it ───▶ answer

Which requests: those to a model version whose worker marks it deterministic
(`ModelInfo.cache_revision`, from `model.toml` `[cache] enabled`, on by default except for
external services), and for generative models only greedy (`temperature` 0), whole-answer
requests. A key is a digest of the tenant, the model version, its revision (weights and settings)
and the whole payload, so one tenant's requests never answer another's (a shared entry would let
a tenant learn, from how fast it is answered, what another tenant asked), and new weights under
the same version number start cold. Only successful answers are stored.

Single flight: while a request runs, identical ones (same key) wait for its answer instead of
taking the device too; if it fails, each of them runs on its own, within its own deadline.

A client can opt out with `Cache-Control: no-cache` (do not answer from the cache, but store the
fresh answer) or `no-store` (neither). `MemoryStore` is pure (no I/O, an injected clock);
`shared_cache.RedisCacheStore` shares entries between gateways.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import enum
import hashlib
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import msgspec

from sluice import wire
from sluice.clock import Clock

__all__ = ["CachePolicy", "CachedResult", "MemoryStore", "ResultCache", "SharedStore", "cache_key", "cache_policy"]

CACHE_HEADER = "x-sluice-cache"
"""Sent on answers that did not run on a device for this request: `hit` (stored) or `coalesced`."""


class CachePolicy(enum.Enum):
    USE = "use"
    """Answer from the cache when possible, store new answers."""
    REFRESH = "refresh"
    """`Cache-Control: no-cache`: run the request, store its answer."""
    BYPASS = "bypass"
    """`Cache-Control: no-store`: the cache is neither read nor written."""


def cache_policy(cache_control: str | None) -> CachePolicy:
    """The policy a request's `Cache-Control` header asks for (directives are case-insensitive;
    ones that mean nothing here, such as `max-stale`, are ignored)."""
    if not cache_control:
        return CachePolicy.USE
    directives: dict[str, str] = {}
    for part in cache_control.split(","):
        name, _, value = part.partition("=")
        directives[name.strip().lower()] = value.strip().strip('"')
    if "no-store" in directives:
        return CachePolicy.BYPASS
    if "no-cache" in directives or directives.get("max-age") == "0":
        return CachePolicy.REFRESH
    return CachePolicy.USE


class CachedResult(msgspec.Struct, frozen=True):
    """What is kept of an answer: enough to answer it again."""

    payload: wire.Payload
    num_tokens: int


_ENTRY_OVERHEAD_BYTES = 100
"""About what an entry costs beyond its key's and value's bytes: the two objects' headers and its dict slot."""
_ENCODER = msgspec.msgpack.Encoder()
_DECODE_RESULT = msgspec.msgpack.Decoder(CachedResult).decode


def cache_key(info: wire.ModelInfo, request: wire.Payload | bytes, tenant: str) -> bytes | None:
    """The key of a request whose answer may be cached, None if it may not be. `request`: its
    parsed payload, or the bytes its answer depends on as the client sent them (KServe infer's
    body: hashed before it is parsed, so an overload check can look for a stored answer cheaply;
    a body written differently is then another key)."""
    if not info.cache_revision:
        return None
    if isinstance(request, wire.GeneratePayload) and (request.stream or request.temperature != 0):
        return None  # sampled text differs run to run; a stream is answered as it is made
    kind, data = ("raw", request) if isinstance(request, bytes) else ("", _ENCODER.encode(request))
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{tenant}\0{info.name}\0{info.version}\0{info.cache_revision}\0{kind}\0".encode())
    digest.update(data)
    return digest.digest()


class MemoryStore:
    """Least recently used entries, bounded in bytes, each kept at most `ttl_s`. An entry larger
    than `max_entry_bytes` is not kept: one big answer must not push out hundreds of small ones.

    The garbage collector never walks the entries. A full store holds about a million answers; as
    objects in an `OrderedDict` every full collection in the gateway walked them all, a pause of
    0.5-0.8 s with the default 256 MiB (`benchmarks/cache_gc.py`). So each entry is one `bytes` (its
    expiry, then the msgpack of the answer) in a plain dict of `bytes`, which CPython does not
    track at all; the dict's order is the order of use (a use moves the entry to the end), and
    eviction takes from the front, a sliver of the capacity at a time so that the front's
    emptied slots are skipped once per sliver, not once per entry. An entry's size is then exact.
    """

    def __init__(self, capacity_bytes: int, ttl_s: float, clock: Clock, *, max_entry_bytes: int | None = None) -> None:
        if capacity_bytes <= 0 or ttl_s <= 0:
            raise ValueError("a memory store needs a positive capacity and time to live")
        self.capacity_bytes = capacity_bytes
        self.max_entry_bytes = max_entry_bytes if max_entry_bytes is not None else max(capacity_bytes // 16, 1)
        self._ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[bytes, bytes] = {}
        self.num_bytes = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        """Holds an answer for `key` now (does not count as a use)."""
        return self._live(key) is not None

    def get(self, key: bytes) -> CachedResult | None:
        entry = self._live(key)
        if entry is None:
            return None
        del self._entries[key]
        self._entries[key] = entry  # the most recently used now
        return _DECODE_RESULT(memoryview(entry)[_EXPIRY.size:])

    def _live(self, key: bytes) -> bytes | None:
        """The entry unless it has expired (then it is dropped)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self._clock.now() >= _EXPIRY.unpack_from(entry)[0]:
            del self._entries[key]
            self.num_bytes -= _size(key, entry)
            return None
        return entry

    def put(self, key: bytes, value: CachedResult) -> bool:
        """Keep `value` under `key`; False if it is too large to keep."""
        entry = _EXPIRY.pack(self._clock.now() + self._ttl_s) + _ENCODER.encode(value)
        size = _size(key, entry)
        if size > self.max_entry_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= _size(key, old)
        if self.num_bytes + size > self.capacity_bytes:
            self._evict(self.num_bytes + size - self.capacity_bytes + self.capacity_bytes // 64)
        self._entries[key] = entry
        self.num_bytes += size
        return True

    def _evict(self, num_bytes: int) -> None:
        """Drop the least recently used entries until `num_bytes` are freed (or none is left)."""
        victims: list[bytes] = []
        freed = 0
        for victim, entry in self._entries.items():
            if freed >= num_bytes:
                break
            victims.append(victim)
            freed += _size(victim, entry)
        for victim in victims:
            del self._entries[victim]
        self.num_bytes -= freed
        self.num_evicted += len(victims)


_EXPIRY = struct.Struct("<d")


def _size(key: bytes, entry: bytes) -> int:
    """What an entry is counted as in a `MemoryStore`'s bytes."""
    return len(key) + len(entry) + _ENTRY_OVERHEAD_BYTES


class SharedStore(Protocol):
    """A store shared by several gateways. It never raises: an entry it cannot read is a miss,
    one it cannot write is not kept (a cache must not fail or slow down a request)."""

    async def get(self, key: bytes) -> CachedResult | None: ...

    def put(self, key: bytes, value: CachedResult) -> None: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class CacheConfig:
    capacity_bytes: int = 256 * 1024 * 1024
    """This gateway's own store; 0: none (only the shared store, if any)."""
    ttl_s: float = 3600.0
    redis_url: str | None = None
    """A `redis://` URL: also keep entries there, shared by every gateway using it."""


T = TypeVar("T")


class ResultCache:
    """A local store, an optional shared one behind it, and the requests in flight by key."""

    def __init__(self, local: MemoryStore | None, shared: SharedStore | None = None) -> None:
        self.local = local
        self.shared = shared
        self.lookups: collections.Counter[tuple[str, str]] = collections.Counter()
        """(model, "hit" | "coalesced" | "miss") -> requests so far (exported on each scrape)."""
        self._in_flight: dict[bytes, asyncio.Future[CachedResult | BaseException | None] | None] = {}
        """Keys being run; the future is made when the first identical request comes to wait."""

    async def answer(
        self, key: bytes, policy: CachePolicy, model: str, deadline_s: float,
        run: Callable[[], Awaitable[T]], keep: Callable[[T], CachedResult | None],
        is_final: Callable[[BaseException], bool] = lambda error: False,
    ) -> tuple[T | CachedResult, str]:
        """The answer for `key` and where it came from: "hit" (stored), "coalesced" (an identical
        request's run), or "": `run()`'s own result, whose `keep(result)` is stored (unless None).
        `deadline_s`: from now, the most this request may wait for an identical one's answer
        (TimeoutError past it). A run that fails with an error `is_final` (the same input would
        fail the same way) fails the identical requests waiting for it too; after any other
        failure one of them runs in its place and the rest wait for that one."""
        if policy is CachePolicy.BYPASS:
            return await run(), ""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + deadline_s
        if policy is CachePolicy.USE:
            stored = await self._get(key)
            if stored is not None:
                self.lookups[model, "hit"] += 1
                return stored, "hit"
            while key in self._in_flight:
                waiting = self._in_flight[key]
                if waiting is None:
                    waiting = self._in_flight[key] = loop.create_future()
                async with asyncio.timeout_at(give_up_at):  # not wait_for: it can swallow a client's disconnect
                    value = await asyncio.shield(waiting)
                if isinstance(value, BaseException):
                    raise copy.copy(value)
                if value is not None:
                    self.lookups[model, "coalesced"] += 1
                    return value, "coalesced"
        self.lookups[model, "miss"] += 1
        is_leading = key not in self._in_flight
        if is_leading:
            self._in_flight[key] = None
        outcome: CachedResult | BaseException | None = None
        try:
            result = await run()
            outcome = keep(result)
            if outcome is not None:
                self._put(key, outcome)
        except Exception as error:
            outcome = error if is_final(error) else None
            raise
        finally:
            if is_leading:
                waiting = self._in_flight.pop(key)
                if waiting is not None and not waiting.done():
                    waiting.set_result(outcome)  # None: one of those waiting runs instead
        return result, ""

    async def _get(self, key: bytes) -> CachedResult | None:
        if self.local is not None and (value := self.local.get(key)) is not None:
            return value
        if self.shared is None:
            return None
        value = await self.shared.get(key)
        if value is not None and self.local is not None:
            self.local.put(key, value)
        return value

    def _put(self, key: bytes, value: CachedResult) -> None:
        if self.local is not None:
            self.local.put(key, value)
        if self.shared is not None:
            self.shared.put(key, value)

    async def aclose(self) -> None:
        if self.shared is not None:
            await self.shared.aclose()
