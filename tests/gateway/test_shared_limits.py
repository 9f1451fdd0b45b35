"""What only the Redis-kept limits do: several gateways draw on one set of buckets, a dead
gateway's in-flight requests stop counting when their lease ends, and a Redis that cannot be
reached leaves each gateway its own limits instead of refusing every request."""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path

import pytest
import redis.asyncio as redis
from redis.exceptions import RedisError

from sluice.clock import VirtualClock
from sluice.errors import RateLimited
from sluice.gateway.limits import Refusal, Reservation
from sluice.gateway.shared_limits import REDIS_CIRCUIT, SharedLimiter
from sluice.gateway.tenancy import Tenancy
from sluice.gateway.tenants import Tenant
from sluice.metrics import GatewayMetrics
from sluice.priority import Priority
from tests.conftest import start_redis

_PREFIXES = itertools.count()


def _pair(url: str, clock: VirtualClock, **kwargs: float) -> tuple[SharedLimiter, SharedLimiter]:
    prefix = f"shared-{next(_PREFIXES)}"
    return (SharedLimiter(redis.Redis.from_url(url), clock, prefix=prefix, **kwargs),
            SharedLimiter(redis.Redis.from_url(url), clock, prefix=prefix, **kwargs))


def test_two_gateways_share_one_request_bucket(redis_url: str) -> None:
    async def scenario() -> None:
        clock = VirtualClock(1_000.0)
        first, second = _pair(redis_url, clock)
        tenant = Tenant(name="t", requests_per_min=3)
        outcomes = [await first.admit(tenant, 0), await second.admit(tenant, 0), await first.admit(tenant, 0)]
        assert all(isinstance(o, Reservation) for o in outcomes)
        refused = await second.admit(tenant, 0)
        assert isinstance(refused, Refusal) and refused.limit == "requests"
        assert refused.retry_after_s == pytest.approx(20.0)
        clock.advance(20.0)
        assert isinstance(await second.admit(tenant, 0), Reservation)
        for limiter in (first, second):
            await limiter.aclose()

    asyncio.run(scenario())


def test_concurrency_is_shared_and_a_lost_gateways_requests_expire_with_their_lease(redis_url: str) -> None:
    async def scenario() -> None:
        clock = VirtualClock(1_000.0)
        first, second = _pair(redis_url, clock, lease_s=30.0)
        tenant = Tenant(name="t", max_concurrent=2)
        held = [await first.admit(tenant, 0), await first.admit(tenant, 0)]  # then `first` dies unsettled
        assert all(isinstance(r, Reservation) for r in held)
        refused = await second.admit(tenant, 0)
        assert isinstance(refused, Refusal) and refused.limit == "concurrency"
        clock.advance(31.0)
        assert isinstance(await second.admit(tenant, 0), Reservation)
        for limiter in (first, second):
            await limiter.aclose()

    asyncio.run(scenario())


def test_a_dead_gateways_slots_free_within_a_lease_while_a_live_ones_stay_taken(redis_url: str) -> None:
    """Leases are short and renewed: a gateway that stops without settling (it died) frees its
    tenant's slot once its lease ends; one that lives keeps its slot well past a lease, renewing."""
    async def scenario() -> None:
        prefix = f"shared-{next(_PREFIXES)}"
        dead, live, other = (SharedLimiter(redis.Redis.from_url(redis_url), prefix=prefix, lease_s=1.0, renew_s=0.2)
                             for _ in range(3))
        tenant = Tenant(name="t", max_concurrent=2)
        assert isinstance(await dead.admit(tenant, 0), Reservation)
        held = await live.admit(tenant, 0)
        assert isinstance(held, Reservation)
        await dead.aclose()  # stopped without settling: nothing renews its lease now
        refused = await other.admit(tenant, 0)
        assert isinstance(refused, Refusal) and refused.limit == "concurrency"
        await asyncio.sleep(2.5)  # two and a half leases
        assert isinstance(await other.admit(tenant, 0), Reservation)  # the dead one's slot came back
        refused = await other.admit(tenant, 0)  # the live one's is still taken
        assert isinstance(refused, Refusal) and refused.limit == "concurrency"
        assert (await other.usage(tenant)).in_flight == 2
        await live.settle(held, 0, 0.5)
        assert isinstance(await other.admit(tenant, 0), Reservation)
        for limiter in (live, other):
            await limiter.aclose()

    asyncio.run(scenario())


def test_a_request_settled_after_its_lease_ran_out_is_still_charged_once(redis_url: str) -> None:
    """Redis was away longer than a lease, so nothing renewed it: the request's slot stopped
    counting, but its settlement, when it comes, still charges its device time (once)."""
    async def scenario() -> None:
        clock = VirtualClock(1_000.0)
        limiter, other = _pair(redis_url, clock, lease_s=10.0)
        tenant = Tenant(name="t", max_concurrent=1)
        held = await limiter.admit(tenant, 0)
        assert isinstance(held, Reservation)
        clock.advance(30.0)  # no renewal reached Redis
        assert isinstance(await other.admit(tenant, 0), Reservation)  # the slot no longer counts
        await limiter.settle(held, 0, 2.0)
        await limiter.settle(held, 0, 2.0)  # a replay charges nothing
        assert (await other.usage(tenant)).device_s == pytest.approx(2.0)
        for each in (limiter, other):
            await each.aclose()

    asyncio.run(scenario())


def test_renewal_is_one_round_trip_for_all_requests_in_flight(redis_url: str) -> None:
    async def scenario() -> None:
        clock = VirtualClock(1_000.0)
        limiter, other = _pair(redis_url, clock, lease_s=10.0)
        tenants = [Tenant(name="a", max_concurrent=3), Tenant(name="b", max_concurrent=3)]
        for tenant in tenants:
            for _ in range(3):
                assert isinstance(await limiter.admit(tenant, 0), Reservation)
        calls = []
        execute = redis.client.Pipeline.execute

        async def counted(pipeline: redis.client.Pipeline, *args: object, **kwargs: object) -> object:
            calls.append(len(pipeline.command_stack))
            return await execute(pipeline, *args, **kwargs)

        redis.client.Pipeline.execute = counted  # type: ignore[method-assign]
        try:
            for _ in range(3):
                clock.advance(8.0)  # within each lease, renewed: 24 s in all
                await limiter.renew_leases()
        finally:
            redis.client.Pipeline.execute = execute  # type: ignore[method-assign]
        assert calls == [4, 4, 4]  # per round: one pipeline, a ZADD and a PEXPIRE per tenant
        for tenant in tenants:
            assert (await other.usage(tenant)).in_flight == 3
        for each in (limiter, other):
            await each.aclose()

    asyncio.run(scenario())


def test_device_time_settled_by_one_gateway_counts_against_the_others_budget(redis_url: str) -> None:
    async def scenario() -> None:
        clock = VirtualClock(1_000.0)
        first, second = _pair(redis_url, clock)
        tenant = Tenant(name="t", credits_device_s=1.0, credit_period_s=3600)
        reservation = await first.admit(tenant, 0)
        assert isinstance(reservation, Reservation)
        await first.settle(reservation, 0, device_s=1.5)
        refused = await second.admit(tenant, 0)
        assert isinstance(refused, Refusal) and refused.limit == "credits" and refused.is_final
        assert (await second.usage(tenant)).device_s == pytest.approx(1.5)
        for limiter in (first, second):
            await limiter.aclose()

    asyncio.run(scenario())


def test_an_unreachable_redis_leaves_each_gateway_its_own_limits(tmp_path) -> None:
    async def scenario() -> None:
        tenants = tmp_path / "tenants.toml"
        tenants.write_text('[tenants.t]\napi_keys = []\nrequests_per_min = 2\n')
        dead = SharedLimiter(redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5))
        tenancy = Tenancy(VirtualClock(), GatewayMetrics(), tenants, dead)
        tenant = tenancy.tenant("t")
        first = await tenancy.admit(tenant, Priority.STANDARD, 0)
        await tenancy.settle(first, 0, 0.1)
        await tenancy.admit(tenant, Priority.STANDARD, 0)
        with pytest.raises(RateLimited):  # the local bucket of 2/min is spent
            await tenancy.admit(tenant, Priority.STANDARD, 0)
        assert (await tenancy.usage())[0].device_s == pytest.approx(0.1)
        await tenancy.aclose()

    asyncio.run(scenario())


def test_after_a_failure_redis_is_left_alone_until_the_circuit_lets_a_trial_through() -> None:
    """During an outage only one call per `open_s` waits for Redis; the rest fail at once."""
    async def scenario() -> None:
        clock = VirtualClock(1_000.0)
        limiter = SharedLimiter(redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5), clock)
        tenant = Tenant(name="t", requests_per_min=10)
        with pytest.raises(redis.ConnectionError):
            await limiter.admit(tenant, 0)  # tried, and failed
        with pytest.raises(RedisError, match="not calling Redis"):
            await limiter.admit(tenant, 0)  # refused at once: the circuit is open
        clock.advance(5.1)
        with pytest.raises(redis.ConnectionError):
            await limiter.admit(tenant, 0)  # the trial call goes to Redis again
        await limiter.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("applied", [False, True], ids=["not-applied", "applied-reply-lost"])
def test_a_settlement_redis_missed_is_sent_again_frees_its_slot_and_is_charged_once(redis_url: str,
                                                                                      applied: bool) -> None:
    """A request finishes while Redis does not answer: its settlement is kept, and the next
    admission sends it first, so the tenant gets its concurrency slot back at once rather than
    when the lease ends, and its device time is charged. When Redis had applied it and only the
    reply was lost (a timeout), sending it again must not charge the tenant twice."""
    async def scenario() -> None:
        clock = VirtualClock(1_000.0)
        limiter, other = _pair(redis_url, clock, lease_s=600.0)
        tenant = Tenant(name="t", max_concurrent=1)
        held = await limiter.admit(tenant, 0)
        assert isinstance(held, Reservation)
        settle_script = limiter._settle

        async def failing(**kwargs: object) -> None:
            if applied:
                await settle_script(**kwargs)
            raise RedisError("timeout reading the reply" if applied else "connection reset")

        limiter._settle = failing  # Redis fails this one call; everything else is the real Redis
        with pytest.raises(RedisError):
            await limiter.settle(held, 0, 2.5)
        limiter._settle = settle_script
        assert limiter.num_unsettled == 1
        clock.advance(REDIS_CIRCUIT.open_s + 1.0)  # the outage is over: the breaker lets a call through
        assert isinstance(await limiter.admit(tenant, 0), Reservation)  # the slot came back
        assert limiter.num_unsettled == 0
        assert (await other.usage(tenant)).device_s == pytest.approx(2.5)  # once, not 5.0
        for each in (limiter, other):
            await each.aclose()

    asyncio.run(scenario())


def test_a_redis_outage_is_logged_once_when_it_starts_and_once_when_it_ends(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        tenants = tmp_path / "tenants.toml"
        tenants.write_text('[tenants.t]\napi_keys = []\nrequests_per_min = 1000\n')
        process, port = start_redis(tmp_path, "--save", "", "--appendonly", "no")
        clock = VirtualClock(1_000.0)
        limiter = SharedLimiter(redis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=0.5),
                                clock)
        tenancy = Tenancy(clock, GatewayMetrics(), tenants, limiter)
        tenant = tenancy.tenant("t")
        try:
            await tenancy.settle(await tenancy.admit(tenant, Priority.STANDARD, 0), 0, 0.1)
            process.terminate()
            process.wait(timeout=10)
            for _ in range(3):  # three trial calls (one per opening of the circuit), each failing
                for _ in range(5):
                    await tenancy.settle(await tenancy.admit(tenant, Priority.STANDARD, 0), 0, 0.1)
                clock.advance(REDIS_CIRCUIT.open_s + 0.1)
            process, _ = start_redis(tmp_path, "--save", "", "--appendonly", "no", port=port)
            for _ in range(5):
                await tenancy.settle(await tenancy.admit(tenant, Priority.STANDARD, 0), 0, 0.1)
            assert limiter.num_unsettled == 0  # Redis is in use again
        finally:
            await tenancy.aclose()
            process.terminate()
            process.wait(timeout=10)

    with caplog.at_level(logging.INFO, logger="sluice"):
        asyncio.run(scenario())
    records = [r for r in caplog.records if "shared limits in Redis" in r.getMessage()]
    assert [r.levelname for r in records] == ["WARNING", "INFO"]
    assert "unavailable" in records[0].getMessage() and "reachable again after 15 s" in records[1].getMessage()
