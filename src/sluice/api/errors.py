"""The one table from core errors to HTTP, in both protocols' error shapes.

OpenAI: `{"error": {"message", "type", "param", "code"}}`; KServe v2: `{"error": "..."}`.
Overload and rate-limit answers carry `Retry-After` (whole seconds, at least 1) and `retry-after-ms`;
rate-limit answers also OpenAI's `x-ratelimit-*` headers and a `code` naming the limit
(`requests_limit_exceeded`, `tokens_limit_exceeded`, `concurrency_limit_exceeded`,
`background_limit_exceeded` (too many unanswered background responses), or
`insufficient_quota` with `x-should-retry: false` for a spent device-second budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.responses import Response

from sluice.errors import (
    BudgetExhausted,
    Conflict,
    DeadlineExceeded,
    DeadlineUnreachable,
    IdempotencyKeyReused,
    InvalidInput,
    ItemFailed,
    ModelNotFound,
    ModelNotPermitted,
    ModelNotReady,
    ModelRefused,
    ModelVersionUnavailable,
    NotFound,
    NotSupported,
    Overloaded,
    PayloadTooLarge,
    PermissionDenied,
    RateLimited,
    ShuttingDown,
    SluiceError,
    Unauthenticated,
    Unavailable,
    UnsupportedEncoding,
    UpstreamRefused,
    WorkerLost,
)


@dataclass(frozen=True, slots=True)
class Status:
    http: int
    type: str
    code: str


# Most specific first: the first matching row wins.
_TABLE: tuple[tuple[type[SluiceError], Status], ...] = (
    (PayloadTooLarge, Status(413, "invalid_request_error", "payload_too_large")),
    (UnsupportedEncoding, Status(415, "invalid_request_error", "unsupported_content_encoding")),
    (IdempotencyKeyReused, Status(409, "invalid_request_error", "idempotency_key_reused")),
    (Conflict, Status(409, "invalid_request_error", "conflict")),
    (NotSupported, Status(501, "invalid_request_error", "not_supported")),
    (ItemFailed, Status(422, "invalid_request_error", "item_failed")),
    (UpstreamRefused, Status(400, "invalid_request_error", "upstream_refused")),  # with the upstream's status
    (InvalidInput, Status(400, "invalid_request_error", "invalid_request")),
    (Unauthenticated, Status(401, "invalid_request_error", "invalid_api_key")),
    (ModelNotPermitted, Status(403, "invalid_request_error", "model_not_permitted")),
    (PermissionDenied, Status(403, "invalid_request_error", "permission_denied")),
    (BudgetExhausted, Status(429, "insufficient_quota", "insufficient_quota")),
    (RateLimited, Status(429, "rate_limit_exceeded", "rate_limit_exceeded")),
    (ModelRefused, Status(404, "invalid_request_error", "model_load_failed")),
    (ModelNotFound, Status(404, "invalid_request_error", "model_not_found")),
    (NotFound, Status(404, "invalid_request_error", "not_found")),
    (Overloaded, Status(503, "server_overloaded", "overloaded")),
    (ModelNotReady, Status(503, "server_error", "model_not_ready")),
    (ModelVersionUnavailable, Status(503, "server_error", "model_version_unavailable")),
    (WorkerLost, Status(503, "server_error", "worker_lost")),
    (ShuttingDown, Status(503, "server_error", "server_shutting_down")),
    (Unavailable, Status(503, "server_error", "unavailable")),
    (DeadlineExceeded, Status(504, "timeout", "deadline_exceeded")),
)
_INTERNAL = Status(500, "server_error", "internal_error")


def response_error_code(code: str, http_status: int | None = None) -> str:
    """A failed Responses object's `error.code`, one of the values OpenAI's API uses there, for
    an error answered with this `code` (ours) and HTTP status: `rate_limit_exceeded` for a
    tenant's limit, `invalid_prompt` for the client's input, else `server_error`."""
    kinds = {status.code: status for _, status in _TABLE}
    status = kinds.get(code)
    http = http_status or (status.http if status else 500)
    if http == 429 or code.endswith("_limit_exceeded"):
        return "rate_limit_exceeded"
    return "invalid_prompt" if 400 <= http < 500 else "server_error"


def status_of(error: Exception) -> Status:
    for kind, status in _TABLE:
        if isinstance(error, kind):
            if isinstance(error, UpstreamRefused) and 400 <= error.status < 500:
                return Status(error.status, status.type, status.code)
            return status
    return _INTERNAL


def error_body(error: Exception, protocol: str = "openai") -> dict[str, Any]:
    """The error object a client sees, in the protocol's shape (also sent as an SSE event)."""
    status = status_of(error)
    message = error.message if isinstance(error, SluiceError) else "internal server error"
    if protocol == "kserve":
        return {"error": message}
    code = status.code
    if isinstance(error, RateLimited) and not isinstance(error, BudgetExhausted):
        code = f"{error.limit}_limit_exceeded"  # which limit: requests, tokens, concurrency
    param = getattr(error, "param", None)
    return {"error": {"message": message, "type": status.type, "param": param, "code": code}}


LIMIT_HEADER = "x-sluice-limit"
"""On a 429: which of the tenant's limits refused it (requests, tokens, concurrency, credits), in
both protocols (a KServe error body has no code to say it); on an overload's 503, `capacity`: the
work queued ahead, not a fault (a batch job's executor paces its items to it)."""
CAPACITY_LIMIT = "capacity"


def protocol_of(path: str) -> str:
    """Which protocol's error shape a request's answer takes: KServe's under `/v2`, else OpenAI's."""
    return "kserve" if path.startswith("/v2") else "openai"


def error_json(message: str, code: str, protocol: str) -> bytes:
    """The body of a refusal made below the application (`api.http_protocol`: a request's framing
    or its body's timeout), in the protocol's error shape."""
    if protocol == "kserve":
        return msgspec.json.encode({"error": message})
    return msgspec.json.encode({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                          "code": code}})


def error_headers(error: Exception) -> dict[str, str]:
    """What an error's answer says beside its body: when to retry (`Retry-After` in whole seconds,
    at least 1, and `retry-after-ms`), on a 429 which limit and OpenAI's `x-ratelimit-*` (on an
    overload's 503, the limit `capacity`), and the model version the request was routed to if it
    failed there (`x-sluice-model-version`)."""
    headers = {**error.headers, LIMIT_HEADER: error.limit} if isinstance(error, RateLimited) else {}
    if isinstance(error, Overloaded):
        headers[LIMIT_HEADER] = CAPACITY_LIMIT
    if isinstance(error, DeadlineUnreachable) or (isinstance(error, ModelVersionUnavailable)
                                                  and error.retry_after_s is None):
        headers["x-should-retry"] = "false"  # the openai SDK would retry a 504 (or 503) twice, in vain
    if isinstance(error, SluiceError) and error.model_version is not None:
        headers["x-sluice-model-version"] = error.model_version  # which version failed (a canary's?)
    retry_after_s = getattr(error, "retry_after_s", None)
    if retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(retry_after_s)))
        headers["retry-after-ms"] = str(max(1, math.ceil(retry_after_s * 1000)))
    return headers


def error_response(error: Exception, protocol: str, request_id: str | None = None) -> Response:
    status = status_of(error)
    body = msgspec.json.encode(error_body(error, protocol))
    headers = error_headers(error)
    if request_id:
        headers["x-request-id"] = request_id
    return Response(body, status_code=status.http, media_type="application/json", headers=headers)
