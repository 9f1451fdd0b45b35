"""Per-tenant limits under a virtual clock: the same cases for this gateway's own limiter (pure
policy) and for the limiter shared through a real Redis (`shared_limits`), which must agree."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.clock import VirtualClock
from sluice.gateway.limits import Refusal, Reservation, TenantLimiter, Usage, format_duration
from sluice.gateway.tenancy import _refusal_error
from sluice.gateway.tenants import Tenant

_PREFIXES = itertools.count()


class _Shared:
    """`SharedLimiter` driven synchronously (one event loop per test), as the cases are written."""

    def __init__(self, url: str, clock: VirtualClock) -> None:
        import redis.asyncio as redis

        from sluice.gateway.shared_limits import SharedLimiter

        self._runner = asyncio.Runner()
        # a lease longer than any case's clock jumps: these cases leave the loop (and its renewals)
        # idle between calls; leases are test_shared_limits.py's subject
        self._limiter = SharedLimiter(redis.Redis.from_url(url), clock, prefix=f"test-{next(_PREFIXES)}",
                                      lease_s=3600.0)

    def configure(self, tenants: Iterable[Tenant]) -> None:
        """Nothing to do: the shared limiter takes each tenant's limits with every call."""

    def admit(self, tenant: Tenant, tokens: float, likely: float | None = None) -> Reservation | Refusal:
        return self._runner.run(self._limiter.admit(tenant, tokens, likely))

    def settle(self, reservation: Reservation, tokens: float, device_s: float, **kwargs: Any) -> None:
        self._runner.run(self._limiter.settle(reservation, tokens, device_s, **kwargs))

    def usage(self, tenant: Tenant) -> Usage:
        return self._runner.run(self._limiter.usage(tenant))

    def close(self) -> None:
        self._runner.run(self._limiter.aclose())
        self._runner.close()


@pytest.fixture(params=["local", "redis"])
def limiter(request: pytest.FixtureRequest) -> Iterator[Callable[..., tuple[Any, Tenant]]]:
    made: list[_Shared] = []

    def make(clock: VirtualClock, **limits: float) -> tuple[Any, Tenant]:
        tenant = Tenant(name="t", **limits)  # type: ignore[arg-type]
        lim: Any
        if request.param == "local":
            lim = TenantLimiter(clock)
        else:
            lim = _Shared(request.getfixturevalue("redis_url"), clock)
            made.append(lim)
        lim.configure([tenant])
        return lim, tenant

    yield make
    for lim in made:
        lim.close()


def test_requests_per_minute_refuses_the_excess_and_refills(limiter):
    clock = VirtualClock()
    lim, tenant = limiter(clock, requests_per_min=3)
    for _ in range(3):
        assert isinstance(lim.admit(tenant, 0), Reservation)
    refusal = lim.admit(tenant, 0)
    assert isinstance(refusal, Refusal) and refusal.limit == "requests"
    assert refusal.retry_after_s == pytest.approx(20.0)  # 3/min: one request every 20 s
    clock.advance(20.0)
    assert isinstance(lim.admit(tenant, 0), Reservation)


def test_a_refusal_by_one_limit_consumes_no_other(limiter):
    clock = VirtualClock()
    lim, tenant = limiter(clock, requests_per_min=10, tokens_per_min=100)
    first = lim.admit(tenant, 100)
    assert isinstance(first, Reservation)
    refusal = lim.admit(tenant, 50)  # tokens are spent: refused by the tokens limit
    assert isinstance(refusal, Refusal) and refusal.limit == "tokens"
    requests = {s.name: s for s in refusal.statuses}["requests"]
    assert requests.remaining == pytest.approx(9)  # the refused request took no request token


def test_reserved_tokens_stop_concurrent_overshoot_and_settle_refunds(limiter):
    clock = VirtualClock()
    lim, tenant = limiter(clock, tokens_per_min=1000)
    held = [lim.admit(tenant, 400), lim.admit(tenant, 400)]
    assert all(isinstance(r, Reservation) for r in held)
    assert isinstance(lim.admit(tenant, 400), Refusal)  # 1,200 would overshoot: refused before any settles
    for reservation in held:
        assert isinstance(reservation, Reservation)
        lim.settle(reservation, tokens=50, device_s=0.0)  # actual use was much smaller
    assert isinstance(lim.admit(tenant, 400), Reservation)


def test_settling_twice_counts_once(limiter):
    clock = VirtualClock()
    lim, tenant = limiter(clock, max_concurrent=1, credits_device_s=10)
    reservation = lim.admit(tenant, 0)
    assert isinstance(reservation, Reservation)
    lim.settle(reservation, 0, device_s=1.0)
    lim.settle(reservation, 0, device_s=1.0)
    assert lim.usage(tenant).device_s == pytest.approx(1.0)
    assert isinstance(lim.admit(tenant, 0), Reservation)


def test_a_bound_above_a_minutes_tokens_waits_for_a_full_bucket_and_settles_its_real_count(limiter):
    """A long English prompt: its bound (a token per byte) is over the minute's 60 tokens, its
    likely count (20) is not. It is not refused for good: it reserves the whole minute, so it waits
    while anything else holds tokens, and its real count is settled afterwards."""
    clock = VirtualClock()
    lim, tenant = limiter(clock, tokens_per_min=60)
    held = lim.admit(tenant, 10)
    assert isinstance(held, Reservation)
    waiting = lim.admit(tenant, 90, 20)
    assert isinstance(waiting, Refusal) and not waiting.too_large and waiting.limit == "tokens"
    lim.settle(held, 10, device_s=0.0)
    clock.advance(10.0)  # the bucket refills to its minute's 60
    reservation = lim.admit(tenant, 90, 20)
    assert isinstance(reservation, Reservation)
    assert {s.name: s.remaining for s in reservation.statuses}["tokens"] == 0
    lim.settle(reservation, 25, device_s=0.0)
    after = lim.admit(tenant, 35)
    assert isinstance(after, Reservation), "the 35 tokens it did not use came back"
    refusal = lim.admit(tenant, 300, 61)
    assert isinstance(refusal, Refusal) and refusal.too_large, "likely over a minute's tokens: refused for good"


def test_a_request_larger_than_a_minutes_tokens_is_refused_for_good_and_takes_nothing(limiter):
    clock = VirtualClock()
    lim, tenant = limiter(clock, tokens_per_min=60, requests_per_min=10)
    refusal = lim.admit(tenant, 61)
    assert isinstance(refusal, Refusal)
    assert (refusal.limit, refusal.too_large, refusal.is_final) == ("tokens", True, True)
    error = _refusal_error(tenant, refusal, 61)  # both limiters: the message names the real limit
    assert "about 61 tokens, more than the 60 tokens per minute" in error.message
    assert error.headers["x-should-retry"] == "false"
    reservation = lim.admit(tenant, 60)  # a whole minute's worth still fits: nothing was taken
    assert isinstance(reservation, Reservation)
    assert {s.name: s.remaining for s in reservation.statuses} == {"requests": 9, "tokens": 0}


def test_usage_reports_device_time_in_all_and_this_period_and_requests_in_flight(limiter):
    clock = VirtualClock(600 + 10)
    lim, tenant = limiter(clock, credits_device_s=10, credit_period_s=60)
    first, second = lim.admit(tenant, 0), lim.admit(tenant, 0)
    lim.settle(first, 0, 2.0)
    assert lim.usage(tenant) == Usage(2.0, 2.0, 1)
    clock.advance(60)  # a new period
    assert lim.usage(tenant) == Usage(2.0, 0.0, 1)
    lim.settle(second, 0, 1.0)
    assert lim.usage(tenant) == Usage(3.0, 1.0, 0)


def test_concurrency_cap_and_release(limiter):
    clock = VirtualClock()
    lim, tenant = limiter(clock, max_concurrent=2)
    a, b = lim.admit(tenant, 0), lim.admit(tenant, 0)
    refusal = lim.admit(tenant, 0)
    assert isinstance(refusal, Refusal) and refusal.limit == "concurrency" and not refusal.is_final
    assert isinstance(a, Reservation)
    lim.settle(a, 0, 0.0)
    assert isinstance(lim.admit(tenant, 0), Reservation)
    assert isinstance(b, Reservation)


def test_a_concurrency_refusal_says_when_a_slot_should_free(limiter):
    clock = VirtualClock()
    lim, tenant = limiter(clock, max_concurrent=2)
    a, b = lim.admit(tenant, 0), lim.admit(tenant, 0)
    assert lim.admit(tenant, 0).retry_after_s == 1.0  # no request has ended yet: a second
    clock.advance(0.3)
    lim.settle(a, 0, 0.0)  # it held its slot 0.3 s
    assert isinstance(lim.admit(tenant, 0), Reservation)
    refusal = lim.admit(tenant, 0)
    # two in flight, a request takes 0.3 s: the first of them ends in about 0.1 s
    assert isinstance(refusal, Refusal) and refusal.retry_after_s == pytest.approx(0.1)
    clock.advance(0.05)
    lim.settle(b, 0, 0.0)  # 0.35 s: the mean moves a fifth of the way
    assert lim.admit(tenant, 0)
    assert lim.admit(tenant, 0).retry_after_s == pytest.approx((0.3 + 0.2 * 0.05) / 3)


def test_credit_budget_is_final_until_the_period_resets(limiter):
    clock = VirtualClock(start_s=1000.0)
    lim, tenant = limiter(clock, credits_device_s=2.0, credit_period_s=3600)
    for _ in range(2):
        reservation = lim.admit(tenant, 0)
        assert isinstance(reservation, Reservation)
        lim.settle(reservation, 0, device_s=1.0)
    refusal = lim.admit(tenant, 0)
    assert isinstance(refusal, Refusal) and refusal.limit == "credits" and refusal.is_final
    assert refusal.retry_after_s == pytest.approx(3600 - 1000)
    clock.set(3600.0)
    assert isinstance(lim.admit(tenant, 0), Reservation)


def test_reload_keeps_what_was_used_whether_or_not_a_limit_changed(limiter):
    clock = VirtualClock()
    lim, tenant = limiter(clock, requests_per_min=2)
    lim.admit(tenant, 0)
    lim.admit(tenant, 0)
    lim.configure([tenant])
    assert isinstance(lim.admit(tenant, 0), Refusal)  # same limits: same (empty) bucket
    changed = Tenant(name="t", requests_per_min=5)
    lim.configure([changed])
    admitted = [lim.admit(changed, 0) for _ in range(4)]
    # 2 of the 5 were used before the reload: 3 more now, not a fresh bucket of 5
    assert [isinstance(a, Reservation) for a in admitted] == [True, True, True, False]
    lowered = Tenant(name="t", requests_per_min=1)
    lim.configure([lowered])
    refusal = lim.admit(lowered, 0)  # 5 used against a limit of 1: 4 of debt + 1 at 1 per minute
    assert isinstance(refusal, Refusal) and refusal.retry_after_s == pytest.approx(300.0)


def test_a_tenant_taken_out_by_a_reload_and_put_back_gets_no_fresh_limits(limiter):
    clock = VirtualClock()
    lim, tenant = limiter(clock, requests_per_min=2, max_concurrent=2)
    held = lim.admit(tenant, 0)
    lim.admit(tenant, 0)
    other = Tenant(name="other")
    lim.configure([other])
    lim.settle(held, 0, device_s=0.0)  # a request in flight across the reload ends meanwhile
    lim.configure([other, tenant])
    refusal = lim.admit(tenant, 0)
    assert isinstance(refusal, Refusal) and refusal.limit == "requests", "its bucket was not refilled"
    clock.advance(30.0)  # one request's worth refills
    assert isinstance(lim.admit(tenant, 0), Reservation)
    refusal = lim.admit(tenant, 0)
    assert isinstance(refusal, Refusal)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.integers(1, 300), st.booleans()), min_size=1, max_size=60))
def test_tokens_admitted_never_exceed_the_bucket_plus_refill(events: list[tuple[float, int, bool]]):
    """Whatever the arrival pattern, admitted estimates within any run stay within capacity + refill
    (the one allowed overshoot is a single request larger than the whole bucket)."""
    clock = VirtualClock()
    tenant = Tenant(name="t", tokens_per_min=600)
    lim = TenantLimiter(clock)
    lim.configure([tenant])
    admitted = 0.0
    for gap_s, tokens, settle_now in events:
        clock.advance(gap_s)
        outcome = lim.admit(tenant, tokens)
        if isinstance(outcome, Reservation):
            admitted += tokens
            if settle_now:
                lim.settle(outcome, tokens, 0.0)  # used exactly what it reserved
    assert admitted <= 600 + clock.now() * 10 + 1e-6


def test_durations_read_like_openais():
    assert format_duration(0.017) == "17ms"
    assert format_duration(1.0) == "1s"
    assert format_duration(1.25) == "1.3s"
    assert format_duration(360) == "6m0s"
    assert format_duration(3723) == "1h2m3s"
