"""The circuit breaker's state machine, driven by a virtual clock."""

from __future__ import annotations

import pytest

from sluice.circuit import CircuitBreaker, CircuitConfig, CircuitState
from sluice.clock import VirtualClock


def _breaker(threshold: int = 3, open_s: float = 10.0) -> tuple[CircuitBreaker, VirtualClock]:
    clock = VirtualClock()
    return CircuitBreaker(CircuitConfig(failure_threshold=threshold, open_s=open_s), clock), clock


def _fail(breaker: CircuitBreaker, times: int) -> None:
    for _ in range(times):
        assert breaker.allow()
        breaker.record_failure()


def test_closed_allows_calls_and_opens_after_consecutive_failures():
    breaker, _ = _breaker(threshold=3)
    _fail(breaker, 2)
    assert breaker.state is CircuitState.CLOSED
    _fail(breaker, 1)
    assert breaker.state is CircuitState.OPEN
    assert not breaker.allow()


def test_a_success_resets_the_failure_count():
    breaker, _ = _breaker(threshold=3)
    _fail(breaker, 2)
    assert breaker.allow()
    breaker.record_success()
    _fail(breaker, 2)
    assert breaker.state is CircuitState.CLOSED


def test_open_refuses_until_open_s_then_lets_exactly_one_trial_through():
    breaker, clock = _breaker(threshold=1, open_s=10.0)
    _fail(breaker, 1)
    clock.advance(9.0)
    assert not breaker.allow()
    assert breaker.retry_after_s() == pytest.approx(1.0)
    clock.advance(1.0)
    assert breaker.state is CircuitState.HALF_OPEN
    assert breaker.retry_after_s() == 0.0
    assert breaker.allow(), "the trial call"
    assert not breaker.allow(), "only one trial at a time"
    assert breaker.state is CircuitState.HALF_OPEN


def test_a_successful_trial_closes_the_circuit():
    breaker, clock = _breaker(threshold=2, open_s=5.0)
    _fail(breaker, 2)
    clock.advance(5.0)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is CircuitState.CLOSED
    assert all(breaker.allow() for _ in range(10))
    _fail(breaker, 1)
    assert breaker.state is CircuitState.CLOSED, "the count started again from zero"


def test_a_failed_trial_opens_the_circuit_for_another_open_s():
    breaker, clock = _breaker(threshold=2, open_s=5.0)
    _fail(breaker, 2)
    clock.advance(7.0)
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state is CircuitState.OPEN
    clock.advance(4.9)
    assert not breaker.allow()
    clock.advance(0.1)
    assert breaker.allow()


def test_failures_of_calls_granted_before_opening_do_not_extend_the_open_period():
    breaker, clock = _breaker(threshold=2, open_s=5.0)
    assert breaker.allow() and breaker.allow() and breaker.allow()  # three calls in flight
    breaker.record_failure()
    breaker.record_failure()
    clock.advance(3.0)
    breaker.record_failure()  # the third straggles in while open
    clock.advance(2.0)
    assert breaker.allow()


@pytest.mark.parametrize("threshold, open_s", [(0, 1.0), (1, 0.0), (1, -1.0)])
def test_bad_config_is_refused(threshold, open_s):
    with pytest.raises(ValueError):
        CircuitConfig(failure_threshold=threshold, open_s=open_s)
