"""Fair sharing of one device: between priority classes, and between tenants within a class.

    class INTERACTIVE ─┐ strict priority, except that a backlogged lower class owed its minimum
    class STANDARD   ──┤ share goes first (`ClassShares`)
    class BATCH      ──┘
         │
         └─ per class: start-time fair queueing over tenants (`FairShare`)
              tenant "a"  tag 3.20  ─┐  the backlogged tenant with the smallest tag goes next;
              tenant "b"  tag 3.05  ─┼▶ its earliest-deadline item heads the batch, and each item
              tenant "c"  idle      ─┘  taken adds (its device-seconds / the tenant's weight) to the tag

The bookkeeping does not care what a unit of work is: the batcher (`backlog.py`) charges
device-seconds, the upstream slot queue (`slots.py`) seconds a call held its slot, and the
generative engine's scheduler (`sluice.engines.generative.scheduler`) tokens computed.

Tenant tags are in virtual seconds: device-seconds divided by weight. Each item is charged its
predicted device time when it joins a batch, and that charge is replaced by the measured time (the
batch's execution time split by cost) when the batch completes, so shares follow measured device
time whatever a tenant's request sizes or rates.

Bounded banking: a class's virtual time `v` is the tag of the last tenant chosen to head a batch,
which is the smallest tag of any backlogged tenant then. A tenant that becomes backlogged again
starts at `max(its tag, v)`, so idling earns it nothing: before every other backlogged tenant j has
been served again it gets at most `weight_i * max_j(C_j / weight_j)` device-seconds, C_j being the
largest charge j took in one batch (one batch's worth of lead, never a burst saved up while idle).

Starvation bound between classes: a lower class c with `min_share_c > 0` accrues `min_share_c * T`
of credit for every batch of T device-seconds that runs while it is backlogged, and spends the
device time it gets (leading a batch or riding in one). Credit below `-(its last service)` is
forgotten (no banking from idle periods either), and a backlogged class whose credit is positive
heads the next batch. So a backlogged class never waits more than `B_c / min_share_c + B`
device-seconds for service, B_c its last service and B the longest batch, and over a long
backlog gets at least `min_share_c` of the device. (A caller that records service in pieces
smaller than a unit of it keeps debt down to `max_debt_s` instead: B_c is then at most that.)

Pure bookkeeping: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sluice.priority import Priority

__all__ = ["DEFAULT_MIN_CLASS_SHARES", "ClassShares", "FairShare", "TenantStats"]

DEFAULT_MIN_CLASS_SHARES: Mapping[Priority, float] = {Priority.STANDARD: 0.1, Priority.BATCH: 0.05}


@dataclass(frozen=True, slots=True)
class TenantStats:
    """One tenant's standing in one class: values a worker can export as metrics."""

    tenant: str
    priority: Priority
    num_queued: int
    queued_s: float
    """Predicted device-seconds of its queued items."""
    device_s: float
    """Measured device-seconds its items have used, in total."""


class _Tenant:
    __slots__ = ("device_s", "num_queued", "queued_s", "tag")

    def __init__(self, tag: float) -> None:
        self.tag = tag
        self.num_queued = 0
        self.queued_s = 0.0
        self.device_s = 0.0


class _Class:
    __slots__ = ("tenants", "vtime")

    def __init__(self) -> None:
        self.vtime = 0.0
        self.tenants: dict[str, _Tenant] = {}


class FairShare:
    """Per class, each tenant's fair-queueing tag, queued work and device time used."""

    def __init__(self) -> None:
        self._classes = {priority: _Class() for priority in Priority}
        self._weights: dict[str, float] = {}
        self._default_weight = 1.0

    # -- weights -------------------------------------------------------------------------------

    def set_weights(self, weights: Mapping[str, float], *, default_weight: float = 1.0) -> None:
        """Replace every tenant's weight; tenants not named get `default_weight`."""
        for name, weight in [*weights.items(), ("(default)", default_weight)]:
            if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
                raise ValueError(f"tenant weight for {name!r} must be a positive number; got {weight!r}")
        self._weights = {str(name): float(weight) for name, weight in weights.items()}
        self._default_weight = float(default_weight)

    @property
    def default_weight(self) -> float:
        return self._default_weight

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, self._default_weight)

    # -- queued work ---------------------------------------------------------------------------

    def enqueue(self, priority: Priority, tenant: str, work_s: float) -> None:
        state = self._state(priority, tenant)
        if state.num_queued == 0:
            self.activate(priority, tenant)
        state.num_queued += 1
        state.queued_s += work_s

    def activate(self, priority: Priority, tenant: str) -> None:
        """`tenant` has work waiting in the class again after none: its tag starts no lower than
        the class's virtual time (bounded banking). `enqueue` does it; a caller that keeps its own
        queue (the generative engine's scheduler) calls it when a tenant's queue stops being empty."""
        cls = self._classes[priority]
        state = self._state(priority, tenant)
        state.tag = max(state.tag, cls.vtime)

    def dequeue(self, priority: Priority, tenant: str, work_s: float) -> None:
        state = self._classes[priority].tenants[tenant]
        state.num_queued -= 1
        state.queued_s = state.queued_s - work_s if state.num_queued else 0.0

    def is_backlogged(self, priority: Priority) -> bool:
        return any(state.num_queued for state in self._classes[priority].tenants.values())

    def backlogged(self, priority: Priority) -> list[str]:
        """Tenants with queued items in the class, smallest tag first."""
        tenants = self._classes[priority].tenants
        return sorted((name for name, state in tenants.items() if state.num_queued),
                      key=lambda name: tenants[name].tag)

    def num_queued(self, priority: Priority, tenant: str) -> int:
        state = self._classes[priority].tenants.get(tenant)
        return state.num_queued if state is not None else 0

    def queued_s(self, priority: Priority, tenant: str | None = None) -> float:
        """Predicted device-seconds queued in a class, or by one tenant in it."""
        tenants = self._classes[priority].tenants
        if tenant is not None:
            state = tenants.get(tenant)
            return state.queued_s if state is not None else 0.0
        return sum(state.queued_s for state in tenants.values())

    def queued_by_tenant(self, priority: Priority) -> dict[str, float]:
        return {name: state.queued_s for name, state in self._classes[priority].tenants.items()
                if state.num_queued}

    # -- service -------------------------------------------------------------------------------

    def tag(self, priority: Priority, tenant: str) -> float:
        return self._classes[priority].tenants[tenant].tag

    def start(self, priority: Priority, tenant: str) -> None:
        """`tenant` heads the next batch: the class's virtual time moves up to its tag."""
        cls = self._classes[priority]
        cls.vtime = max(cls.vtime, cls.tenants[tenant].tag)

    def charge(self, priority: Priority, tenant: str, device_s: float) -> None:
        """Advance a tenant's tag by `device_s` of (predicted or corrective) device time."""
        self._classes[priority].tenants[tenant].tag += device_s / self.weight(tenant)

    def account(self, priority: Priority, tenant: str, predicted_s: float, measured_s: float) -> None:
        """A batch completed: replace the predicted charge with the measured device time."""
        state = self._classes[priority].tenants[tenant]
        state.tag += (measured_s - predicted_s) / self.weight(tenant)
        state.device_s += measured_s

    def stats(self) -> tuple[TenantStats, ...]:
        return tuple(
            TenantStats(name, priority, state.num_queued, max(state.queued_s, 0.0), state.device_s)
            for priority, cls in self._classes.items()
            for name, state in sorted(cls.tenants.items())
        )

    def _state(self, priority: Priority, tenant: str) -> _Tenant:
        cls = self._classes[priority]
        state = cls.tenants.get(tenant)
        if state is None:
            state = cls.tenants[tenant] = _Tenant(cls.vtime)
        return state


class ClassShares:
    """Strict priority between classes, with a minimum share of device time for lower classes."""

    def __init__(self, min_shares: Mapping[Priority, float] = DEFAULT_MIN_CLASS_SHARES, *,
                 max_debt_s: float = 0.0) -> None:
        """`max_debt_s`: credit down to `-max(max_debt_s, last service)` is kept. 0 (a batch is
        one unit of service) suits the batcher; a caller whose service comes in small pieces (the
        generative engine, one step's tokens at a time, for sequences that run many steps) gives
        a bound of about one unit, or a class's debt would be forgiven piece by piece."""
        for priority, share in min_shares.items():
            if not (0.0 <= share < 1.0):
                raise ValueError(f"the minimum share of class {Priority(priority).label} must be in [0, 1)")
        if not max_debt_s >= 0.0:
            raise ValueError("max_debt_s must not be negative")
        self._min_shares = {Priority(p): float(s) for p, s in min_shares.items() if s > 0}
        self._credit_s = dict.fromkeys(self._min_shares, 0.0)
        self._max_debt_s = max_debt_s

    def order(self, backlogged: Iterable[Priority]) -> list[Priority]:
        """Classes to try, in order: an owed lower class first, then by priority."""
        ranked = sorted(backlogged)
        owed = [p for p in ranked[1:] if self._credit_s.get(p, 0.0) > 0]
        return owed[:1] + [p for p in ranked if p not in owed[:1]]

    def record(self, exec_s: float, served_s: Mapping[Priority, float], backlogged: Iterable[Priority]) -> None:
        """A batch of `exec_s` device-seconds ran, giving each class `served_s` of it."""
        waiting = set(backlogged)
        for priority, share in self._min_shares.items():
            served = served_s.get(priority, 0.0)
            if priority not in waiting and not served:
                self._credit_s[priority] = 0.0  # idle: no credit either way
                continue
            credit = self._credit_s[priority] + share * exec_s - served
            self._credit_s[priority] = max(credit, -max(served, self._max_debt_s)) if served else credit

    def credit_s(self, priority: Priority) -> float:
        return self._credit_s.get(priority, 0.0)

    def min_share(self, priority: Priority) -> float:
        return self._min_shares.get(priority, 0.0)
