"""Classes and tenants in the scheduler, step by step on a virtual clock.

The worker's part is played by hand as in `test_batcher.py`: `admit`, `next_batch` when the device
is free, `batch_done` after moving the clock.
"""

from __future__ import annotations

import pytest

from sluice.clock import VirtualClock
from sluice.priority import Priority
from sluice.repository import BatchingConfig
from sluice.scheduler import Admitted, Batch, LatencyProfile, Rejected, RejectReason, Scheduler
from sluice.scheduler.fair import ClassShares
from tests.scheduler.support import run

ALPHA_S = 0.008
BETA_S = 0.0005 / 16  # the emulated model: 32 items of 16 -> 24 ms
M1 = ("m", "1")
INTER, STD, BAT = Priority.INTERACTIVE, Priority.STANDARD, Priority.BATCH


def make_scheduler(max_batch_size: int = 32, **kwargs) -> tuple[Scheduler, VirtualClock]:
    clock = VirtualClock(10.0)
    scheduler = Scheduler(clock, **kwargs)
    scheduler.add_model(M1, BatchingConfig(max_batch_size=max_batch_size, max_batch_cost=8192, max_queue_items=4096),
                        LatencyProfile(ALPHA_S, BETA_S, 16))
    return scheduler, clock


def admit(scheduler: Scheduler, clock: VirtualClock, request_id: int, tenant: str = "", priority: Priority = STD,
          cost: int = 16, timeout_s: float = 10.0) -> None:
    outcome = scheduler.admit(M1, request_id, [cost], clock.now() + timeout_s, tenant=tenant, priority=priority)
    assert isinstance(outcome, Admitted), outcome



def tenants(batch: Batch | None) -> list[str]:
    assert batch is not None
    return [item.tenant for item in batch.items]


def test_a_higher_class_goes_first_and_lower_classes_fill_leftover_slots():
    scheduler, clock = make_scheduler(max_batch_size=4)
    for request_id in range(6):
        admit(scheduler, clock, request_id, "b", BAT)
    admit(scheduler, clock, 10, "i", INTER, timeout_s=1.0)
    admit(scheduler, clock, 11, "s", STD)
    batch = run(scheduler, clock)
    assert batch is not None
    assert [item.priority for item in batch.items] == [INTER, STD, BAT, BAT]


def test_lower_class_riders_never_make_the_batch_miss_its_earliest_deadline():
    scheduler, clock = make_scheduler()
    for request_id in range(30):
        admit(scheduler, clock, request_id, "b", BAT)
    one_s = ALPHA_S + BETA_S * 16
    admit(scheduler, clock, 100, "i", INTER, timeout_s=one_s + 4 * BETA_S * 16 + 1e-6)
    batch = scheduler.next_batch().batch
    assert batch is not None and batch.items[0].request_id == 100
    assert len(batch.items) == 5
    assert clock.now() + batch.predicted_s <= batch.items[0].deadline


def test_within_a_class_tenants_alternate_by_weight():
    scheduler, clock = make_scheduler(max_batch_size=1)
    scheduler.set_tenant_weights({"heavy": 2.0})
    for request_id in range(30):
        admit(scheduler, clock, request_id, "light")
        admit(scheduler, clock, 100 + request_id, "heavy")
    order = [tenants(run(scheduler, clock))[0] for _ in range(30)]
    assert order.count("heavy") == 20 and order.count("light") == 10


def test_within_a_tenant_the_earliest_deadline_goes_first():
    scheduler, clock = make_scheduler(max_batch_size=1)
    for request_id, timeout_s in [(1, 0.9), (2, 0.3), (3, 0.6)]:
        admit(scheduler, clock, request_id, "a", timeout_s=timeout_s)
    assert [run(scheduler, clock).items[0].request_id for _ in range(3)] == [2, 3, 1]


def test_a_batch_is_filled_in_fair_order_across_tenants():
    scheduler, clock = make_scheduler(max_batch_size=8)
    for request_id in range(20):
        admit(scheduler, clock, request_id, "a")
    for request_id in range(4):
        admit(scheduler, clock, 100 + request_id, "b")
    batch = run(scheduler, clock)
    assert sorted(tenants(batch)) == ["a"] * 4 + ["b"] * 4


def test_an_idle_tenant_banks_no_credit():
    scheduler, clock = make_scheduler(max_batch_size=1)
    for request_id in range(40):
        admit(scheduler, clock, request_id, "busy")
    for _ in range(20):
        run(scheduler, clock)  # "late" sends nothing meanwhile
    for request_id in range(20):
        admit(scheduler, clock, 100 + request_id, "late")
    order = [tenants(run(scheduler, clock))[0] for _ in range(20)]
    assert 9 <= order.count("late") <= 11, order  # equal shares from now on, no catching up


def test_measured_time_replaces_the_predicted_charge():
    scheduler, clock = make_scheduler(max_batch_size=1)
    for request_id in range(20):
        admit(scheduler, clock, request_id, "slow", cost=16)
        admit(scheduler, clock, 100 + request_id, "fast", cost=17)
    order = []
    for _ in range(20):
        batch = scheduler.next_batch().batch
        assert batch is not None
        exec_s = 3 * batch.predicted_s if batch.items[0].tenant == "slow" else batch.predicted_s
        clock.advance(exec_s)
        assert scheduler.batch_done(batch, exec_s) == {batch.items[0].request_id: pytest.approx(exec_s)}
        order.append(batch.items[0].tenant)
    # three times the time per batch: about a third of the batches (charged predicted time: half)
    assert 14 <= order.count("fast") <= 16


def test_batch_done_splits_device_time_by_cost():
    scheduler, clock = make_scheduler()
    scheduler.admit(M1, 1, [16, 16], clock.now() + 1.0, tenant="a")
    scheduler.admit(M1, 2, [32 - 1], clock.now() + 1.0, tenant="b")
    batch = scheduler.next_batch().batch
    assert batch is not None
    shares = scheduler.batch_done(batch, 0.063)
    assert shares == {1: pytest.approx(0.063 * 32 / 63), 2: pytest.approx(0.063 * 31 / 63)}
    stats = {(s.tenant, s.priority): s for s in scheduler.tenant_stats()}
    assert stats[("a", STD)].device_s == pytest.approx(0.063 * 32 / 63)
    assert stats[("b", STD)].num_queued == 0


def test_admission_refuses_the_flooding_tenant_and_admits_the_other():
    scheduler, clock = make_scheduler()
    num_admitted = 0
    for request_id in range(2000):
        outcome = scheduler.admit(M1, request_id, [16], clock.now() + 0.09, tenant="flood")
        num_admitted += isinstance(outcome, Admitted)
    assert 0 < num_admitted < 2000
    flooded = scheduler.admit(M1, 9999, [16], clock.now() + 0.09, tenant="flood")
    assert isinstance(flooded, Rejected) and flooded.reason is RejectReason.OVERLOADED
    assert isinstance(scheduler.admit(M1, 10_000, [16], clock.now() + 0.09, tenant="polite"), Admitted)


def test_higher_class_admission_ignores_lower_class_work():
    scheduler, clock = make_scheduler()
    for request_id in range(500):
        admit(scheduler, clock, request_id, "b", BAT, timeout_s=100.0)
    assert isinstance(scheduler.admit(M1, 1000, [16], clock.now() + 0.09, tenant="s", priority=STD), Admitted)
    outcome = scheduler.admit(M1, 1001, [16], clock.now() + 0.09, tenant="b", priority=BAT)
    assert isinstance(outcome, Rejected) and outcome.reason is RejectReason.OVERLOADED
    # another tenant of the batch class gets its fair share of that class's turn
    assert isinstance(scheduler.admit(M1, 1002, [16], clock.now() + 0.09, tenant="b2", priority=BAT), Admitted)


def test_the_queue_cap_is_per_tenant_and_class():
    scheduler, clock = make_scheduler()
    scheduler._queues[M1].batching = BatchingConfig(max_queue_items=10)  # white box: a small cap
    for request_id in range(10):
        admit(scheduler, clock, request_id, "a", timeout_s=100.0)
    outcome = scheduler.admit(M1, 50, [16], clock.now() + 100.0, tenant="a")
    assert isinstance(outcome, Rejected) and outcome.reason is RejectReason.QUEUE_FULL
    admit(scheduler, clock, 51, "b", timeout_s=100.0)
    admit(scheduler, clock, 52, "a", INTER, timeout_s=100.0)


def test_wait_report_per_class_and_tenant():
    scheduler, clock = make_scheduler()
    scheduler.set_tenant_weights({"a": 2.0})
    for request_id in range(64):
        admit(scheduler, clock, request_id, "a", STD)
    admit(scheduler, clock, 100, "i", INTER)
    report = scheduler.wait_report()
    by_class = {c.priority: c for c in report.classes}
    assert by_class[INTER].newcomer_wait_s == pytest.approx(0.0, abs=1e-9)
    assert by_class[BAT].newcomer_wait_s > by_class[STD].newcomer_wait_s > 0
    assert by_class[STD].backlogged_weight == 2.0
    waits = {(t.tenant, t.priority): t for t in report.tenants}
    assert waits[("a", STD)].num_queued == 64
    one_batch_s = ALPHA_S + 32 * 16 * BETA_S  # the estimate leaves room for a last batch to fill up
    assert scheduler.work_ahead_s() <= waits[("a", STD)].wait_s <= scheduler.work_ahead_s() + one_batch_s
    assert waits[("i", INTER)].wait_s < waits[("a", STD)].wait_s


def test_invalid_weights_are_refused():
    scheduler, _ = make_scheduler()
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            scheduler.set_tenant_weights({"a": bad})
    with pytest.raises(ValueError):
        scheduler.set_tenant_weights({}, default_weight=0.0)


def test_class_shares_owe_a_starved_class_its_minimum_share():
    shares = ClassShares({BAT: 0.1})
    assert shares.order([INTER, BAT]) == [INTER, BAT]
    shares.record(0.02, {INTER: 0.02}, [INTER, BAT])
    assert shares.order([INTER, BAT]) == [BAT, INTER]  # owed after one batch without it
    shares.record(0.02, {BAT: 0.02}, [INTER, BAT])  # credit 0.002 + 0.1 * 0.02 - 0.02 = -0.016
    for _ in range(8):  # paid back at a tenth of the device time of other classes' batches
        assert shares.order([INTER, BAT]) == [INTER, BAT]
        shares.record(0.02, {INTER: 0.02}, [INTER, BAT])
    shares.record(0.02, {INTER: 0.02}, [INTER, BAT])
    assert shares.order([INTER, BAT]) == [BAT, INTER]
    shares.record(0.02, {INTER: 0.02}, [INTER])  # idle: the credit is forgotten
    assert shares.credit_s(BAT) == 0.0


def test_an_item_too_late_for_a_larger_batch_is_expired_and_the_batch_still_fills():
    """A rider whose deadline fits a batch of one but not two could only be saved by keeping the
    batch small (no later batch finishes sooner): it is expired, and the batch fills."""
    scheduler, clock = make_scheduler()
    admit(scheduler, clock, 0, "a")
    run(scheduler, clock)  # a has been served: b's tag is lower, so b heads the next batch
    one_s = ALPHA_S + BETA_S * 16
    admit(scheduler, clock, 2, "a", timeout_s=0.5)
    for request_id in range(3, 40):
        admit(scheduler, clock, request_id, "a")
    clock.advance(0.5 - one_s - 1e-6)  # the device was elsewhere: item 2 now has slack for one item only
    admit(scheduler, clock, 1, "b")
    decision = scheduler.next_batch()
    assert decision.batch is not None and decision.batch.items[0].tenant == "b"
    assert len(decision.batch.items) == 32
    assert [item.request_id for item in decision.expired] == [2]


def test_admission_counts_a_quiet_tenants_later_requests_going_first():
    """B sends steadily below its share; A floods. A's predicted wait is stretched by B's demand,
    so A is admitted less than on an idle device, and B still gets in."""
    def admitted_for_flood(with_quiet_tenant: bool) -> int:
        scheduler, clock = make_scheduler()
        if with_quiet_tenant:  # B's recent demand: 16 items every 40 ms, 0.3 device-seconds per second
            for step in range(40):
                for index in range(16):
                    admit(scheduler, clock, 10_000 + 16 * step + index, "B", timeout_s=1.0)
                batch = run(scheduler, clock)
                assert batch is not None
                clock.advance(0.04 - batch.predicted_s)
        count = 0
        for request_id in range(2000):
            count += isinstance(scheduler.admit(M1, request_id, [16], clock.now() + 0.2, tenant="A"), Admitted)
        assert isinstance(scheduler.admit(M1, 9000, [16], clock.now() + 0.2, tenant="B"), Admitted)
        return count

    alone, beside_quiet = admitted_for_flood(False), admitted_for_flood(True)
    assert beside_quiet < 0.8 * alone
