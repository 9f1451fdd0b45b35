"""Background (batch job) items in the scheduler, step by step on a virtual clock: they ride in
online batches' spare room, wait while online work is active, run full batches once it is quiet,
and still get the batch class's minimum share under an online flood (`scheduler/backlog.py`)."""

from __future__ import annotations

import itertools

import pytest

from sluice.clock import VirtualClock
from sluice.priority import Priority
from sluice.repository import BatchingConfig
from sluice.scheduler import Admitted, LatencyProfile, Scheduler
from sluice.scheduler.backlog import OWED_BATCHES
from sluice.scheduler.simulate import Arrival, EmulatedDevice, TenantLoad, simulate, tenant_arrivals
from tests.scheduler.support import run
from tests.scheduler.test_fair import ALPHA_S, BETA_S, M1, make_scheduler

INTER, BAT = Priority.INTERACTIVE, Priority.BATCH
JOB_COST = 6  # a job's short items: a bucket below the online items' 16
LIMITS = BatchingConfig(max_batch_size=32, max_batch_cost=8192, max_queue_items=4096)


def admit_job(scheduler: Scheduler, now: float, first_id: int, count: int, cost: int = JOB_COST) -> None:
    for request_id in range(first_id, first_id + count):
        outcome = scheduler.admit(M1, request_id, [cost], now + 60.0, tenant="job", priority=BAT, background=True)
        assert isinstance(outcome, Admitted)


def admit_online(scheduler: Scheduler, now: float, first_id: int, count: int, priority: Priority = INTER) -> None:
    for request_id in range(first_id, first_id + count):
        outcome = scheduler.admit(M1, request_id, [16], now + 0.09, tenant="web", priority=priority)
        assert isinstance(outcome, Admitted)


def test_background_items_ride_in_an_online_batch_within_the_ride_share():
    scheduler, clock = make_scheduler(background_ride_share=0.1)
    admit_job(scheduler, clock.now(), 1000, 40)
    admit_online(scheduler, clock.now(), 1, 8)
    batch = scheduler.next_batch().batch
    assert batch is not None
    online = [item for item in batch.items if not item.background]
    riders = [item for item in batch.items if item.background]
    assert len(online) == 8 and batch.items[:8] == tuple(online)
    # 8 rows of 16 take 12 ms; each rider, padded to 16, adds 0.5 ms: 10% allows two
    assert len(riders) == batch.num_riders == 2
    assert batch.predicted_s <= 1.1 * (ALPHA_S + BETA_S * 8 * 16) + 1e-12
    assert batch.padded_cost == 10 * 16


def test_a_rider_costlier_than_a_batch_allows_comes_every_few_batches():
    """Batches of one online item (8.5 ms) allow 2% each (0.17 ms); a rider adds 0.5 ms: the
    allowance saves up to one rider's time, so every third batch carries one."""
    scheduler, clock = make_scheduler()
    admit_online(scheduler, clock.now(), 100, 10)  # online traffic is active (held, not heading)
    run(scheduler, clock)
    admit_job(scheduler, clock.now(), 1000, 20)
    riders = []
    for request_id in range(12):
        admit_online(scheduler, clock.now(), request_id, 1)
        batch = run(scheduler, clock)
        assert batch is not None and batch.items[0].request_id == request_id
        riders.append(batch.num_riders)
    assert riders == [0, 1, 0] * 4  # (the batch of ten before saved a share too)


def test_a_rider_is_charged_its_padded_row():
    scheduler, clock = make_scheduler(background_ride_share=0.5)
    admit_job(scheduler, clock.now(), 1000, 1)
    admit_online(scheduler, clock.now(), 1, 3)
    batch = scheduler.next_batch().batch
    assert batch is not None and batch.num_riders == 1
    shares = scheduler.batch_done(batch, 0.012)
    assert shares == {1: pytest.approx(0.003), 2: pytest.approx(0.003), 3: pytest.approx(0.003),
                      1000: pytest.approx(0.003)}


def test_a_background_job_alone_runs_full_batches_at_once():
    scheduler, clock = make_scheduler()
    admit_job(scheduler, clock.now(), 1000, 100)
    sizes = [len(batch.items) for batch in (run(scheduler, clock) for _ in range(3)) if batch is not None]
    assert sizes == [32, 32, 32]


def test_background_waits_while_online_work_is_active_then_runs_when_it_is_quiet():
    scheduler, clock = make_scheduler()
    for second in range(20):  # online traffic at 500 items/s for 0.2 s
        admit_online(scheduler, clock.now(), 10 * second + 1, 5)
        while (batch := run(scheduler, clock)) is not None:
            assert batch.num_riders == 0  # no job yet
        clock.advance(0.01)
    admit_job(scheduler, clock.now(), 1000, 64)
    decision = scheduler.next_batch()
    assert decision.batch is None and decision.retry_at is not None
    assert decision.retry_at > clock.now()
    clock.advance(decision.retry_at - clock.now() - 0.001)
    assert scheduler.next_batch().batch is None  # still held a moment before
    admit_online(scheduler, clock.now(), 500, 1)
    batch = run(scheduler, clock)  # online work that arrives meanwhile goes at once, a job item riding
    assert batch is not None and batch.items[0].request_id == 500 and batch.num_riders == 1
    retry_at = scheduler.next_batch().retry_at
    assert retry_at is not None
    clock.advance(retry_at - clock.now())
    batch = scheduler.next_batch().batch
    assert batch is not None and len(batch.items) == 32 and all(item.background for item in batch.items)


def test_online_batch_class_items_are_not_held():
    scheduler, clock = make_scheduler()
    admit_online(scheduler, clock.now(), 1, 1)
    run(scheduler, clock)
    admit_online(scheduler, clock.now(), 2, 3, priority=BAT)
    batch = scheduler.next_batch().batch
    assert batch is not None and len(batch.items) == 3


def test_background_owed_its_minimum_share_heads_a_batch_under_an_online_flood():
    """Full online batches (24 ms) leave no room to ride: the batch class's 5% share builds up
    (1.2 ms a batch) and a background batch (14 ms) runs once the class is owed `OWED_BATCHES`
    of them (112 ms: the 94th batch), then one in every ~12 batches: the class's 5% again."""
    scheduler, clock = make_scheduler()
    admit_job(scheduler, clock.now(), 100_000, 640)
    next_id = 1
    heads = []
    for _ in range(200):
        admit_online(scheduler, clock.now(), next_id, 32)
        next_id += 32
        batch = run(scheduler, clock)
        assert batch is not None
        heads.append(batch.items[0].background)
        if batch.items[0].background:
            run(scheduler, clock)  # the online batch it delayed
    first = heads.index(True)
    assert OWED_BATCHES * 14 / 1.2 - 2 <= first <= OWED_BATCHES * 14 / 1.2 + 2
    later = [i for i, h in enumerate(heads) if h]
    assert len(later) >= 8 and all(10 <= b - a <= 13 for a, b in itertools.pairwise(later)), later


def test_held_background_work_runs_once_online_traffic_stops():
    """Online traffic for 3 s, a job arriving in the middle: the job rides while the traffic lasts,
    and the worker's look-again time (`Decision.retry_at`) starts the rest once it has stopped."""
    clock = VirtualClock()
    scheduler = Scheduler(clock)
    scheduler.add_model(M1, LIMITS, LatencyProfile(ALPHA_S, BETA_S, 16))
    arrivals = tenant_arrivals([TenantLoad("web", 25, (16, 16), 0.09, Priority.STANDARD, model=M1)], 3.0, 1)
    arrivals += [Arrival(1.0 + i * 1e-4, M1, (3,), 60.0, tenant="web", priority=BAT, background=True)
                 for i in range(500)]
    trace = simulate(scheduler, clock, sorted(arrivals, key=lambda a: a.at_s), {M1: EmulatedDevice(ALPHA_S, BETA_S)})
    job_runs = [run for run in trace.batches for item in run.batch.items if item.background]
    assert len(job_runs) == 500 and scheduler.num_queued() == 0
    during = sum(1 for run in job_runs if run.finished_at_s < 3.0)
    assert 5 <= during <= 100  # a rider every few online batches while the traffic lasts
    assert all(run.started_at_s < 6.0 for run in job_runs)  # then the rest, once the rate has decayed


def test_on_a_device_whose_batches_take_no_time_background_work_is_never_held():
    """A model whose measured profile is zero (a no-op model) predicts batches of no time, which
    delay no one: background work runs beside online traffic instead of failing to form."""
    clock = VirtualClock(0.0)
    scheduler = Scheduler(clock)
    scheduler.add_model(M1, LIMITS, LatencyProfile(0.0, 0.0, 16))
    admit_online(scheduler, clock.now(), 1, 1)
    online = scheduler.next_batch().batch
    assert online is not None
    admit_job(scheduler, clock.now(), 1000, 1)
    scheduler.batch_done(online, 0.0)
    decision = scheduler.next_batch()
    assert decision.batch is not None and [item.request_id for item in decision.batch.items] == [1000]
