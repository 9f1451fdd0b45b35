"""Named multi-tenant scenarios for `sluice bench --scenario NAME`: what each offers and what it must show.

A scenario is pure data: the tenants (weight, default class), one or more phases, each a set of
streams (a tenant offering a multiple of the device's capacity), and the checks that turn the
measured phases into pass/fail verdicts. Running one (server, load, report) is `scenario_run`.

    overload         one tenant offers 3x capacity
    noisy-neighbour  B alone at half its fair share; then A at 5x its share with B as before (equal weights)
    priority-mix     interactive alone at 30% of capacity; then the same with a batch-class flood
    weights          three tenants, weights 1:2:4, each offering the whole capacity

Loads are in units of the device's capacity (items/s at full batches), so a scenario means the
same thing on a faster or slower emulated device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sluice.bench.promstats import ServerStats
from sluice.bench.stats import RateResult
from sluice.priority import Priority

REJECTION_P99_TARGET_MS = 20.0


@dataclass(frozen=True, slots=True)
class TenantSpec:
    name: str
    weight: float = 1.0
    priority: Priority = Priority.STANDARD
    timeout_slos: float | None = None
    """Deadline sent with each request, in multiples of the model's default; None: that default."""


@dataclass(frozen=True, slots=True)
class Stream:
    tenant: str
    load: float
    """Offered rate as a multiple of the device's capacity."""


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    streams: tuple[Stream, ...]


@dataclass(frozen=True, slots=True)
class PhaseResult:
    phase: Phase
    by_tenant: dict[str, RateResult]
    server: ServerStats | None


@dataclass(frozen=True, slots=True)
class Check:
    target: str
    measured: str
    passed: bool


@dataclass(frozen=True, slots=True)
class Measured:
    """Everything the checks see: the phases' results and the device they ran on."""

    phases: dict[str, PhaseResult]
    capacity_per_s: float
    slo_ms: float
    """The p99 latency target at the client."""


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    summary: str
    tenants: tuple[TenantSpec, ...]
    phases: tuple[Phase, ...]
    checks: Callable[[Measured], list[Check]]

    def tenant(self, name: str) -> TenantSpec:
        return next(t for t in self.tenants if t.name == name)


def _p99(result: RateResult) -> float:
    return result.latency.p99_ms if result.latency is not None else float("inf")


def _busy(phase: PhaseResult) -> float:
    return phase.server.busy_ratio if phase.server is not None and phase.server.busy_ratio is not None else 0.0


def _within(value: float, reference: float, tolerance: float) -> bool:
    return value <= reference * (1.0 + tolerance)


def _overload_checks(m: Measured) -> list[Check]:
    run = m.phases["3x"].by_tenant["t"]
    rejection_p99 = run.rejection_latency.p99_ms if run.rejection_latency else 0.0
    retry_after = run.rejections_carry_retry_after
    return [
        Check("goodput >= 90% of capacity", f"{run.completed_per_s:.0f}/s = "
              f"{run.completed_per_s / m.capacity_per_s:.1%}", run.completed_per_s >= 0.9 * m.capacity_per_s),
        Check(f"admitted p99 <= SLO ({m.slo_ms:g} ms)", f"{_p99(run):.1f} ms", _p99(run) <= m.slo_ms),
        Check(f"rejections p99 <= {REJECTION_P99_TARGET_MS:g} ms", f"{rejection_p99:.1f} ms "
              f"({run.num_rejections} rejected)", rejection_p99 <= REJECTION_P99_TARGET_MS),
        Check("every rejection has Retry-After", str(retry_after), retry_after is not False),
    ]


def _noisy_checks(m: Measured) -> list[Check]:
    alone, mixed = m.phases["B alone"], m.phases["A and B"]
    b_alone, b_mixed, a_mixed = alone.by_tenant["B"], mixed.by_tenant["B"], mixed.by_tenant["A"]
    shares = mixed.server.device_shares() if mixed.server else {}
    return [
        Check("B p99 within 10% of B alone", f"{_p99(b_mixed):.1f} vs {_p99(b_alone):.1f} ms "
              f"({_p99(b_mixed) / _p99(b_alone):.2f}x)", _within(_p99(b_mixed), _p99(b_alone), 0.10)),
        Check("B success within 10% of B alone", f"{b_mixed.success_rate:.1%} vs {b_alone.success_rate:.1%}",
              b_mixed.success_rate >= 0.9 * b_alone.success_rate),
        Check("device busy >= 95% with A and B", f"{_busy(mixed):.1%}", _busy(mixed) >= 0.95),
        Check("A gets the rest of the device", f"A {a_mixed.completed_per_s:.0f}/s, device share "
              f"{shares.get('A', 0.0):.1%}; B {b_mixed.completed_per_s:.0f}/s",
              a_mixed.completed_per_s + b_mixed.completed_per_s >= 0.9 * m.capacity_per_s),
    ]


def _priority_mix_checks(m: Measured) -> list[Check]:
    alone, mixed = m.phases["interactive alone"], m.phases["with batch flood"]
    i_alone, i_mixed, flood = alone.by_tenant["online"], mixed.by_tenant["online"], mixed.by_tenant["offline"]
    remaining = m.capacity_per_s - i_mixed.completed_per_s
    return [
        Check("interactive p99 within 10% of alone", f"{_p99(i_mixed):.1f} vs {_p99(i_alone):.1f} ms "
              f"({_p99(i_mixed) / _p99(i_alone):.2f}x)", _within(_p99(i_mixed), _p99(i_alone), 0.10)),
        Check("interactive success as alone", f"{i_mixed.success_rate:.1%} vs {i_alone.success_rate:.1%}",
              i_mixed.success_rate >= 0.99 * i_alone.success_rate),
        Check("batch class >= 80% of the remaining capacity",
              f"{flood.completed_per_s:.0f}/s of {remaining:.0f}/s = {flood.completed_per_s / remaining:.1%}",
              flood.completed_per_s >= 0.8 * remaining),
    ]


def _weights_checks(m: Measured) -> list[Check]:
    phase = m.phases["saturating"]
    shares = phase.server.device_shares() if phase.server else {}
    weights = {"w1": 1.0, "w2": 2.0, "w4": 4.0}
    total = sum(weights.values())
    checks = []
    for tenant, weight in weights.items():
        target = weight / total
        share = shares.get(tenant, 0.0)
        checks.append(Check(f"{tenant} device share {target:.3f} +-5%", f"{share:.3f} ({share / target - 1:+.1%})",
                            abs(share / target - 1.0) <= 0.05))
    checks.append(Check("device busy >= 95%", f"{_busy(phase):.1%}", _busy(phase) >= 0.95))
    return checks


SCENARIOS: Mapping[str, Scenario] = {s.name: s for s in (
    Scenario("overload", "one tenant offers 3x the device's capacity",
             (TenantSpec("t"),), (Phase("3x", (Stream("t", 3.0),)),), _overload_checks),
    Scenario("noisy-neighbour", "equal weights; B at half its share alone, then A at 5x its share alongside",
             (TenantSpec("A"), TenantSpec("B")),
             (Phase("B alone", (Stream("B", 0.25),)), Phase("A and B", (Stream("A", 2.5), Stream("B", 0.25)))),
             _noisy_checks),
    Scenario("priority-mix", "interactive at 30% of capacity alone, then with a batch-class flood (2x capacity)",
             (TenantSpec("online", priority=Priority.INTERACTIVE),
              TenantSpec("offline", priority=Priority.BATCH, timeout_slos=4.0)),
             (Phase("interactive alone", (Stream("online", 0.3),)),
              Phase("with batch flood", (Stream("online", 0.3), Stream("offline", 2.0)))),
             _priority_mix_checks),
    Scenario("weights", "three tenants with weights 1:2:4, each offering the whole capacity",
             (TenantSpec("w1", 1.0), TenantSpec("w2", 2.0), TenantSpec("w4", 4.0)),
             (Phase("saturating", (Stream("w1", 1.0), Stream("w2", 1.0), Stream("w4", 1.0))),),
             _weights_checks),
)}
