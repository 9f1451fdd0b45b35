"""The access log: one JSON line on stderr per finished request (`logs.write_access`).

    {"time": ..., "level": "INFO", "logger": "sluice.access", "process": "gateway", "message": "request",
     "method": "POST", "path": "/v1/chat/completions", "status": 200, "duration_ms": 12.3,
     "request_id": "...", "tenant": "acme", "model": "tiny", "model_version": "1",
     "protocol": "openai", "outcome": "ok"}

- `path` is without its query string; `protocol` is `openai` (`/v1`), `kserve` (`/v2`), `grpc`
  (KServe over gRPC, every RPC: `method` is the RPC, `grpc_status` its code) or `http` (admin, metrics).
- `status` is the HTTP status answered (for gRPC, the HTTP status of the same error); 499 (as
  nginx logs it) when the client went away before its answer was written.
- `outcome`: `ok`; `cancelled` (the client went away: before its answer, or during a stream);
  `invalid` (a 4xx for the request itself), `unauthenticated` (401), `denied` (403), `not_found`
  (404), `rate_limited` (429: a tenant's limit), `rejected` (503: overload), `unavailable` (another
  503), `expired` (504), `error` (500 or another 5xx). A stream ended by an error event after its
  200 head (`common.stream_failed`) keeps `status` 200, with its error's outcome.
- `tenant` is the authenticated tenant (`local` without a tenants file; null before authentication),
  `model` and `model_version` the version the request was routed to (the requested model when
  it was refused before that; null for routes of no model).

The HTTP protocol's own refusals (`refused`: a head too large or too slow, bytes that are not
HTTP, a body too slow) are logged too, with what of the request was read.

Never the body (prompt or inputs), the query string, or a header's value but `x-request-id`'s.
Only requests that came through the server are logged: not a batch job's items, run in-process.
`--no-access-log` turns it off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.types import Scope

from sluice import logs, wire
from sluice.api.common import (
    GONE_SCOPE_KEY,
    MODEL_SCOPE_KEY,
    RECEIVED_AT_SCOPE_KEY,
    STREAM_ERROR_SCOPE_KEY,
    TENANT_SCOPE_KEY,
)
from sluice.api.errors import CAPACITY_LIMIT, LIMIT_HEADER, error_headers, status_of

CANCELLED_STATUS = 499
"""Logged when the client went away before its answer was written (nginx's "client closed request")."""

_OUTCOMES = {401: "unauthenticated", 403: "denied", 404: "not_found", 429: "rate_limited", 499: "cancelled",
             504: "expired"}


def outcome_of(status: int, limit: str | None = None) -> str:
    """What an answer's status says happened (`limit`: its `x-sluice-limit`, which tells an
    overload's 503 from another)."""
    if status < 400:
        return "ok"
    named = _OUTCOMES.get(status)
    if named is not None:
        return named
    if status == 503:
        return "rejected" if limit == CAPACITY_LIMIT else "unavailable"
    return "invalid" if status < 500 else "error"


def outcome_of_error(error: Exception) -> str:
    """What an error says happened: the outcome of the status it would have been answered with."""
    return outcome_of(status_of(error).http, error_headers(error).get(LIMIT_HEADER))


def protocol_of(path: str) -> str:
    if path.startswith("/v1/") or path == "/v1":
        return "openai"
    if path.startswith("/v2/") or path == "/v2":
        return "kserve"
    return "http"


class AccessLog:
    """Writes the lines; the HTTP paths (`api.app`) and the gRPC servicer (`api.kserve_grpc`) call it."""

    def __init__(self, now: Callable[[], float]) -> None:
        """`now`: the clock the HTTP protocol stamps arrivals with (the gateway's)."""
        self._now = now

    def is_logged(self, scope: Scope) -> bool:
        """A request that came through the HTTP server (not a batch job's item, run in-process)."""
        return RECEIVED_AT_SCOPE_KEY in scope

    def http(self, scope: Scope, status: int, limit: str | None = None) -> None:
        """A finished HTTP request, answered `status` (`CANCELLED_STATUS`: not answered)."""
        received_at = scope.get(RECEIVED_AT_SCOPE_KEY)
        if received_at is None:
            return
        failed = scope.get(STREAM_ERROR_SCOPE_KEY)
        if scope.get(GONE_SCOPE_KEY):
            outcome = "cancelled"
        elif failed is not None and status < 400:  # answered 200, then ended by an error event
            outcome = outcome_of_error(failed)
        else:
            outcome = outcome_of(status, limit)
        path = scope["path"]
        model, version = _model_of(scope)
        tenant = scope.get(TENANT_SCOPE_KEY)
        logs.write_access({
            "method": scope["method"], "path": path, "status": status,
            "duration_ms": round((self._now() - received_at) * 1000, 3),
            "request_id": scope.get("sluice.request_id"), "tenant": None if tenant is None else tenant or "local",
            "model": model, "model_version": version, "protocol": protocol_of(path), "outcome": outcome,
        })

    def refused(self, scope: Scope, status: int) -> None:
        """A refusal the HTTP protocol wrote itself, no app having seen the request (a 400 for
        bytes it cannot parse, a 408, 431 or 501): its method and path when its head was read
        that far, else null; `invalid`, the client's doing."""
        path = scope.get("path")
        received_at = scope.get(RECEIVED_AT_SCOPE_KEY)
        logs.write_access({
            "method": scope.get("method"), "path": path, "status": status,
            "duration_ms": None if received_at is None else round((self._now() - received_at) * 1000, 3),
            "request_id": None, "tenant": None, "model": None, "model_version": None,
            "protocol": "http" if path is None else protocol_of(path), "outcome": "invalid",
        })

    def grpc(self, rpc: str, status: int, grpc_status: str, *, request_id: str, tenant: str | None,
             model: str | None, version: str | None, started: float, limit: str | None = None,
             outcome: str | None = None) -> None:
        """A finished gRPC request (`status`: the HTTP status of the same answer)."""
        logs.write_access({
            "method": rpc, "path": f"/inference.GRPCInferenceService/{rpc}", "status": status,
            "grpc_status": grpc_status, "duration_ms": round((self._now() - started) * 1000, 3),
            "request_id": request_id, "tenant": None if tenant is None else tenant or "local",
            "model": model or None, "model_version": version or None, "protocol": "grpc",
            "outcome": outcome or outcome_of(status, limit),
        })


def _model_of(scope: Scope) -> tuple[str | None, str | None]:
    """The model version the request was routed to, else the one its KServe path names."""
    info: Any = scope.get(MODEL_SCOPE_KEY)
    if isinstance(info, wire.ModelInfo):
        return info.name, info.version
    params = scope.get("path_params")
    if params:
        return params.get("name") or params.get("model"), params.get("version")
    return None, None
