"""Capacity planning: how many devices serve a load within its SLO, by formula and by simulation.

A device runs a batch of n items of cost c each in `T(n) = alpha + beta * c * n` seconds (the
latency profile a worker learns and exports as `sluice_latency_profile_{alpha,beta}_seconds`).
A request that arrives while a batch runs waits for it, then rides the next one, so it is
answered within `2 * T(n)` when batches hold at most n items. The formula:

    n*        = the largest batch with 2 * T(n) <= SLO (and within max_batch_size, max_batch_cost)
    capacity  = n* / T(n*)                  items per second per device, batches full
    devices  ~= ceil(rate * items_per_request / capacity)

The formula ignores Poisson bursts (which need more devices) and that most requests wait less
than a whole batch (which lets batches grow past n*), so the plan then runs the
offered load through sluice's scheduler on a virtual clock (`simulate`), one device at a time:
with requests spread at random over k devices, each device sees a Poisson stream of rate / k,
so one simulation per k answers for all k. The gateway routes by least predicted wait, which
does at least as well as random spreading: the device count found is an upper bound for it.
The plan tries k from the formula's estimate less one (to show the knee) upward until the share
of requests answered within the SLO reaches the target, or downward while
fewer devices still do.

Pure: numbers in, numbers out; no clock, no I/O.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from sluice.clock import VirtualClock
from sluice.repository import BatchingConfig
from sluice.scheduler.batcher import Admitted, Scheduler
from sluice.scheduler.profile import LatencyProfile
from sluice.scheduler.simulate import Arrival, EmulatedDevice, percentile, simulate

__all__ = ["DeviceResult", "Load", "Plan", "capacity_per_device", "largest_batch", "plan", "simulate_device"]

_MODEL = ("planned", "1")
MIN_MEASURED_ARRIVALS = 2_000
"""A simulation's window grows (for low rates) until this many requests arrive in it, on average."""
MAX_SIMULATED_ARRIVALS = 200_000
"""A simulation's requests at most (its window shrinks for very high rates)."""


@dataclass(frozen=True, slots=True)
class Load:
    """What is asked of the fleet, and what one device is like."""

    rate_per_s: float
    """Requests per second, all devices together."""
    slo_s: float
    """Each request's time budget, from its arrival to its answer."""
    alpha_s: float
    beta_s: float
    """A batch of padded cost C takes `alpha_s + beta_s * C` seconds."""
    cost_per_item: int = 1
    items_per_request: int = 1
    max_batch_size: int = 32
    max_batch_cost: int = 8192
    on_time_target: float = 0.99
    """The share of requests that must be answered within the SLO."""

    def __post_init__(self) -> None:
        for name in ("rate_per_s", "slo_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive number")
        if not (math.isfinite(self.alpha_s) and math.isfinite(self.beta_s) and self.alpha_s >= 0
                and self.beta_s >= 0 and self.alpha_s + self.beta_s > 0):
            raise ValueError("the latency profile needs alpha >= 0 and beta >= 0, not both 0")
        if min(self.cost_per_item, self.items_per_request, self.max_batch_size, self.max_batch_cost) < 1:
            raise ValueError("costs, items and batch limits must be at least 1")
        if not 0 < self.on_time_target <= 1:
            raise ValueError("on_time_target must be in (0, 1]")

    def batch_s(self, items: int) -> float:
        return self.alpha_s + self.beta_s * self.cost_per_item * items


def largest_batch(load: Load) -> int:
    """n*: the most items a batch may hold for a request that waits out one batch and rides the
    next to be answered within the SLO (0: not even a batch of one is fast enough)."""
    cap = min(load.max_batch_size, load.max_batch_cost // load.cost_per_item)
    if load.beta_s == 0:
        return cap if 2 * load.alpha_s <= load.slo_s else 0
    fits = math.floor((load.slo_s / 2 - load.alpha_s) / (load.beta_s * load.cost_per_item) + 1e-9)
    return max(0, min(cap, fits))


def capacity_per_device(load: Load) -> float:
    """Items per second one device serves within the SLO, its batches full at n* (0: none)."""
    n = largest_batch(load)
    return n / load.batch_s(n) if n else 0.0


@dataclass(frozen=True, slots=True)
class DeviceResult:
    """One device's share of the load (rate / devices), simulated."""

    devices: int
    rate_per_device: float
    num_requests: int
    on_time_ratio: float
    """Requests answered within the SLO, of all that arrived (rejected ones count as late)."""
    rejected_ratio: float
    """Refused at admission (a 503 or 429 at once), of all that arrived."""
    latency_p50_s: float
    latency_p99_s: float
    """Of the requests answered on time (nan when none was), so never above the SLO."""
    busy_ratio: float
    mean_batch_size: float

    def meets(self, load: Load) -> bool:
        return self.on_time_ratio >= load.on_time_target


@dataclass(frozen=True, slots=True)
class Plan:
    load: Load
    largest_batch: int
    capacity_per_device: float
    """Items per second (the formula's)."""
    formula_devices: int | None
    """The formula's estimate (None: no batch meets the SLO on this device)."""
    tried: tuple[DeviceResult, ...]
    devices: int | None
    """The fewest devices whose simulation met the target (None: none of those tried did)."""


def simulate_device(load: Load, devices: int, duration_s: float = 30.0, warmup_s: float = 3.0,
                    seed: int = 0) -> DeviceResult:
    """One of `devices` devices under its random share of the load, through sluice's scheduler
    (its latency profile exact); results from requests that arrive after `warmup_s`."""
    rate = load.rate_per_s / devices
    duration_s = min(max(duration_s, warmup_s + MIN_MEASURED_ARRIVALS / rate), warmup_s + MAX_SIMULATED_ARRIVALS / rate)
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    at_s = rng.expovariate(rate)
    while at_s < duration_s:
        arrivals.append(Arrival(at_s, _MODEL, (load.cost_per_item,) * load.items_per_request, load.slo_s))
        at_s += rng.expovariate(rate)
    clock = VirtualClock(0.0)
    scheduler = Scheduler(clock)
    scheduler.add_model(_MODEL, BatchingConfig(load.max_batch_size, load.max_batch_cost),
                        LatencyProfile(load.alpha_s, load.beta_s, load.cost_per_item * load.max_batch_size))
    trace = simulate(scheduler, clock, arrivals, {_MODEL: EmulatedDevice(load.alpha_s, load.beta_s)}, seed=seed)
    measured = [i for i, arrival in enumerate(arrivals) if arrival.at_s >= warmup_s]
    finished: dict[int, float] = {}
    items_done: dict[int, int] = {}
    for run in trace.batches:
        for item in run.batch.items:
            if run.finished_at_s <= item.deadline + 1e-9:
                items_done[item.request_id] = items_done.get(item.request_id, 0) + 1
            finished[item.request_id] = max(finished.get(item.request_id, 0.0), run.finished_at_s)
    rejected = {a.request_id for a in trace.admissions if not isinstance(a.outcome, Admitted)}
    on_time = sorted(finished[i] - arrivals[i].at_s for i in measured
                     if items_done.get(i, 0) == load.items_per_request)
    window = [run for run in trace.batches if run.started_at_s >= warmup_s]
    span_s = max(trace.end_s, duration_s) - warmup_s
    count = max(1, len(measured))
    return DeviceResult(
        devices, rate, len(measured), len(on_time) / count, sum(1 for i in measured if i in rejected) / count,
        percentile(on_time, 0.5), percentile(on_time, 0.99),
        sum(run.finished_at_s - run.started_at_s for run in window) / span_s if span_s > 0 else 0.0,
        sum(len(run.batch.items) for run in window) / len(window) if window else 0.0,
    )


def plan(load: Load, duration_s: float = 30.0, seed: int = 0, max_tries: int = 8) -> Plan:
    """The formula's estimate, then simulations from one device below it: upward until one meets
    the target, or downward while one still does (at most `max_tries` device counts)."""
    capacity = capacity_per_device(load)
    estimate = math.ceil(load.rate_per_s * load.items_per_request / capacity - 1e-9) if capacity else None
    tried: dict[int, DeviceResult] = {}
    found: int | None = None
    if estimate is not None:
        devices = max(1, estimate - 1)
        while len(tried) < max_tries and devices >= 1 and devices not in tried:
            result = tried[devices] = simulate_device(load, devices, duration_s, seed=seed)
            if result.meets(load):
                found = devices
                devices -= 1  # fewer may do too
            elif found is None:
                devices += 1
    return Plan(load, largest_batch(load), capacity, estimate, tuple(tried[k] for k in sorted(tried)), found)
