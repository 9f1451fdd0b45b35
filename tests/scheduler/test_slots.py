"""SlotQueue: at most max_running calls run; the rest wait by class (with minimum shares for lower
classes), tenant (weighted fair shares of slot time) and deadline; expired waiters never start;
the predicted wait per class counts only the calls ahead."""

from __future__ import annotations

import itertools

import pytest

from sluice.priority import Priority
from sluice.scheduler.slots import SlotDecision, SlotQueue


def test_never_more_than_max_running_and_freed_slots_are_refilled():
    slots = SlotQueue(max_running=2, max_waiting=10)
    for call_id in range(5):
        assert slots.offer(call_id, Priority.STANDARD, deadline=100.0)
    assert slots.start_next(now=0.0).started == (0, 1)
    assert slots.start_next(now=0.0).started == ()
    assert (slots.num_running, slots.num_waiting) == (2, 3)
    assert slots.release(0)
    assert slots.start_next(now=1.0).started == (2,)
    assert slots.num_running == 2


def test_without_minimum_shares_higher_classes_start_first_and_each_class_is_fifo():
    slots = SlotQueue(max_running=1, max_waiting=10, min_class_shares={})
    slots.offer(1, Priority.STANDARD, 100.0)
    assert slots.start_next(0.0).started == (1,)
    slots.offer(2, Priority.BATCH, 100.0)
    slots.offer(3, Priority.STANDARD, 100.0)
    slots.offer(4, Priority.INTERACTIVE, 100.0)
    slots.offer(5, Priority.STANDARD, 100.0)
    order = []
    running = 1
    for _ in range(4):
        slots.release(running)
        (running,) = slots.start_next(0.0).started
        order.append(running)
    assert order == [4, 3, 5, 2]


def test_expired_waiters_are_returned_and_never_started():
    slots = SlotQueue(max_running=1, max_waiting=10)
    slots.offer(1, Priority.STANDARD, 100.0)
    slots.start_next(0.0)
    slots.offer(2, Priority.STANDARD, 5.0)
    slots.offer(3, Priority.STANDARD, 50.0)
    assert slots.expire(now=10.0) == (2,)
    slots.offer(4, Priority.STANDARD, 20.0)
    slots.release(1)
    decision = slots.start_next(now=30.0)
    assert decision.started == (3,) and decision.expired == (4,)
    slots.release(3)
    assert slots.start_next(now=30.0) == SlotDecision((), ())
    assert slots.is_idle


def test_a_full_queue_refuses_and_a_withdrawn_waiter_leaves_its_place():
    slots = SlotQueue(max_running=1, max_waiting=1)
    assert slots.offer(1, Priority.STANDARD, 10.0)
    slots.start_next(0.0)
    assert slots.offer(2, Priority.STANDARD, 10.0)
    assert not slots.offer(3, Priority.STANDARD, 10.0)
    assert slots.release(2) and not slots.release(2)
    assert slots.offer(3, Priority.STANDARD, 10.0)
    with pytest.raises(ValueError):
        slots.offer(3, Priority.STANDARD, 10.0)


def test_predicted_waits_count_only_the_calls_ahead_of_each_class():
    slots = SlotQueue(max_running=2, max_waiting=10)
    assert slots.waits_s(call_s=1.0) == [0.0, 0.0, 0.0]
    for call_id in range(2):
        slots.offer(call_id, Priority.STANDARD, 100.0)
    slots.start_next(0.0)
    assert slots.waits_s(1.0) == [0.5, 0.5, 0.5]  # both slots busy: the first to free, on average
    slots.offer(2, Priority.STANDARD, 100.0)
    slots.offer(3, Priority.BATCH, 100.0)
    interactive, standard, batch = slots.waits_s(1.0)
    assert interactive == 0.5 and standard == 1.0 and batch == 1.5


def _serve(slots: SlotQueue, now: float, num_calls: int, call_s: float = 1.0,
           refill=lambda started: None) -> list[int]:
    """Run `num_calls` calls through the slots, each holding its slot `call_s`, one slot freeing
    at a time; `refill(call_id)` may offer more calls as each one starts. Returns the start order."""
    order: list[int] = []
    running: list[tuple[float, int]] = []
    while len(order) < num_calls:
        for call_id in slots.start_next(now, call_s).started:
            order.append(call_id)
            running.append((now + call_s, call_id))
            refill(call_id)
        running.sort()
        now, call_id = running.pop(0)
        slots.release(call_id, now)
    return order


def test_backlogged_tenants_get_slot_time_by_weight():
    slots = SlotQueue(max_running=2, max_waiting=1000)
    slots.set_tenant_weights({"light": 1.0, "heavy": 3.0})
    tenant_of = {}
    for i in range(400):
        tenant_of[i] = "light" if i % 2 else "heavy"
        slots.offer(i, Priority.STANDARD, 1e9, tenant_of[i])
    order = _serve(slots, 0.0, 200)
    num_light = sum(tenant_of[call_id] == "light" for call_id in order)
    assert 45 <= num_light <= 55  # 1:3 of 200 calls is 50


def test_a_flooding_tenant_does_not_hold_back_another_tenants_call():
    slots = SlotQueue(max_running=2, max_waiting=1000)
    for i in range(100):
        slots.offer(i, Priority.STANDARD, 50.0 + i, "flood")
    slots.start_next(0.0)
    slots.offer(1000, Priority.STANDARD, 500.0, "quiet")  # a later deadline than every flood call
    slots.release(0, 1.0)
    assert slots.start_next(1.0).started == (1000,)


def test_earliest_deadline_first_within_a_tenant():
    slots = SlotQueue(max_running=1, max_waiting=10)
    for call_id, deadline in [(1, 100.0), (2, 90.0), (3, 30.0), (4, 60.0)]:
        slots.offer(call_id, Priority.STANDARD, deadline, "a")
    slots.offer(5, Priority.STANDARD, 10.0, "b")
    order = _serve(slots, 0.0, 5)
    assert [call_id for call_id in order if call_id != 5] == [3, 4, 2, 1]


def test_a_batch_call_starts_within_its_bound_under_an_interactive_flood():
    slots = SlotQueue(max_running=2, max_waiting=1000)  # batch's minimum share: 5% of slot time
    next_id = itertools.count(100)
    for _ in range(4):
        slots.offer(next(next_id), Priority.INTERACTIVE, 1e9, "i")
    slots.offer(1, Priority.BATCH, 1e9, "b")
    slots.offer(2, Priority.BATCH, 1e9, "b")

    def keep_flooding(started: int) -> None:
        slots.offer(next(next_id), Priority.INTERACTIVE, 1e9, "i")

    order = _serve(slots, 0.0, 200, refill=keep_flooding)
    # owed after one interactive call has run; then once per 1 / 0.05 calls' slot time, no sooner
    assert order.index(1) <= 3
    assert 1 / 0.05 - 2 <= order.index(2) - order.index(1) <= 1 / 0.05 + 2


def test_an_idle_tenant_banks_no_credit():
    slots = SlotQueue(max_running=1, max_waiting=1000)
    tenant_of = {}
    for i in range(200):
        tenant_of[i] = "busy"
        slots.offer(i, Priority.STANDARD, 1e9, "busy")
    _serve(slots, 0.0, 100)  # "late" was idle all along: a tag far below busy's, were it banked
    for i in range(1000, 1050):
        tenant_of[i] = "late"
        slots.offer(i, Priority.STANDARD, 1e9, "late")
    order = _serve(slots, 200.0, 20)
    assert 8 <= sum(tenant_of[call_id] == "late" for call_id in order) <= 12
