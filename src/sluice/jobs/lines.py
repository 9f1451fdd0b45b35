"""Output- and error-file lines, built from a response without re-encoding its body.

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"}, "error": null}
    {"id": ..., "custom_id": ..., "response": {...} | null, "error": {"code", "message"}}
"""

from __future__ import annotations

import secrets

import msgspec

_encode = msgspec.json.encode


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _ErrorBody(msgspec.Struct):
    code: str | None = None
    message: str | None = None


class _Answer(msgspec.Struct):
    usage: _Usage | None = None
    error: _ErrorBody | None = None


_decode_answer = msgspec.json.Decoder(_Answer).decode


def _json_body(body: bytes) -> bytes:
    """The body as JSON: sluice's endpoints answer JSON; anything else is carried as a string."""
    try:
        msgspec.json.decode(body)
    except msgspec.DecodeError:
        return _encode(body.decode("utf-8", "replace"))
    return body


def response_line(custom_id: str, status_code: int, request_id: str, body: bytes,
                  error: dict[str, str] | None) -> bytes:
    return b"".join((
        b'{"id":', _encode(f"batch_req_{secrets.token_hex(12)}"), b',"custom_id":', _encode(custom_id),
        b',"response":{"status_code":', str(status_code).encode(), b',"request_id":', _encode(request_id),
        b',"body":', _json_body(body) if body else b"null", b'},"error":', _encode(error), b"}\n",
    ))


def error_only_line(custom_id: str, code: str, message: str) -> bytes:
    return b"".join((b'{"id":', _encode(f"batch_req_{secrets.token_hex(12)}"), b',"custom_id":',
                     _encode(custom_id), b',"response":null,"error":', _encode({"code": code, "message": message}),
                     b"}\n"))


def read_answer(body: bytes) -> tuple[int, int, dict[str, str] | None]:
    """(input tokens, output tokens, the error's code and message) from a response body."""
    try:
        answer = _decode_answer(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0, 0, None
    usage = answer.usage or _Usage()
    error = None
    if answer.error is not None:
        error = {"code": answer.error.code or "error", "message": answer.error.message or ""}
    return usage.prompt_tokens, usage.completion_tokens, error
