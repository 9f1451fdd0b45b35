"""The scheduler's batch formation, deadlines and admission, step by step on a virtual clock.

Every test builds a `Scheduler` over a `VirtualClock` and plays the worker's part by hand:
`admit`, then `next_batch` when the device is free, then `batch_done` after moving the clock.
"""

from __future__ import annotations

import itertools
import math

import pytest

from sluice.clock import VirtualClock
from sluice.priority import Priority
from sluice.repository import BatchingConfig
from sluice.scheduler import Admitted, Batch, LatencyProfile, Rejected, RejectReason, Scheduler
from tests.scheduler.support import run, run_late

ALPHA_S = 0.002
BETA_S = 0.00001  # 10 us per unit of padded cost: 32 items x 128 = 4096 -> 43 ms
M1 = ("m", "1")
M2 = ("m", "2")
OTHER = ("other", "1")


def make_scheduler(
    *keys: tuple[str, str],
    max_batch_size: int = 32,
    max_batch_cost: int = 8192,
    max_queue_items: int = 4096,
    alpha_s: float = ALPHA_S,
    beta_s: float = BETA_S,
) -> tuple[Scheduler, VirtualClock]:
    clock = VirtualClock(100.0)
    scheduler = Scheduler(clock)
    for key in keys or (M1,):
        limits = BatchingConfig(max_batch_size=max_batch_size, max_batch_cost=max_batch_cost,
                                max_queue_items=max_queue_items)
        scheduler.add_model(key, limits, LatencyProfile(alpha_s, beta_s, 64))
    return scheduler, clock


def admit(scheduler: Scheduler, clock: VirtualClock, request_id: int, costs: list[int], timeout_s: float,
          key: tuple[str, str] = M1) -> Admitted:
    outcome = scheduler.admit(key, request_id, costs, clock.now() + timeout_s)
    assert isinstance(outcome, Admitted), outcome
    return outcome



def drain(scheduler: Scheduler, clock: VirtualClock) -> list[Batch]:
    batches = []
    while (batch := run(scheduler, clock)) is not None:
        batches.append(batch)
    return batches


def ids(batch: Batch | None) -> list[tuple[int, int]]:
    assert batch is not None
    return [(item.request_id, item.index) for item in batch.items]


# -- batch formation ---------------------------------------------------------------------------


def test_a_lone_request_on_an_idle_device_starts_at_once():
    scheduler, clock = make_scheduler()
    admit(scheduler, clock, 1, [10], timeout_s=1.0)
    decision = scheduler.next_batch()
    assert decision.batch is not None
    assert ids(decision.batch) == [(1, 0)]
    assert decision.batch.padded_cost == 10
    assert decision.batch.predicted_s == pytest.approx(ALPHA_S + BETA_S * 10)
    assert not scheduler.is_idle


def test_an_empty_scheduler_gives_no_batch():
    scheduler, _ = make_scheduler()
    assert scheduler.next_batch().batch is None
    assert scheduler.is_idle


def test_batches_hold_at_most_max_batch_size_items():
    scheduler, clock = make_scheduler(max_batch_size=4)
    admit(scheduler, clock, 1, [10] * 10, timeout_s=5.0)
    assert [len(b.items) for b in drain(scheduler, clock)] == [4, 4, 2]


def test_batches_respect_max_batch_cost_counted_with_padding():
    scheduler, clock = make_scheduler(max_batch_cost=350)
    admit(scheduler, clock, 1, [100, 70, 70, 70], timeout_s=5.0)  # one length bucket: 64..127
    batches = drain(scheduler, clock)
    assert [len(b.items) for b in batches] == [3, 1]
    assert batches[0].padded_cost == 300  # 3 x longest (100)
    assert all(b.padded_cost <= 350 for b in batches)
    assert all(b.padded_cost == len(b.items) * max(i.cost for i in b.items) for b in batches)


def test_an_item_larger_than_max_batch_cost_runs_alone():
    scheduler, clock = make_scheduler(max_batch_cost=100)
    admit(scheduler, clock, 1, [120, 120], timeout_s=5.0)
    batches = drain(scheduler, clock)
    assert [len(b.items) for b in batches] == [1, 1]


def test_items_run_earliest_deadline_first_within_a_queue():
    scheduler, clock = make_scheduler(max_batch_size=1)
    for request_id, timeout_s in [(1, 0.9), (2, 0.3), (3, 0.6), (4, 0.1), (5, 0.5)]:
        admit(scheduler, clock, request_id, [10], timeout_s)
    order = [b.items[0].request_id for b in drain(scheduler, clock)]
    assert order == [4, 2, 5, 3, 1]


def test_a_batch_takes_the_earliest_deadlines_of_its_bucket():
    scheduler, clock = make_scheduler(max_batch_size=2)
    admit(scheduler, clock, 1, [10], 0.9)
    admit(scheduler, clock, 2, [10], 0.2)
    admit(scheduler, clock, 3, [10], 0.5)
    assert sorted(i.request_id for i in run(scheduler, clock).items) == [2, 3]


def test_items_of_very_different_lengths_never_share_a_batch():
    scheduler, clock = make_scheduler()
    admit(scheduler, clock, 1, [10, 100, 12, 120, 15, 1000], timeout_s=5.0)
    batches = drain(scheduler, clock)
    assert sorted(sorted(i.cost for i in b.items) for b in batches) == [[10, 12, 15], [100, 120], [1000]]
    for batch in batches:
        costs = [item.cost for item in batch.items]
        assert max(costs) < 2 * min(costs), "padding wastes under half of a batch"


def test_model_versions_are_never_mixed():
    scheduler, clock = make_scheduler(M1, M2)
    for request_id in range(6):
        admit(scheduler, clock, request_id, [10], 1.0 + request_id / 100, key=(M1, M2)[request_id % 2])
    batches = drain(scheduler, clock)
    assert [b.model for b in batches] == [M1, M2]
    for batch in batches:
        expected = {r for r in range(6) if (M1, M2)[r % 2] == batch.model}
        assert {item.request_id for item in batch.items} == expected


def test_the_queue_with_the_earliest_head_deadline_goes_first():
    scheduler, clock = make_scheduler(M1, OTHER)
    admit(scheduler, clock, 1, [10], timeout_s=1.0, key=M1)
    admit(scheduler, clock, 2, [10], timeout_s=0.5, key=OTHER)
    admit(scheduler, clock, 3, [10], timeout_s=2.0, key=OTHER)
    assert [b.model for b in drain(scheduler, clock)] == [OTHER, M1]


def test_next_batch_while_a_batch_runs_is_a_bug():
    scheduler, clock = make_scheduler()
    admit(scheduler, clock, 1, [10, 10], timeout_s=1.0)
    scheduler.next_batch()
    with pytest.raises(RuntimeError):
        scheduler.next_batch()


def test_batch_done_for_a_batch_that_is_not_running_is_a_bug():
    scheduler, clock = make_scheduler()
    admit(scheduler, clock, 1, [10], timeout_s=1.0)
    batch = run(scheduler, clock)
    assert batch is not None
    with pytest.raises(RuntimeError):
        scheduler.batch_done(batch, 0.01)


# -- deadlines ---------------------------------------------------------------------------------


def test_an_item_past_its_deadline_is_expired_not_run():
    scheduler, clock = make_scheduler()
    admit(scheduler, clock, 1, [10], timeout_s=0.5)
    clock.advance(1.0)
    decision = scheduler.next_batch()
    assert decision.batch is None
    assert [(i.request_id, i.index) for i in decision.expired] == [(1, 0)]
    assert scheduler.num_queued() == 0
    assert scheduler.work_ahead_s() == 0.0


def test_an_item_that_cannot_finish_in_time_is_expired_before_it_runs():
    scheduler, clock = make_scheduler(M1, OTHER)
    admit(scheduler, clock, 1, [10], timeout_s=1.0, key=OTHER)
    predicted_s = ALPHA_S + BETA_S * 100
    admit(scheduler, clock, 2, [100], timeout_s=1.0 + predicted_s / 2)  # later deadline: waits behind 1
    first = scheduler.next_batch().batch
    assert first is not None and first.model == OTHER
    clock.advance(1.0)  # the device was far slower than predicted
    scheduler.batch_done(first, 1.0)
    # the deadline has not passed yet, but the item's own execution time would overrun it
    assert clock.now() < 100.0 + 1.0 + predicted_s / 2
    decision = scheduler.next_batch()
    assert decision.batch is None
    assert [i.request_id for i in decision.expired] == [2]


def test_siblings_of_an_expired_item_are_reported_expired_and_leave_the_queue():
    scheduler, clock = make_scheduler(M1, OTHER, max_batch_cost=100_000)
    admit(scheduler, clock, 1, [5], timeout_s=1.0, key=OTHER)
    admit(scheduler, clock, 2, [10, 2000, 3000], timeout_s=1.2)
    first = scheduler.next_batch().batch
    assert first is not None and first.model == OTHER
    clock.advance(1.18)  # now the 10 item could still run, but the 2000 and 3000 ones cannot
    scheduler.batch_done(first, 1.18)
    decision = scheduler.next_batch()
    assert decision.batch is None, "no item of a request that is answered 504 reaches the device"
    assert sorted((i.request_id, i.index) for i in decision.expired) == [(2, 0), (2, 1), (2, 2)]
    assert scheduler.num_queued() == 0
    assert scheduler.work_ahead_s() == 0.0


def test_a_batch_never_grows_past_its_earliest_members_deadline():
    scheduler, clock = make_scheduler(max_batch_cost=100_000)
    one_s = ALPHA_S + BETA_S * 100  # one item alone: 3 ms
    admit(scheduler, clock, 1, [100], timeout_s=1.0)
    clock.advance(0.01)
    admit(scheduler, clock, 2, [100] * 20, timeout_s=10.0)  # admitted behind the first
    clock.advance(1.0 - 0.01 - 2.5 * one_s)  # request 1 has 7.5 ms left: a batch of 5 takes 7 ms
    batch = scheduler.next_batch().batch
    assert batch is not None
    assert batch.items[0].request_id == 1
    assert clock.now() + batch.predicted_s <= min(item.deadline for item in batch.items)
    assert len(batch.items) == 5  # not the 21 the size and cost limits would allow


def test_next_batch_never_returns_an_unmeetable_item():
    scheduler, clock = make_scheduler()
    for request_id in range(50):
        admit(scheduler, clock, request_id, [10 + request_id], timeout_s=0.05 + request_id * 0.002)
    clock.advance(0.06)
    while True:
        decision = scheduler.next_batch()
        if decision.batch is None:
            break
        now = clock.now()
        assert all(now + decision.batch.predicted_s <= item.deadline for item in decision.batch.items)
        clock.advance(decision.batch.predicted_s)
        scheduler.batch_done(decision.batch, decision.batch.predicted_s)


# -- admission ---------------------------------------------------------------------------------


def test_a_request_that_cannot_finish_even_alone_is_unreachable():
    scheduler, clock = make_scheduler()
    outcome = scheduler.admit(M1, 1, [1000], clock.now() + 0.005)  # alone it takes 12 ms
    assert outcome == Rejected(RejectReason.DEADLINE_UNREACHABLE, 0.0)
    assert scheduler.num_queued() == 0


def test_a_lone_request_with_a_tight_deadline_is_admitted_on_an_idle_device():
    scheduler, clock = make_scheduler()
    own_s = ALPHA_S + BETA_S * 100
    admit(scheduler, clock, 1, [100], timeout_s=own_s * 1.001)
    batch = scheduler.next_batch().batch
    assert batch is not None and batch.predicted_s == pytest.approx(own_s)


def test_an_idle_device_admits_a_tight_deadline_whatever_other_tenants_sent_lately():
    """Nothing runs and nothing is queued: the request starts at once, so other tenants' recent
    demand (which could take the device ahead of queued work) cannot make it late."""
    scheduler, clock = make_scheduler()
    for request_id in range(200):  # tenant "a" keeps the device ~80% busy, then pauses
        assert isinstance(scheduler.admit(M1, request_id, [100], clock.now() + 1.0, tenant="a"), Admitted)
        batch = run(scheduler, clock)
        assert batch is not None
        clock.advance(batch.predicted_s / 4)
    own_s = ALPHA_S + BETA_S * 100
    outcome = scheduler.admit(M1, 999, [100], clock.now() + own_s * 1.05, tenant="b")
    assert isinstance(outcome, Admitted)
    batch = scheduler.next_batch().batch
    assert batch is not None and ids(batch) == [(999, 0)]
    assert clock.now() + batch.predicted_s <= outcome.items[0].deadline


def test_a_deadline_already_passed_is_unreachable():
    scheduler, clock = make_scheduler()
    outcome = scheduler.admit(M1, 1, [10], clock.now() - 1.0)
    assert isinstance(outcome, Rejected) and outcome.reason is RejectReason.DEADLINE_UNREACHABLE


def test_overload_is_rejected_at_once_with_a_retry_after_that_works():
    scheduler, clock = make_scheduler(max_batch_size=4)
    for request_id in range(50):
        admit(scheduler, clock, request_id, [100, 100, 100, 100], timeout_s=10.0)
    work_s = scheduler.work_ahead_s()
    assert work_s == pytest.approx(50 * (ALPHA_S + BETA_S * 400))
    outcome = scheduler.admit(M1, 999, [100], clock.now() + 0.1)
    assert isinstance(outcome, Rejected) and outcome.reason is RejectReason.OVERLOADED
    own_s = ALPHA_S + BETA_S * 100
    assert outcome.retry_after_s == pytest.approx(work_s + own_s - 0.1, rel=0.05)
    # a client that waits that long, while the device drains, gets in
    waited_s = 0.0
    while waited_s < outcome.retry_after_s:
        batch = run(scheduler, clock)
        assert batch is not None
        waited_s += batch.predicted_s
    assert isinstance(scheduler.admit(M1, 999, [100], clock.now() + 0.1), Admitted)


def test_admission_counts_the_running_batchs_remaining_time():
    scheduler, clock = make_scheduler(max_batch_cost=1 << 20)
    admit(scheduler, clock, 1, [8000], timeout_s=1.0)  # 82 ms
    batch = scheduler.next_batch().batch
    assert batch is not None
    clock.advance(0.02)
    assert scheduler.work_ahead_s() == pytest.approx(batch.predicted_s - 0.02)
    outcome = scheduler.admit(M1, 2, [10], clock.now() + 0.03)
    assert isinstance(outcome, Rejected) and outcome.reason is RejectReason.OVERLOADED


def test_admitted_work_stays_within_the_deadline_bound():
    scheduler, clock = make_scheduler()
    num_admitted = 0
    for request_id in range(2000):
        deadline = clock.now() + 0.2
        outcome = scheduler.admit(M1, request_id, [50, 60], deadline)
        if isinstance(outcome, Admitted):
            num_admitted += 1
            assert clock.now() + scheduler.work_ahead_s() <= deadline + 1e-9
        else:
            assert outcome.reason is RejectReason.OVERLOADED
            assert outcome.retry_after_s > 0
    assert 0 < num_admitted < 2000


def test_max_queue_items_caps_the_queue():
    scheduler, clock = make_scheduler(max_queue_items=10)
    admit(scheduler, clock, 1, [10] * 8, timeout_s=10.0)
    outcome = scheduler.admit(M1, 2, [10] * 3, clock.now() + 10.0)
    assert isinstance(outcome, Rejected) and outcome.reason is RejectReason.QUEUE_FULL
    assert 0 < outcome.retry_after_s <= scheduler.work_ahead_s()
    admit(scheduler, clock, 3, [10] * 2, timeout_s=10.0)
    assert scheduler.num_queued() == 10
    assert scheduler.queue_state(M1)[0] == 10


def test_an_empty_request_is_admitted_with_no_items():
    scheduler, clock = make_scheduler()
    assert scheduler.admit(M1, 1, [], clock.now() + 1.0) == Admitted(())
    assert scheduler.num_queued() == 0


def test_admitting_a_request_id_twice_is_a_bug():
    scheduler, clock = make_scheduler()
    admit(scheduler, clock, 1, [10], timeout_s=1.0)
    with pytest.raises(ValueError):
        scheduler.admit(M1, 1, [10], clock.now() + 1.0)


def test_a_negative_cost_is_a_bug():
    scheduler, clock = make_scheduler()
    with pytest.raises(ValueError):
        scheduler.admit(M1, 1, [10, -1], clock.now() + 1.0)


def test_adding_a_model_twice_is_a_bug():
    scheduler, _ = make_scheduler(M1)
    with pytest.raises(ValueError):
        scheduler.add_model(M1, BatchingConfig(), LatencyProfile(ALPHA_S, BETA_S, 64))


def test_a_nan_deadline_is_refused():
    scheduler, _ = make_scheduler()
    outcome = scheduler.admit(M1, 1, [10], math.nan)
    assert isinstance(outcome, Rejected) and outcome.reason is RejectReason.DEADLINE_UNREACHABLE


# -- cancel and accounting ---------------------------------------------------------------------


def test_cancel_removes_queued_items_and_their_work():
    scheduler, clock = make_scheduler()
    admit(scheduler, clock, 1, [10, 10, 10], timeout_s=1.0)
    work_one_s = scheduler.work_ahead_s()
    admit(scheduler, clock, 2, [500, 500], timeout_s=1.0)
    assert scheduler.num_queued() == 5
    assert scheduler.cancel(2) == 2
    assert scheduler.num_queued() == 3
    assert scheduler.work_ahead_s() == pytest.approx(work_one_s)
    assert scheduler.cancel(2) == 0
    assert scheduler.cancel(12345) == 0
    batches = drain(scheduler, clock)
    assert [ids(b) for b in batches] == [[(1, 0), (1, 1), (1, 2)]]


def test_cancel_removes_a_requests_items_from_every_length_bucket():
    scheduler, clock = make_scheduler()
    admit(scheduler, clock, 1, [5, 50, 500, 5000], timeout_s=1.0)
    admit(scheduler, clock, 2, [6], timeout_s=2.0)
    assert scheduler.cancel(1) == 4
    assert scheduler.num_queued() == 1
    assert scheduler.work_ahead_s() == pytest.approx(ALPHA_S + BETA_S * 6)
    assert [ids(b) for b in drain(scheduler, clock)] == [[(2, 0)]]


def test_cancelling_everything_empties_the_scheduler():
    scheduler, clock = make_scheduler()
    for request_id in range(100):
        admit(scheduler, clock, request_id, [10 + request_id], timeout_s=1.0)
    for request_id in range(100):
        assert scheduler.cancel(request_id) == 1
    assert scheduler.num_queued() == 0
    assert scheduler.work_ahead_s() == 0.0
    decision = scheduler.next_batch()
    assert decision.batch is None and decision.expired == ()
    assert scheduler.is_idle


def test_cancel_of_a_running_request_leaves_the_batch_alone():
    scheduler, clock = make_scheduler(max_batch_size=2)
    admit(scheduler, clock, 1, [10, 10, 10], timeout_s=1.0)
    batch = scheduler.next_batch().batch
    assert batch is not None and len(batch.items) == 2
    assert scheduler.cancel(1) == 1  # only the item still queued
    clock.advance(batch.predicted_s)
    scheduler.batch_done(batch, batch.predicted_s)
    assert scheduler.next_batch().batch is None
    assert scheduler.work_ahead_s() == 0.0


def test_work_ahead_predicts_the_time_to_drain_the_queue():
    scheduler, clock = make_scheduler(max_batch_size=32, max_batch_cost=1000)
    admit(scheduler, clock, 1, [400] * 10, timeout_s=10.0)  # two per batch by cost, not 32
    predicted_s = scheduler.work_ahead_s()
    batches = drain(scheduler, clock)
    assert len(batches) == 5
    assert predicted_s == pytest.approx(sum(b.predicted_s for b in batches))


def test_work_ahead_counts_padding():
    scheduler, clock = make_scheduler(max_batch_size=4)
    admit(scheduler, clock, 1, [65, 127, 65, 65], timeout_s=10.0)
    predicted_s = scheduler.work_ahead_s()
    batches = drain(scheduler, clock)
    assert predicted_s >= sum(b.predicted_s for b in batches) - 1e-12


def test_work_ahead_returns_to_zero_when_the_queues_drain():
    scheduler, clock = make_scheduler(M1, M2, max_batch_size=8)
    for request_id in range(40):
        key = (M1, M2)[request_id % 2]
        admit(scheduler, clock, request_id, [5 + (7 * request_id) % 300, 9], timeout_s=5.0, key=key)
    assert scheduler.work_ahead_s() > 0
    drain(scheduler, clock)
    assert scheduler.work_ahead_s() == 0.0
    assert scheduler.num_queued() == 0
    assert scheduler.queue_state(M1) == (0, 0.0)
    assert scheduler.queue_state(M2) == (0, 0.0)


def test_cancel_churn_does_not_grow_the_queue():
    scheduler, clock = make_scheduler(max_queue_items=100)
    admit(scheduler, clock, 0, [10], timeout_s=1000.0)  # an early head that never leaves
    for request_id in range(1, 20_000):
        admit(scheduler, clock, request_id, [10], timeout_s=2000.0)
        scheduler.cancel(request_id)
    assert scheduler.num_queued() == 1
    # white box: lazily removed entries are compacted away, so memory stays bounded
    queue = scheduler._queues[M1]
    assert queue.num_entries() < 1000


# -- drain rate --------------------------------------------------------------------------------


def test_drain_rate_is_one_when_the_device_keeps_up_and_ignores_idle_time():
    scheduler, clock = make_scheduler()
    for request_id in range(100):
        admit(scheduler, clock, request_id, [10], timeout_s=1.0)
        run(scheduler, clock)
        clock.advance(0.5)  # idle: nothing was waiting
    assert scheduler.drain_rate == pytest.approx(1.0)


def test_drain_rate_falls_when_batches_start_late_while_work_waits():
    scheduler, clock = make_scheduler(max_batch_size=1, max_queue_items=10_000)
    admit(scheduler, clock, 1, [10] * 10_000, timeout_s=100.0)
    run_late(scheduler, clock, 5000)  # each batch starts as long again after the last ended
    assert scheduler.drain_rate == pytest.approx(0.5, abs=0.05)


def test_admission_and_retry_after_allow_for_a_slow_drain():
    scheduler, clock = make_scheduler(max_batch_size=1, max_queue_items=10_000)
    admit(scheduler, clock, 1, [10] * 10_000, timeout_s=100.0)
    run_late(scheduler, clock, 5000)
    work_s = scheduler.work_ahead_s()
    assert work_s == pytest.approx(5000 * (ALPHA_S + BETA_S * 10))
    # the queue drains at half speed: work_s of work takes 2 * work_s of wall time
    own_s = ALPHA_S + BETA_S * 10
    assert isinstance(scheduler.admit(M1, 2, [10], clock.now() + 1.5 * work_s), Rejected)
    outcome = scheduler.admit(M1, 2, [10], clock.now() + 1.0)
    assert isinstance(outcome, Rejected) and outcome.reason is RejectReason.OVERLOADED
    assert outcome.retry_after_s == pytest.approx(work_s / scheduler.drain_rate + own_s - 1.0, rel=0.01)
    assert isinstance(scheduler.admit(M1, 3, [10], clock.now() + 2.2 * work_s), Admitted)



@pytest.mark.parametrize("num_queued", [0, 1, 5, 31, 32, 33, 100])
@pytest.mark.parametrize("is_running", [False, True])
def test_the_reported_wait_plus_a_newcomers_own_batch_is_the_admission_bound(num_queued: int, is_running: bool):
    """The gateway refuses early what the worker would refuse: `wait_report()` plus `newcomer_s`
    is exactly where the worker's admission draws the line, in every queue state."""
    cost = 16

    def state() -> tuple[Scheduler, VirtualClock]:
        scheduler, clock = make_scheduler(alpha_s=0.008, beta_s=0.0005 / 16)
        if is_running:
            admit(scheduler, clock, 1, [cost] * 32, 10.0)
            assert scheduler.next_batch().batch is not None
            clock.advance(0.005)  # part-way through the running batch
        for request_id in range(num_queued):
            admit(scheduler, clock, 100 + request_id, [cost], 10.0)
        return scheduler, clock

    scheduler, clock = state()
    (standard,) = [c for c in scheduler.wait_report().classes if c.priority == Priority.STANDARD]
    tenants = [t for t in scheduler.wait_report().tenants if t.priority == Priority.STANDARD]
    wait_s = tenants[0].wait_s if tenants else standard.newcomer_wait_s
    bound_s = wait_s + scheduler.newcomer_s(M1, cost)
    assert isinstance(scheduler.admit(M1, 999, [cost], clock.now() + bound_s + 1e-6), Admitted)
    scheduler, clock = state()
    refused = scheduler.admit(M1, 999, [cost], clock.now() + bound_s - 1e-4)
    assert isinstance(refused, Rejected) and refused.reason in (RejectReason.OVERLOADED,
                                                                RejectReason.DEADLINE_UNREACHABLE)


def test_a_model_is_removed_only_once_it_holds_no_work():
    scheduler, clock = make_scheduler(M1, M2)
    admit(scheduler, clock, 1, [16], 1.0, key=M2)
    with pytest.raises(ValueError, match="still has work"):
        scheduler.remove_model(M2)  # queued
    batch = scheduler.next_batch().batch
    assert batch is not None and batch.model == M2
    with pytest.raises(ValueError, match="still has work"):
        scheduler.remove_model(M2)  # running
    clock.advance(0.01)
    scheduler.batch_done(batch, 0.01)
    scheduler.remove_model(M2)
    assert scheduler.models() == [M1]
    admit(scheduler, clock, 2, [16], 1.0)  # the others are scheduled as before
    assert ids(scheduler.next_batch().batch) == [(2, 0)]


# -- a fresh model whose warm-up ran slow ------------------------------------------------------


def _fresh_scheduler(profile: LatencyProfile) -> tuple[Scheduler, VirtualClock]:
    clock = VirtualClock(100.0)
    scheduler = Scheduler(clock)
    scheduler.add_model(M1, BatchingConfig(max_batch_size=8), profile)
    return scheduler, clock


def _burst(scheduler: Scheduler, clock: VirtualClock, num_requests: int,
           timeout_s: float) -> tuple[list[bool], Batch | None]:
    """`num_requests` single items 1 ms apart, the first one's batch running meanwhile: whether
    each was admitted, and that batch."""
    admitted, running = [], None
    for request_id in range(num_requests):
        admitted.append(isinstance(scheduler.admit(M1, request_id, [1], clock.now() + timeout_s), Admitted))
        if request_id == 0:
            running = scheduler.next_batch().batch
        clock.advance(0.001)
    return admitted, running


def test_a_fresh_model_whose_warm_up_ran_slow_takes_a_burst_and_meets_its_deadlines():
    # warm-up on a busy host: 0.32 s a batch, 16 times what the device takes (20 ms)
    profile = LatencyProfile(0.015, 0.005, 1.0, prior_weight=0.5, warmup=[(1, 0.32), (4, 0.32)] * 2)
    scheduler, clock = _fresh_scheduler(profile)
    assert profile.is_provisional and profile.predict(1) > 0.2
    admitted, running = _burst(scheduler, clock, 12, timeout_s=0.8)
    assert admitted == [True] * 12 and running is not None
    clock.advance(0.008)  # the first request's batch really takes 20 ms
    scheduler.batch_done(running, 0.02)
    finished_late = []
    while (batch := scheduler.next_batch().batch) is not None:
        clock.advance(0.02 * math.ceil(len(batch.items) / 4))
        scheduler.batch_done(batch, 0.02 * math.ceil(len(batch.items) / 4))
        finished_late += [item for item in batch.items if clock.now() > item.deadline]
    assert scheduler.is_idle and scheduler.num_queued() == 0 and not finished_late
    assert not profile.is_provisional  # its batches have corrected it


def test_a_model_measured_that_slow_still_refuses_the_burst():
    # the same predictions, from real batches: the queue is bounded by them, as ever
    profile = LatencyProfile(0.015, 0.005, 1.0, prior_weight=0.5)
    for _ in range(50):
        profile.observe(1, 0.32)
        profile.observe(4, 0.32)
    scheduler, clock = _fresh_scheduler(profile)
    assert not profile.is_provisional
    admitted, _ = _burst(scheduler, clock, 12, timeout_s=0.8)
    assert admitted[0] and not all(admitted)


def test_a_provisional_model_still_refuses_what_its_queue_cannot_hold_by_the_deadline():
    profile = LatencyProfile(0.015, 0.005, 1.0, prior_weight=0.5, warmup=[(1, 0.32), (4, 0.32)] * 2)
    scheduler, clock = _fresh_scheduler(profile)
    admitted, _ = _burst(scheduler, clock, 64, timeout_s=0.8)  # 8 batches of 8 would take 2.6 s as predicted
    assert admitted[:12] == [True] * 12 and not all(admitted)
    rejected = scheduler.admit(M1, 99, [1], clock.now() + 0.8)
    assert isinstance(rejected, Rejected) and rejected.reason is RejectReason.OVERLOADED


def test_a_model_whose_warm_up_predicts_every_deadline_missed_still_runs_on_an_idle_device():
    """A warm-up slow throughout (a busy host) predicting more than the deadline: refusing every
    request would leave no batch to correct the prediction, for ever. On an idle device the
    request runs at once, and its batch corrects the profile; a busy device still refuses."""
    profile = LatencyProfile(0.015, 0.005, 1.0, prior_weight=0.5, warmup=[(1, 0.6), (4, 0.6)] * 2)
    scheduler, clock = _fresh_scheduler(profile)
    assert profile.is_provisional and profile.predict(1) > 0.3
    assert isinstance(scheduler.admit(M1, 1, [1], clock.now() + 0.3), Admitted)
    assert isinstance(scheduler.admit(M1, 2, [1], clock.now()), Rejected)  # a deadline already past
    busy = scheduler.admit(M1, 3, [1], clock.now() + 0.3)
    assert isinstance(busy, Rejected) and busy.reason is RejectReason.DEADLINE_UNREACHABLE
    batch = scheduler.next_batch().batch
    assert batch is not None and ids(batch) == [(1, 0)]  # not expired on its prediction
    clock.advance(0.02)
    scheduler.batch_done(batch, 0.02)
    for request_id in range(10, 14):  # the batches it ran corrected the prediction
        assert isinstance(scheduler.admit(M1, request_id, [1], clock.now() + 0.3), Admitted)
        batch = scheduler.next_batch().batch
        clock.advance(0.02)
        scheduler.batch_done(batch, 0.02)
    assert not profile.is_provisional and profile.predict(1) < 0.3


def test_after_one_batch_100x_slower_than_predicted_a_request_that_fit_still_is_admitted():
    """A worker frozen for a moment (a GC pause) must not make admission refuse everything."""
    scheduler, clock = make_scheduler()
    own_s = ALPHA_S + BETA_S * 100
    for request_id in range(100):
        admit(scheduler, clock, request_id, [100], timeout_s=own_s * 1.5)
        assert run(scheduler, clock) is not None
    admit(scheduler, clock, 100, [100], timeout_s=own_s * 1.5)
    batch = scheduler.next_batch().batch
    assert batch is not None
    clock.advance(100 * batch.predicted_s)
    scheduler.batch_done(batch, 100 * batch.predicted_s)
    admit(scheduler, clock, 101, [100], timeout_s=own_s * 1.5)  # the same deadline still fits


def _run_taking(scheduler: Scheduler, clock: VirtualClock, exec_s: float) -> None:
    batch = scheduler.next_batch().batch
    assert batch is not None
    clock.advance(exec_s)
    scheduler.batch_done(batch, exec_s)


def test_after_a_slowdown_is_over_an_idle_device_probes_at_a_bounded_rate_and_relearns():
    """A real slowdown raised the estimate until admission refuses every request with a tight
    deadline; with no batch running, nothing would bring it down. An idle device lets one such
    request through as a probe (at most one per interval while probes confirm the slowdown), and
    once probes come back fast, every request that fits the device at its usual speed runs."""
    scheduler, clock = make_scheduler()
    fast_s = ALPHA_S + BETA_S * 100
    request_ids = itertools.count()
    for _ in range(100):
        admit(scheduler, clock, next(request_ids), [100], timeout_s=2 * fast_s)
        _run_taking(scheduler, clock, fast_s)
    for _ in range(300):  # the device is 10x slower for a while; these requests had time to spare
        admit(scheduler, clock, next(request_ids), [100], timeout_s=1.0)
        _run_taking(scheduler, clock, 10 * fast_s)
    assert scheduler.profile(M1).predict(100) > 3 * fast_s

    def tight(timeout_s: float = 2 * fast_s) -> Admitted | Rejected:
        return scheduler.admit(M1, next(request_ids), [100], clock.now() + timeout_s)

    assert tight(0.5 * fast_s) == Rejected(RejectReason.DEADLINE_UNREACHABLE, 0.0)  # too tight for any speed
    assert isinstance(tight(), Admitted)  # a probe
    _run_taking(scheduler, clock, 10 * fast_s)  # it confirms the slowdown
    clock.advance(1.0)
    assert tight() == Rejected(RejectReason.DEADLINE_UNREACHABLE, 0.0)  # no second probe this soon
    clock.advance(4.0)
    assert isinstance(tight(), Admitted)  # the next probe, 5 s after the last
    _run_taking(scheduler, clock, fast_s)  # the slowdown is over
    for _ in range(400):  # requests with tight deadlines keep coming, and all run
        clock.advance(0.01)
        assert isinstance(tight(), Admitted)
        _run_taking(scheduler, clock, fast_s)
    assert scheduler.profile(M1).predict(100) < 2 * fast_s  # relearned: they fit without probing
