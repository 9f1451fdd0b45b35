"""How a background loop says that its store calls fail through a database outage.

A loop that calls the store every second or so, left to log each failure, writes a line (a full
traceback, even) per round for as long as the database is down. `OutageLog` says it in a few:

    failed    ─▶ WARNING  "<what>: the job store cannot be reached, retrying: <the error, one line>"
    failed ...   (nothing more, until remind_s have passed since the last warning)
    failed    ─▶ WARNING  "<what>: the job store still cannot be reached after N s: <the error>"
    succeeded ─▶ INFO     "<what>: the job store is reachable again after N s"

Only the store being out of reach (`Unavailable`) is an outage; any other exception is a bug,
logged with its traceback each time it happens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sluice.errors import Unavailable

REMIND_S = 60.0
"""How often, at most, an outage that goes on is logged again."""


class OutageLog:
    def __init__(self, log: logging.Logger, what: str, remind_s: float = REMIND_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._what = what
        self._remind_s = remind_s
        self._clock = clock
        self._since: float | None = None
        """When the outage began (None: the store answers)."""
        self._said_at = 0.0

    def failed(self, exc: Exception, bug: str) -> None:
        """A store call failed: the store out of reach is logged when the outage begins, then at
        most every `remind_s`; anything else is a bug, logged as `bug` with its traceback."""
        if not isinstance(exc, Unavailable):
            self._log.error(bug, exc_info=exc)
            return
        now = self._clock()
        if self._since is None:
            self._since = self._said_at = now
            self._log.warning("%s: the job store cannot be reached, retrying: %s", self._what, one_line(exc))
        elif now - self._said_at >= self._remind_s:
            self._said_at = now
            self._log.warning("%s: the job store still cannot be reached after %.0f s: %s", self._what,
                              now - self._since, one_line(exc))

    def succeeded(self) -> None:
        """A store call (a round of them) succeeded: an outage, if there was one, is over."""
        if self._since is not None:
            self._log.info("%s: the job store is reachable again after %.0f s", self._what,
                           self._clock() - self._since)
            self._since = None


def one_line(exc: Unavailable) -> str:
    """The error, and the first line of what caused it (the database driver's reason), on one line."""
    cause = exc.__cause__
    reason = (str(cause).strip().splitlines() or [""])[0] if cause is not None else ""
    return f"{exc.message} ({type(cause).__name__}: {reason})" if cause is not None else exc.message
