"""Small helpers shared by the protocol modules: bounded body reads and request deadlines."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from sluice.errors import InvalidInput, PayloadTooLarge

TIMEOUT_HEADER = "x-request-timeout-ms"


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The request body, refusing more than `limit_bytes` before reading it all."""
    declared = parse_count(request.headers.get("content-length", ""))
    if declared is not None and declared > limit_bytes:
        raise PayloadTooLarge(f"request body of {declared} bytes is over the {limit_bytes}-byte limit")
    chunks = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit_bytes:
                raise PayloadTooLarge(f"request body is over the {limit_bytes}-byte limit")
            chunks.append(chunk)
    except ClientDisconnect as exc:  # nobody will read the answer; this only keeps it out of the bug log
        raise InvalidInput("the client disconnected before sending the whole body") from exc
    return b"".join(chunks)


def parse_count(raw: str) -> int | None:
    """A header's non-negative integer (ASCII digits only: `str.isdigit` also accepts `²`)."""
    if not raw or len(raw) > 18 or not (raw.isascii() and raw.isdigit()):
        return None
    return int(raw)


def header_timeout_s(request: Request) -> float | None:
    """The client's deadline from `X-Request-Timeout-Ms`, if it sent one."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        timeout_ms = float(raw)
    except ValueError:
        raise InvalidInput(f"{TIMEOUT_HEADER} must be a number of milliseconds, got {raw[:32]!r}",
                           param=TIMEOUT_HEADER) from None
    if not 0 < timeout_ms <= 3_600_000:
        raise InvalidInput(f"{TIMEOUT_HEADER} must be in (0, 3600000]", param=TIMEOUT_HEADER)
    return timeout_ms / 1000.0


def request_id(request: Request) -> str:
    return str(request.scope.get("sluice.request_id", ""))


TENANT_SCOPE_KEY = "sluice.tenant"
"""ASGI scope key holding the authenticated tenant's name, set by the auth middleware (or, for
batch-job items run in-process, by the job executor). Never read from a client header."""


def request_tenant(request: Request) -> str:
    """The tenant this request is served for: "" is the single local tenant (no tenants file)."""
    return str(request.scope.get(TENANT_SCOPE_KEY, ""))
