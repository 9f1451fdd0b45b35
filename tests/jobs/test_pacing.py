"""TenantPacer: how fast a tenant's batch items may start, from its limits' refusals (a virtual clock)."""

from __future__ import annotations

import pytest

from sluice.jobs.pacing import Refusal, TenantPacer

RATE = Refusal(retry_after_s=2.0, is_concurrency=False)
CONCURRENCY = Refusal(retry_after_s=1.0, is_concurrency=True)


def _start(pacer: TenantPacer, owner: str, count: int) -> None:
    for _ in range(count):
        pacer.started(owner)


def test_unrefused_tenants_are_not_bounded():
    pacer = TenantPacer()
    _start(pacer, "acme", 500)
    assert pacer.room(0.0) == {}
    for _ in range(500):
        pacer.answered("acme")
    assert pacer.room(0.0) == {}


def test_a_rate_refusal_pauses_the_tenant_until_its_retry_after_then_allows_what_ran():
    pacer = TenantPacer()
    _start(pacer, "acme", 100)
    _start(pacer, "zeta", 3)
    for _ in range(70):  # the limiter let 30 through: they are still running when the refusals come back
        pacer.refused("acme", RATE, now=10.0)
    assert pacer.room(10.0) == {"acme": 0}  # paused; other tenants untouched
    assert pacer.room(11.9) == {"acme": 0}
    for _ in range(30):
        pacer.answered("acme")
    assert pacer.room(12.0) == {"acme": 30}  # what the limiter let run, not the 100 that were sent


def test_a_concurrency_refusal_shrinks_the_window_without_pausing():
    pacer = TenantPacer()
    _start(pacer, "acme", 10)
    for _ in range(8):  # a cap of 2: eight of ten refused
        pacer.refused("acme", CONCURRENCY, now=5.0)
    assert pacer.room(5.0) == {"acme": 0}  # two in flight, window 2
    pacer.answered("acme")
    assert pacer.room(5.0) == {"acme": 1}


def test_the_window_grows_by_one_per_window_of_answers():
    pacer = TenantPacer()
    _start(pacer, "acme", 5)
    for _ in range(3):
        pacer.refused("acme", CONCURRENCY, now=0.0)
    assert pacer.room(0.0) == {"acme": 0}  # window 2, two in flight
    for _ in range(2):
        pacer.answered("acme")
    assert pacer.room(0.0) == {"acme": 2}  # 2 + 1/2 + 1/2.5: still under 3
    _start(pacer, "acme", 2)
    for _ in range(2):
        pacer.answered("acme")
    assert pacer.room(0.0) == {"acme": 3}


def test_a_budget_pause_is_kept_however_long_and_the_pace_is_forgotten_after_calm():
    pacer = TenantPacer(forget_after_s=60.0)
    _start(pacer, "acme", 2)
    pacer.refused("acme", Refusal(retry_after_s=3600.0, is_concurrency=False), now=0.0)
    pacer.answered("acme")
    assert pacer.room(120.0) == {"acme": 0}  # still paused: the budget resets in an hour
    assert pacer.room(3599.0) == {"acme": 0}
    assert pacer.room(3600.0) == {}  # reset, and no refusal for an hour: unpaced again


def test_stopped_items_free_their_place():
    pacer = TenantPacer()
    _start(pacer, "acme", 3)
    pacer.refused("acme", CONCURRENCY, now=0.0)
    assert pacer.room(0.0) == {"acme": 0}
    pacer.abandoned("acme")
    pacer.abandoned("acme")
    assert pacer.room(0.0) == {"acme": 2}


def test_forget_after_must_be_positive():
    with pytest.raises(ValueError):
        TenantPacer(forget_after_s=0)
