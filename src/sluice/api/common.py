"""Small helpers shared by the protocol modules: bounded body reads and request deadlines."""

from __future__ import annotations

from starlette.requests import Request

from sluice.errors import InvalidInput, PayloadTooLarge

TIMEOUT_HEADER = "x-request-timeout-ms"


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The request body, refusing more than `limit_bytes` before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise PayloadTooLarge(f"request body of {declared} bytes is over the {limit_bytes}-byte limit")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise PayloadTooLarge(f"request body is over the {limit_bytes}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def header_timeout_s(request: Request) -> float | None:
    """The client's deadline from `X-Request-Timeout-Ms`, if it sent one."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        timeout_ms = float(raw)
    except ValueError:
        raise InvalidInput(f"{TIMEOUT_HEADER} must be a number of milliseconds", param=TIMEOUT_HEADER) from None
    if not 0 < timeout_ms <= 3_600_000:
        raise InvalidInput(f"{TIMEOUT_HEADER} must be in (0, 3600000]", param=TIMEOUT_HEADER)
    return timeout_ms / 1000.0


def request_id(request: Request) -> str:
    return str(request.scope.get("sluice.request_id", ""))
