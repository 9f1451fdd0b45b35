"""The one exception tree of sluice.

    SluiceError
     ├── ConfigError             configuration or model repository is invalid
     ├── InvalidInput            the client sent something malformed            -> 400
     │    ├── PayloadTooLarge    request body over the limit                     -> 413
     │    └── ItemFailed         an input item was rejected by the model         -> 422
     ├── NotFound                no such route or resource                       -> 404
     │    └── ModelNotFound      no such model or version
     ├── Unavailable             the service cannot take this request now        -> 503
     │    ├── ModelNotReady      no ready replica serves the model
     │    ├── Overloaded         queued work would make it miss its deadline
     │    └── WorkerLost         the worker died while the request was running
     └── DeadlineExceeded        the deadline passed before the result was ready -> 504

Expected outcomes inside the core (a rejected admission, a full queue) are values; these
exceptions exist for the boundary, where `sluice.api.errors` maps them to HTTP statuses in one table.
"""

from __future__ import annotations


class SluiceError(Exception):
    """Base of every error sluice raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class ConfigError(SluiceError):
    """A configuration file, flag or model repository entry is invalid."""


class InvalidInput(SluiceError):
    """The client's request is malformed. `param` names the offending field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PayloadTooLarge(InvalidInput):
    """The request body is larger than the configured limit."""


class ItemFailed(InvalidInput):
    """One input item could not be processed by the model (the rest of its batch still ran)."""


class NotFound(SluiceError):
    """The route or resource does not exist."""


class ModelNotFound(NotFound):
    """The named model (or version) does not exist."""


class Unavailable(SluiceError):
    """The service cannot take the request now; `retry_after_s` says when it might."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelNotReady(Unavailable):
    """The model exists but no ready worker serves it."""


class Overloaded(Unavailable):
    """Admitting the request would make it miss its deadline given the work queued ahead."""


class WorkerLost(Unavailable):
    """The worker executing the request died; the request may be retried."""


class DeadlineExceeded(SluiceError):
    """The request's deadline passed before a result was ready."""
