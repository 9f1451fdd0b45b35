"""Tenants and classes over whole workloads, through the discrete-event simulation.

The device is the emulated model that `sluice bench` measures: 8 ms + 0.5 ms per 16-element item,
at most 32 items a batch, so 1,333 items/s at full batches; requests have a 90 ms SLO.
Hypothesis draws the workloads; `derandomize` keeps every run the same.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.clock import VirtualClock
from sluice.priority import Priority
from sluice.repository import BatchingConfig
from sluice.scheduler import Admitted, LatencyProfile, Scheduler
from sluice.scheduler.simulate import (
    Arrival,
    EmulatedDevice,
    Summary,
    TenantLoad,
    Trace,
    simulate,
    summarize,
    tenant_arrivals,
)

KEY = ("m", "1")
DEVICE = EmulatedDevice(alpha_s=0.008, beta_s=0.0005 / 16)
LIMITS = BatchingConfig(max_batch_size=32, max_batch_cost=8192, max_queue_items=4096)
CAPACITY = 32 / 0.024  # items/s
SLO_S = 0.09
INTER, STD, BAT = Priority.INTERACTIVE, Priority.STANDARD, Priority.BATCH


def run(loads: list[TenantLoad], duration_s: float, *, weights: dict[str, float] | None = None,
        seed: int = 1) -> tuple[list[Arrival], Trace, Scheduler]:
    clock = VirtualClock()
    scheduler = Scheduler(clock)
    scheduler.add_model(KEY, LIMITS, LatencyProfile(DEVICE.alpha_s, DEVICE.beta_s, 16))
    scheduler.set_tenant_weights(weights or {})
    arrivals = tenant_arrivals(loads, duration_s, seed)
    return arrivals, simulate(scheduler, clock, arrivals, {KEY: DEVICE}, seed=seed), scheduler


def summary(loads: list[TenantLoad], duration_s: float = 3.0, **kwargs) -> Summary:
    arrivals, trace, _ = run(loads, duration_s, **kwargs)
    return summarize(arrivals, trace, (0.5, duration_s))


def check_every_item_leaves_once(arrivals: list[Arrival], trace: Trace, scheduler: Scheduler) -> None:
    admitted = {a.request_id for a in trace.admissions if isinstance(a.outcome, Admitted)}
    executed = Counter((i.request_id, i.index) for run in trace.batches for i in run.batch.items)
    expired = Counter((e.item.request_id, e.item.index) for e in trace.expiries)
    for run in trace.batches:
        assert len({(i.priority, i.tenant) for i in run.batch.items}) >= 1
        for item in run.batch.items:
            assert run.started_at_s + run.batch.predicted_s <= item.deadline + 1e-9, "expired work never runs"
    for request_id in admitted:
        for index in range(len(arrivals[request_id].costs)):
            assert executed[(request_id, index)] + expired[(request_id, index)] == 1
    assert set(executed) | set(expired) <= {(r, i) for r in admitted for i in range(len(arrivals[r].costs))}
    assert not set(executed) & set(expired)
    assert scheduler.num_queued() == 0 and scheduler.is_idle
    assert all(stats.num_queued == 0 for stats in scheduler.tenant_stats())


# -- properties --------------------------------------------------------------------------------

COST_RANGES = [(16, 16), (8, 60), (1, 200), (100, 120)]


@st.composite
def tenant_mixes(draw: st.DrawFn) -> tuple[list[TenantLoad], dict[str, float]]:
    loads, weights = [], {}
    for index in range(draw(st.integers(2, 4))):
        name = f"t{index}"
        weights[name] = float(draw(st.sampled_from([1, 2, 3, 4])))
        priority = draw(st.sampled_from(list(Priority)))
        loads.append(TenantLoad(name, draw(st.sampled_from([0.2, 1.0, 3.0])) * CAPACITY,
                                draw(st.sampled_from(COST_RANGES)), draw(st.sampled_from([0.05, SLO_S, 0.3])),
                                priority, start_s=draw(st.sampled_from([0.0, 0.3])),
                                background=priority == BAT and draw(st.booleans())))
    return loads, weights


@settings(max_examples=25, deadline=None, derandomize=True)
@given(tenant_mixes(), st.integers(0, 2**16))
def test_no_request_is_lost_or_duplicated_and_expired_work_never_runs(mix, seed):
    loads, weights = mix
    arrivals, trace, scheduler = run(loads, 0.8, weights=weights, seed=seed)
    check_every_item_leaves_once(arrivals, trace, scheduler)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(weights=st.lists(st.sampled_from([1, 2, 3, 4]), min_size=2, max_size=3),
       cost_ranges=st.lists(st.sampled_from(COST_RANGES), min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_saturating_tenants_device_shares_converge_to_their_weights(weights, cost_ranges, seed):
    """Bound: each share within 15% (relative) of weight / total weight, whatever the sizes, over
    a 2 s window. The worst draw seen was 12% (weights 4:1:2, the weight-1 tenant at 0.126 against
    0.143, with mixed request sizes); the 1:2:4 scenario below, at equal sizes, holds 5%."""
    names = [f"t{i}" for i in range(len(weights))]
    loads = [TenantLoad(name, 3 * CAPACITY, cost_ranges[i], SLO_S) for i, name in enumerate(names)]
    result = summary(loads, 2.5, weights=dict(zip(names, map(float, weights), strict=True)), seed=seed)
    total = sum(weights)
    for name, weight in zip(names, weights, strict=True):
        share = result.groups[(name, STD)].device_share
        assert abs(share - weight / total) <= 0.15 * weight / total, (name, share, weight / total)
    assert result.busy_ratio >= 0.95


@settings(max_examples=4, deadline=None, derandomize=True)
@given(flood=st.sampled_from([INTER, STD]), min_share=st.sampled_from([0.05, 0.2]), seed=st.integers(0, 2**16))
def test_a_lower_class_gets_its_minimum_share_under_a_higher_class_flood(flood, min_share, seed):
    """The starvation bound (fair.py): a backlogged class waits at most its last service divided
    by its minimum share, so over a window many times that it gets about its share."""
    clock = VirtualClock()
    scheduler = Scheduler(clock, min_class_shares={STD: min_share, BAT: min_share})
    scheduler.add_model(KEY, LIMITS, LatencyProfile(DEVICE.alpha_s, DEVICE.beta_s, 16))
    loads = [TenantLoad("hi", 3 * CAPACITY, (16, 16), SLO_S, flood),
             TenantLoad("lo", 3 * CAPACITY, (16, 16), 1.0, BAT)]
    arrivals = tenant_arrivals(loads, 2.0, seed)
    trace = simulate(scheduler, clock, arrivals, {KEY: DEVICE})
    result = summarize(arrivals, trace, (0.2, 2.0))
    assert result.groups[("lo", BAT)].device_share >= min_share - 0.02
    assert result.groups[("hi", flood)].device_share >= 1 - min_share - 0.05


def test_a_returning_tenant_banks_no_credit():
    """Tenant b sleeps for a second while a uses the whole device, then both saturate: from then
    on they share equally, with no catching up by b beyond one batch's lead."""
    loads = [TenantLoad("a", 3 * CAPACITY, (16, 16), SLO_S),
             TenantLoad("b", 3 * CAPACITY, (16, 16), SLO_S, start_s=1.0)]
    arrivals, trace, _ = run(loads, 2.0)
    result = summarize(arrivals, trace, (1.0, 2.0))
    assert abs(result.groups[("b", STD)].device_share - 0.5) <= 0.03


# -- the benchmark's targets, in simulation --------------------------------------------------


def test_overload_at_three_times_capacity_keeps_goodput_and_the_slo():
    arrivals, trace, _ = run([TenantLoad("", 3 * CAPACITY, (16, 16), SLO_S)], 3.0)
    result = summarize(arrivals, trace, (0.5, 3.0)).groups[("", STD)]
    assert result.goodput_items_per_s >= 0.9 * CAPACITY
    assert result.num_on_time >= 0.99 * result.num_admitted  # admitted requests' p99 within the SLO
    assert result.latency_p99_s <= SLO_S


def test_weights_one_two_four_give_device_shares_within_five_percent():
    loads = [TenantLoad(name, 2 * CAPACITY, (16, 16), SLO_S) for name in "abc"]
    result = summary(loads, weights={"a": 1.0, "b": 2.0, "c": 4.0})
    for name, weight in zip("abc", (1, 2, 4), strict=True):
        assert abs(result.groups[(name, STD)].device_share - weight / 7) <= 0.05 * weight / 7
    assert result.busy_ratio >= 0.95


def test_noisy_neighbour_leaves_the_quiet_tenant_its_success_rate():
    """A sends 5x its fair share, B half of its share, equal weights. B keeps its success rate
    (within 10% of alone) and meets its SLO; A gets the rest of the device in full batches. B's
    p99 is NOT within 10% of B alone: every batch A fills takes 24 ms where B alone ran 8-10 ms
    ones (see benchmarks/README.md)."""
    alone = summary([TenantLoad("B", CAPACITY / 4, (16, 16), SLO_S)]).groups[("B", STD)]
    mixed = summary([TenantLoad("A", 5 * CAPACITY / 2, (16, 16), SLO_S),
                     TenantLoad("B", CAPACITY / 4, (16, 16), SLO_S)])
    quiet = mixed.groups[("B", STD)]
    assert quiet.success_ratio >= 0.9 * alone.success_ratio
    assert quiet.latency_p99_s <= SLO_S
    assert quiet.latency_p99_s <= 2.5 * alone.latency_p99_s
    assert mixed.busy_ratio >= 0.95
    # A's admission counts B's later requests going first (waits.jump_rate), so A's admitted
    # requests meet their deadlines and batches stay nearly full.
    total = quiet.goodput_items_per_s + mixed.groups[("A", STD)].goodput_items_per_s
    assert total >= 0.9 * CAPACITY


def test_priority_mix_batch_class_uses_the_remaining_capacity():
    """Interactive at 30% of capacity with a batch-class flood: interactive keeps every request
    within its SLO and the batch class gets >= 80% of the rest. Interactive p99 is NOT within 10%
    of interactive alone (a batch-class batch already running delays it; see the report)."""
    interactive = TenantLoad("i", 0.3 * CAPACITY, (16, 16), SLO_S, INTER)
    alone = summary([interactive]).groups[("i", INTER)]
    mixed = summary([interactive, TenantLoad("b", 3 * CAPACITY, (16, 16), 10.0, BAT)])
    served = mixed.groups[("i", INTER)]
    assert served.success_ratio == alone.success_ratio == 1.0
    assert served.latency_p99_s <= SLO_S
    assert mixed.groups[("b", BAT)].goodput_items_per_s >= 0.8 * (CAPACITY - alone.goodput_items_per_s)


def test_a_background_job_beside_interactive_traffic_keeps_its_p99_within_ten_percent():
    """A batch job (background items, always queued) beside interactive traffic at 10%, 30% and
    50% of capacity: the interactive p99 stays within 10% of its p99 alone and every request is on
    time, while the job rides in the interactive batches; alone, the job fills the device. (Without
    `background`, as the batch class's online requests: 1.2-1.5x; see benchmarks/README.md.)"""
    job = TenantLoad("job", 3 * CAPACITY, (6, 6), 100.0, BAT, background=True)
    for fraction in (0.1, 0.3, 0.5):
        interactive = TenantLoad("i", fraction * CAPACITY, (16, 16), SLO_S, INTER)
        alone = summary([interactive], 5.0).groups[("i", INTER)]
        mixed = summary([interactive, job], 5.0)
        beside = mixed.groups[("i", INTER)]
        assert beside.success_ratio == alone.success_ratio == 1.0
        assert beside.latency_p99_s <= 1.1 * alone.latency_p99_s, fraction
        assert mixed.groups[("job", BAT)].goodput_items_per_s >= 20, fraction
    alone_job = summary([job], 2.0)
    assert alone_job.busy_ratio >= 0.99
    assert alone_job.groups[("job", BAT)].goodput_items_per_s >= 0.95 * 32 / (0.008 + 0.0005 * 32 * 6 / 16)


@pytest.mark.parametrize("background", [True, False])
def test_an_online_overload_beside_a_job_keeps_its_goodput(background):
    """Interactive at 1.5x capacity beside a job (background items, or batch-class requests): the
    batch class still takes its minimum share (5%) in whole batches, and admission counts those
    batches, so the interactive class keeps >= 85% of the device's capacity on time (without the
    count, 70-75%: requests admitted up to their deadline expired behind the job's batches)."""
    interactive = TenantLoad("i", 1.5 * CAPACITY, (16, 16), SLO_S, INTER)
    job = TenantLoad("job", 3 * CAPACITY, (6, 6), 100.0, BAT, background=background)
    mixed = summary([interactive, job], 5.0)
    assert mixed.groups[("i", INTER)].goodput_items_per_s >= 0.85 * CAPACITY
    assert mixed.groups[("job", BAT)].goodput_items_per_s >= 50


def test_simulation_is_deterministic():
    loads = [TenantLoad("a", CAPACITY, (1, 200), SLO_S), TenantLoad("b", CAPACITY, (16, 16), SLO_S, BAT)]
    first, second = (summary(loads, 1.0, seed=7) for _ in range(2))
    assert first == second
    assert random.Random(7).random() == random.Random(7).random()
