"""Predicted waits under fair sharing: the estimate admission uses, and what the worker reports.

Within a class, tenants share the device by weight (`fair.py`). Under generalized processor
sharing, while tenant i works through W_i device-seconds of its own, a backlogged tenant j gets
`W_i * w_j / w_i` device-seconds, or all of its queued work Q_j if that is less. So of the class's
queued work, what does *not* run before i's last item is

    excess_i = sum over j != i of max(0, Q_j - W_i * w_j / w_i)

and a flooding tenant j is refused on its own backlog (excess_j is small: nobody else has much
queued) while a well-behaved tenant i of the same class still gets in (excess_i holds j's flood).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sluice.priority import Priority

__all__ = ["ClassWait", "TenantWait", "WaitReport", "fair_excess_s"]


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
