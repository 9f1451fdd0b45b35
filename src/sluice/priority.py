"""Priority classes: which queued work goes to the device first.

    INTERACTIVE (0)  tight SLOs; never waits behind the other classes
    STANDARD    (1)  the default
    BATCH       (2)  asynchronous jobs: fills idle device time, yields to the others

A smaller value is more urgent. A tenant has a default class; a request may lower its class
(OpenAI's `service_tier`, or a `priority` field or header) but never raise it above the
tenant's default: see `effective_priority`.
"""

from __future__ import annotations

import enum

from sluice.errors import InvalidInput

__all__ = ["Priority", "effective_priority", "parse_priority", "priority_from_wire"]


class Priority(enum.IntEnum):
    INTERACTIVE = 0
    """Latency-critical requests; served first."""
    STANDARD = 1
    """Ordinary online requests."""
    BATCH = 2
    """Batch jobs and best-effort work; runs in the device time the others leave."""

    @property
    def label(self) -> str:
        return self.name.lower()


# OpenAI's service_tier values mapped onto our classes ("auto"/"default" keep the tenant's class;
# "priority" and "scale", OpenAI's faster tiers, ask for the most a tenant may have)
_ALIASES = {
    "interactive": Priority.INTERACTIVE,
    "priority": Priority.INTERACTIVE,
    "scale": Priority.INTERACTIVE,
    "standard": Priority.STANDARD,
    "batch": Priority.BATCH,
    "flex": Priority.BATCH,
}
_DEFAULTS = {"auto", "default", ""}


def parse_priority(value: str | None, param: str = "priority") -> Priority | None:
    """A class named by a client or a config file; `None` means "the tenant's default"."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidInput(f"'{param}' must be a string", param=param)
    name = value.strip().lower()
    if name in _DEFAULTS:
        return None
    if name not in _ALIASES:
        choices = ", ".join(sorted(_ALIASES | dict.fromkeys(_DEFAULTS - {""})))
        raise InvalidInput(f"'{param}' must be one of {choices}; got {value!r}", param=param)
    return _ALIASES[name]


def priority_from_wire(value: int) -> Priority:
    """The class a gateway sent (`wire`'s int); an unknown value (a newer gateway's) counts as standard."""
    try:
        return Priority(value)
    except ValueError:
        return Priority.STANDARD


def effective_priority(default: Priority, requested: Priority | None) -> Priority:
    """A request may lower its tenant's class, never raise it."""
    return default if requested is None else max(default, requested)
