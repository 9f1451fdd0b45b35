"""The gateway's settings (`GatewayConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_TIMEOUT_S = 600.0
"""The longest deadline a request may ask for; the API layer checks it against each source
(`X-Request-Timeout-Ms`, the KServe `timeout` parameter) so that the error names that source."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    max_timeout_s: float = MAX_TIMEOUT_S
    answer_grace_s: float = 5.0
    """How long past a deadline to wait for a silent worker before giving up on it."""
    redispatch_poll_s: float = 0.02
    prefix_affinity: bool = True
    """A generation goes to the replica that has its prompt's prefix cached, unless that one is
    busier (`router.PrefixAffinity`); False: by load alone."""
