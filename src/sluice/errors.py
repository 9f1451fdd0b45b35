"""The one exception tree of sluice.

    SluiceError
     ├── ConfigError             configuration or model repository is invalid
     ├── InvalidInput            the client sent something malformed            -> 400
     │    ├── PayloadTooLarge    request body over the limit                     -> 413
     │    ├── UnsupportedEncoding a Content-Encoding it does not decode          -> 415
     │    ├── NotSupported       a protocol feature sluice does not offer        -> 501
     │    ├── ItemFailed         an input item was rejected by the model         -> 422
     │    └── UpstreamRefused    an upstream server refused the request          -> its 4xx
     ├── Unauthenticated         no API key, or one that matches no tenant       -> 401
     ├── PermissionDenied        the key may not use this route                  -> 403
     │    └── ModelNotPermitted  the tenant may not use this model
     ├── NotFound                no such route or resource                       -> 404
     │    └── ModelNotFound      no such model or version
     │         └── ModelRefused  it is in the repository but failed to load (final)
     ├── RateLimited             a tenant's limit is reached                     -> 429
     │    └── BudgetExhausted    its device-second budget is spent (do not retry)
     ├── Unavailable             the service cannot take this request now        -> 503
     │    ├── ModelNotReady      no ready replica serves the model
     │    ├── ModelVersionUnavailable no version of the model's traffic split is served
     │    ├── Overloaded         queued work would make it miss its deadline
     │    ├── WorkerLost         the worker died while the request was running
     │    └── ShuttingDown       the server stopped, its drain grace period over
     └── DeadlineExceeded        the deadline passed before the result was ready -> 504

Expected outcomes inside the core (a rejected admission, a full queue) are values; these
exceptions exist for the boundary, where `sluice.api.errors` maps them to HTTP statuses in one table.
"""

from __future__ import annotations


class SluiceError(Exception):
    """Base of every error sluice raises on purpose. `model_version`: the version of the model a
    request was routed to when it failed there (answered as `x-sluice-model-version`)."""

    model_version: str | None = None

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


class IdempotencyKeyReused(InvalidInput):
    """The `Idempotency-Key` was first used for a different request (409)."""


class Conflict(InvalidInput):
    """The request cannot be done in the current state of what it changes (409), e.g. a second canary."""


class PayloadTooLarge(InvalidInput):
    """The request body is larger than the configured limit."""


class UnsupportedEncoding(InvalidInput):
    """The request body is compressed with a `Content-Encoding` sluice does not decode (not gzip or deflate)."""


class NotSupported(InvalidInput):
    """The request asks for a protocol feature sluice does not offer (Triton's shared-memory, trace
    or logging extensions). Counted as the client's (an `invalid` outcome, as a 400), but answered
    as Triton answers a feature it lacks: HTTP 501, gRPC UNIMPLEMENTED; a retry does not mend it."""


class ItemFailed(InvalidInput):
    """One input item could not be processed by the model (the rest of its batch still ran)."""


class UpstreamRefused(InvalidInput):
    """An upstream server (`openai-upstream`) refused the client's request with a 4xx; the client
    sees that status and the upstream's message, as if it had asked the upstream itself."""

    def __init__(self, message: str, status: int, param: str | None = None) -> None:
        super().__init__(message, param)
        self.status = status


class Unauthenticated(SluiceError):
    """The request carries no API key, or one that belongs to no tenant."""


class PermissionDenied(SluiceError):
    """The key is known but may not use this route (an admin's, a tenant's on an admin route)."""


class ModelNotPermitted(PermissionDenied):
    """The tenant is known but may not use this model."""


class NotFound(SluiceError):
    """The route or resource does not exist. `param` names the field that named it, when one did."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(NotFound):
    """The named model (or version) does not exist."""


class ModelRefused(ModelNotFound):
    """The model (or version) is in the repository but was refused at load (a checksum mismatch,
    a bad `model.toml`, a runner that failed to load it); the message says why. Final: it will
    not become ready until the repository is fixed and the server restarted."""


class Unavailable(SluiceError):
    """The service cannot take the request now; `retry_after_s` says when it might."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelNotReady(Unavailable):
    """The model exists but no ready worker serves it."""


class ModelVersionUnavailable(Unavailable):
    """A request names no version, and none of the versions its model's traffic split names is
    served: it is refused rather than sent to a version the split does not name. Without a
    `retry_after_s` (no version of the split is being loaded) a retry does not help until an
    operator changes the split or loads a version (answered with `x-should-retry: false`)."""


class Overloaded(Unavailable):
    """Admitting the request would make it miss its deadline given the work queued ahead."""


class WorkerLost(Unavailable):
    """The worker executing the request died; the request may be retried."""


class ShuttingDown(Unavailable):
    """The server is shutting down (SIGTERM) and its grace period for requests in flight ended
    before this one did; the request may be retried elsewhere."""


class DeviceFailed(Unavailable):
    """The model's device (or upstream server) failed while running the request; not the input's fault."""


class DeadlineExceeded(SluiceError):
    """The request's deadline passed before a result was ready."""


class DeadlineUnreachable(DeadlineExceeded):
    """Even alone on an idle device the request would finish after its deadline: the same request
    sent again cannot succeed (answered 504 with `x-should-retry: false`)."""


class RateLimited(SluiceError):
    """A tenant's limit is reached. `limit` names it (requests, tokens, concurrency, credits);
    `headers` are the rate-limit headers to send (OpenAI's `x-ratelimit-*`)."""

    def __init__(self, message: str, limit: str, retry_after_s: float | None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.headers = headers or {}


class BudgetExhausted(RateLimited):
    """The tenant's device-second budget for the current period is spent; retrying before the
    period resets cannot succeed."""
