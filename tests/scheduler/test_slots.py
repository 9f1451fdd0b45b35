"""SlotQueue: at most max_running calls run; the rest wait by class, oldest first; expired
waiters never start; the predicted wait per class counts only the calls ahead."""

from __future__ import annotations

import pytest

from sluice.priority import Priority
from sluice.scheduler.slots import SlotQueue


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


def test_higher_classes_start_first_and_each_class_is_fifo():
    slots = SlotQueue(max_running=1, max_waiting=10)
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
    assert decision.started == (3,)
    slots.release(3)
    assert slots.start_next(now=30.0).expired == (4,)
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
