"""Predicted waits under fair sharing: the estimate admission uses, and what the worker reports.

Within a class, tenants share the device by weight (`fair.py`). Under generalized processor
sharing, while tenant i works through W_i device-seconds of its own, a backlogged tenant j gets
`W_i * w_j / w_i` device-seconds, or all of its queued work Q_j if that is less. So of the class's
queued work, what does *not* run before i's last item is

    excess_i = sum over j != i of max(0, Q_j - W_i * w_j / w_i)

and a flooding tenant j is refused on its own backlog (excess_j is small: nobody else has much
queued) while a well-behaved tenant i of the same class still gets in (excess_i holds j's flood).

Work that has not arrived yet also runs before i's: a higher class's new requests, and those of a
tenant j of i's class whose queue drains before i's (it is below its share, so its new requests
get tags below i's). `DemandRates` measures each flow's demand in device-seconds per second; while
i waits W, such flows take `rho * W` of the device, so i's work ahead of A device-seconds takes
`A / (1 - rho)` (`jump_rate` gives rho). Without it, a tenant flooding next to a quiet one is
admitted as if it had the whole device and its requests expire in the queue when the quiet
tenant's requests go first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sluice.priority import Priority

__all__ = ["ClassWait", "DemandRates", "TenantWait", "WaitReport", "fair_excess_s", "jump_rate"]

MAX_JUMP_RATE = 0.9
"""Cap on the device fraction predicted to go to work arriving later: beyond it a prediction
would be all guess (and admit nothing)."""


@dataclass(frozen=True, slots=True)
class ClassWait:
    """For a tenant with nothing queued in `priority`."""

    priority: Priority
    newcomer_wait_s: float
    """Wall seconds before its first item can start: the running batch, higher classes' work."""
    backlogged_weight: float
    """Total weight of the class's backlogged tenants. Its own work of W device-seconds takes up
    to `W * (1 + backlogged_weight / its weight)`, sharing the device with them."""


@dataclass(frozen=True, slots=True)
class TenantWait:
    """For a tenant with work queued in `priority`."""

    tenant: str
    priority: Priority
    num_queued: int
    wait_s: float
    """Wall seconds until its queued work is predicted done."""


@dataclass(frozen=True, slots=True)
class WaitReport:
    classes: tuple[ClassWait, ...]
    tenants: tuple[TenantWait, ...]


def fair_excess_s(own_s: float, weight: float, others: Iterable[tuple[float, float]]) -> float:
    """Device-seconds of other tenants' queued work `(queued_s, weight)` that a fair share lets
    wait until after `own_s` of work of a tenant of weight `weight`."""
    return sum(max(queued_s - own_s * other_weight / weight, 0.0) for queued_s, other_weight in others)


class DemandRates:
    """Each flow's (class, tenant) admitted work in device-seconds per second: an exponentially
    decaying sum over the last ~`tau_s` seconds. Pure: the caller passes the time."""

    def __init__(self, tau_s: float = 1.0) -> None:
        self._tau_s = tau_s
        self._flows: dict[Priority, dict[str, tuple[float, float]]] = {p: {} for p in Priority}

    def add(self, priority: Priority, tenant: str, work_s: float, now: float) -> None:
        flows = self._flows[priority]
        flows[tenant] = (self._decayed(flows.get(tenant), now) + work_s, now)
        if len(flows) > 64:  # forget flows that have gone quiet
            for name in [t for t, v in flows.items() if self._decayed(v, now) < 1e-6]:
                del flows[name]

    def rates(self, priority: Priority, now: float) -> dict[str, float]:
        return {t: self._decayed(v, now) / self._tau_s for t, v in self._flows[priority].items()}

    def class_rate(self, priority: Priority, now: float) -> float:
        return sum(self.rates(priority, now).values())

    def _decayed(self, value: tuple[float, float] | None, now: float) -> float:
        if value is None:
            return 0.0
        total, at = value
        return total * math.exp(-max(now - at, 0.0) / self._tau_s)


def jump_rate(higher_classes_rate: float, own_s: float, weight: float, others: Mapping[str, tuple[float, float, float]],
              ) -> float:
    """The device fraction that work arriving from now on takes ahead of a tenant with `own_s` of
    work queued (its new request included) and weight `weight`: all of the higher classes' demand,
    and from each other tenant of its class `(queued_s, weight, demand_rate)` whose whole queue runs
    before (`queued_s <= own_s * its weight / weight`) its demand up to its pairwise fair share."""
    rate = higher_classes_rate
    for queued_s, other_weight, demand in others.values():
        if queued_s <= own_s * other_weight / weight:
            rate += min(demand, other_weight / (weight + other_weight))
    return min(rate, MAX_JUMP_RATE)
