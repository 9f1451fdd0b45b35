"""The result cache's policy and store (`gateway/cache.py`), under a virtual clock."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest

from sluice import wire
from sluice.clock import VirtualClock
from sluice.gateway.cache import CachedResult, CachePolicy, MemoryStore, ResultCache, cache_key, cache_policy


def _info(revision: str = "r1", version: str = "1", kind: str = "emulated") -> wire.ModelInfo:
    return wire.ModelInfo(name="m", version=version, kind=kind, platform="p", inputs=(), outputs=(), max_batch_size=8,
                          slo_s=1.0, accepts_text=True, accepts_tensor=True, cache_revision=revision)


def _tensor(*values: float) -> wire.TensorPayload:
    array = np.array([values], dtype=np.float32)
    return wire.TensorPayload(str(array.dtype), array.shape, array.tobytes())


def _result(size: int = 0, tokens: int = 3) -> CachedResult:
    return CachedResult(wire.TensorPayload("uint8", (size,), bytes(size)), tokens)


def _entry_bytes() -> int:
    """What a store counts for an entry with an empty key and no data."""
    store = MemoryStore(10_000, 60.0, VirtualClock())
    store.put(b"", _result())
    return store.num_bytes


_ENTRY = _entry_bytes()


@pytest.mark.parametrize(("header", "policy"), [
    (None, CachePolicy.USE), ("", CachePolicy.USE), ("max-age=60", CachePolicy.USE),
    ("no-cache", CachePolicy.REFRESH), ("No-Cache", CachePolicy.REFRESH), ("max-age=0", CachePolicy.REFRESH),
    ("private, max-age = 0", CachePolicy.REFRESH), ("no-store", CachePolicy.BYPASS),
    ("no-cache, no-store", CachePolicy.BYPASS),
])
def test_cache_control_header_sets_the_policy(header: str | None, policy: CachePolicy) -> None:
    assert cache_policy(header) is policy


def test_the_key_covers_tenant_model_version_revision_and_the_whole_payload() -> None:
    base = cache_key(_info(), _tensor(1, 2), "a")
    assert base is not None and base == cache_key(_info(), _tensor(1, 2), "a")
    others = [cache_key(_info(), _tensor(1, 2), "b"), cache_key(_info(version="2"), _tensor(1, 2), "a"),
              cache_key(_info(revision="r2"), _tensor(1, 2), "a"), cache_key(_info(), _tensor(1, 3), "a"),
              cache_key(_info(), wire.TextPayload(["1 2"]), "a")]
    assert len({base, *others}) == 6


def test_a_request_can_be_keyed_by_its_bytes_before_it_is_parsed() -> None:
    body = b'{"inputs": [1, 2]}'
    base = cache_key(_info(), body, "a")
    assert base is not None and base == cache_key(_info(), body, "a")
    others = [cache_key(_info(), body, "b"), cache_key(_info(version="2"), body, "a"),
              cache_key(_info(revision="r2"), body, "a"), cache_key(_info(), b'{"inputs": [1, 3]}', "a")]
    assert len({base, *others}) == 5
    assert cache_key(_info(revision=""), body, "a") is None


def test_only_deterministic_requests_have_a_key() -> None:
    assert cache_key(_info(revision=""), _tensor(1), "a") is None  # the model is not marked cacheable
    greedy = wire.GeneratePayload(prompt="hi", temperature=0.0)
    assert cache_key(_info(kind="generative"), greedy, "a") is not None
    assert cache_key(_info(kind="generative"), wire.GeneratePayload(prompt="hi", temperature=0.7), "a") is None
    assert cache_key(_info(kind="generative"), wire.GeneratePayload(prompt="hi", temperature=0.0, stream=True),
                     "a") is None


def test_memory_store_evicts_the_least_recently_used_to_stay_within_its_bytes() -> None:
    clock = VirtualClock()
    store = MemoryStore(3 * (1 + _ENTRY + 40) + 20, 60.0, clock, max_entry_bytes=400)  # three entries of 40 bytes
    for key in (b"a", b"b", b"c"):
        assert store.put(key, _result(40))
    assert store.get(b"a") is not None  # now the most recently used
    store.put(b"d", _result(40))
    assert [k for k in (b"a", b"b", b"c", b"d") if store.get(k) is not None] == [b"a", b"c", b"d"]
    assert store.num_evicted == 1 and len(store) == 3 and store.num_bytes <= store.capacity_bytes
    assert not store.put(b"big", _result(1000)) and store.get(b"big") is None  # over max_entry_bytes
    store.put(b"a", _result(10))  # replacing an entry counts only its new size
    assert store.num_bytes == 3 * (1 + _ENTRY) + 40 + 40 + 10 and store.num_evicted == 1
    store.put(b"a", _result(100))  # grown: the least recently used other entry makes room
    assert store.get(b"c") is None and store.get(b"d") is not None
    assert store.num_bytes == 2 * (1 + _ENTRY) + 40 + 100 and store.num_evicted == 2


def test_memory_store_entries_expire() -> None:
    clock = VirtualClock()
    store = MemoryStore(10_000, 60.0, clock)
    store.put(b"k", _result())
    clock.advance(59.9)
    assert store.get(b"k") is not None
    clock.advance(0.1)
    assert store.get(b"k") is None and len(store) == 0 and store.num_bytes == 0


def test_memory_store_entries_are_not_walked_by_the_garbage_collector() -> None:
    """A full store holds about a million answers; as objects tracked by the collector each full
    collection would walk them all (half a second and more)."""
    store = MemoryStore(1 << 30, 60.0, VirtualClock())
    gc.collect()
    before = len(gc.get_objects())
    for i in range(20_000):
        store.put(i.to_bytes(16, "big"), CachedResult(wire.TextPayload([f"answer {i}"]), 2))
    gc.collect()
    assert len(gc.get_objects()) - before < 100
    assert store.get((7).to_bytes(16, "big")) == CachedResult(wire.TextPayload(["answer 7"]), 2)


class _Runs:
    """A stand-in for dispatching to a worker: counts runs, each taking `delay_s`."""

    def __init__(self, delay_s: float = 0.0, fail: int = 0) -> None:
        self.count = 0
        self.delay_s = delay_s
        self.fail = fail

    async def __call__(self) -> CachedResult:
        self.count += 1
        await asyncio.sleep(self.delay_s)
        if self.count <= self.fail:
            raise RuntimeError("the device failed")
        return _result(tokens=self.count)


def _same(value: CachedResult) -> CachedResult:
    return value


def _cache() -> ResultCache:
    return ResultCache(MemoryStore(1 << 20, 60.0, VirtualClock()))


async def test_a_stored_answer_is_served_without_running() -> None:
    cache, run = _cache(), _Runs()
    first = await cache.answer(b"k", CachePolicy.USE, "m", 1.0, run, _same)
    second = await cache.answer(b"k", CachePolicy.USE, "m", 1.0, run, _same)
    assert run.count == 1 and first == (_result(tokens=1), "") and second == (_result(tokens=1), "hit")


async def test_no_cache_runs_and_stores_and_no_store_leaves_the_cache_alone() -> None:
    cache, run = _cache(), _Runs()
    await cache.answer(b"k", CachePolicy.USE, "m", 1.0, run, _same)
    assert await cache.answer(b"k", CachePolicy.REFRESH, "m", 1.0, run, _same) == (_result(tokens=2), "")
    assert await cache.answer(b"k", CachePolicy.USE, "m", 1.0, run, _same) == (_result(tokens=2), "hit")
    assert await cache.answer(b"other", CachePolicy.BYPASS, "m", 1.0, run, _same) == (_result(tokens=3), "")
    assert await cache.answer(b"other", CachePolicy.USE, "m", 1.0, run, _same) == (_result(tokens=4), "")


async def test_identical_requests_in_flight_share_one_run() -> None:
    cache, run = _cache(), _Runs(delay_s=0.05)
    answers = await asyncio.gather(*(cache.answer(b"k", CachePolicy.USE, "m", 1.0, run, _same) for _ in range(8)))
    assert run.count == 1
    assert sorted(source for _, source in answers) == [""] + ["coalesced"] * 7
    assert {value for value, _ in answers} == {_result(tokens=1)}


async def test_when_the_shared_run_fails_one_waiting_request_runs_for_the_rest() -> None:
    cache, run = _cache(), _Runs(delay_s=0.05, fail=1)
    answers = await asyncio.gather(*(cache.answer(b"k", CachePolicy.USE, "m", 1.0, run, _same) for _ in range(4)),
                                   return_exceptions=True)
    failed = [a for a in answers if isinstance(a, RuntimeError)]
    assert len(failed) == 1 and run.count == 2  # the first run's error is its own; one more run for the other three
    assert sorted(a[1] for a in answers if not isinstance(a, BaseException)) == ["", "coalesced", "coalesced"]
    assert cache.lookups == {("m", "miss"): 2, ("m", "coalesced"): 2}


async def test_an_error_the_same_input_would_repeat_is_shared_not_run_again() -> None:
    cache, run = _cache(), _Runs(delay_s=0.05, fail=1)
    answers = await asyncio.gather(*(cache.answer(b"k", CachePolicy.USE, "m", 1.0, run, _same,
                                                  lambda error: isinstance(error, RuntimeError)) for _ in range(4)),
                                   return_exceptions=True)
    assert run.count == 1 and all(isinstance(a, RuntimeError) for a in answers)
    assert len({id(a) for a in answers}) == 4  # each request raises its own copy


async def test_an_answer_keep_declines_is_returned_but_not_stored() -> None:
    cache, run = _cache(), _Runs()
    assert await cache.answer(b"k", CachePolicy.USE, "m", 1.0, run, lambda value: None) == (_result(tokens=1), "")
    assert await cache.answer(b"k", CachePolicy.USE, "m", 1.0, run, _same) == (_result(tokens=2), "")
    assert cache.lookups == {("m", "miss"): 2}


async def test_a_cancelled_run_does_not_leave_the_others_waiting() -> None:
    cache, run = _cache(), _Runs(delay_s=0.2)
    leader = asyncio.create_task(cache.answer(b"k", CachePolicy.USE, "m", 5.0, run, _same))
    await asyncio.sleep(0.01)
    follower = asyncio.create_task(cache.answer(b"k", CachePolicy.USE, "m", 5.0, run, _same))
    await asyncio.sleep(0.01)
    leader.cancel()
    _, source = await asyncio.wait_for(follower, 1.0)
    assert source == "" and run.count == 2


async def test_waiting_for_an_identical_request_stops_at_the_deadline() -> None:
    cache, run = _cache(), _Runs(delay_s=0.5)
    leader = asyncio.create_task(cache.answer(b"k", CachePolicy.USE, "m", 5.0, run, _same))
    await asyncio.sleep(0.01)
    with pytest.raises(TimeoutError):
        await cache.answer(b"k", CachePolicy.USE, "m", 0.05, run, _same)
    assert (await leader)[1] == "" and run.count == 1
