"""Output- and error-file lines, built from a response without re-encoding its body.

OpenAI's shapes: a request that got an answer, a success or a failure, carries it in `response`
(the failure's reason is in its body: OpenAI's `{"error": {...}}`, KServe's `{"error": "..."}`)
and `error: null`; a request that never got an answer (its batch was cancelled or expired, or
calling it broke) has `response: null` and the reason in `error`.

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"}, "error": null}
    {"id": ..., "custom_id": ..., "response": null, "error": {"code", "message"}}
"""

from __future__ import annotations

import secrets
from typing import NamedTuple

import msgspec

_encode = msgspec.json.encode


class _InputDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _OutputDetails(msgspec.Struct):
    reasoning_tokens: int | None = None


class _Usage(msgspec.Struct):
    """Completions' and chat's counts, or the Responses API's (`input_tokens`, `output_tokens`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    prompt_tokens_details: _InputDetails | None = None
    completion_tokens_details: _OutputDetails | None = None
    input_tokens_details: _InputDetails | None = None
    output_tokens_details: _OutputDetails | None = None


class Usage(NamedTuple):
    """An answer's token counts, as a batch sums them (`BatchJob`'s usage)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


_decode_answer = msgspec.json.Decoder(_Answer).decode


def _json_body(body: bytes) -> bytes:
    """The body as JSON: sluice's endpoints answer JSON; anything else is carried as a string."""
    try:
        msgspec.json.decode(body)
    except msgspec.DecodeError:
        return _encode(body.decode("utf-8", "replace"))
    return body


def response_line(custom_id: str, status_code: int, request_id: str, body: bytes) -> bytes:
    return b"".join((
        b'{"id":', _encode(f"batch_req_{secrets.token_hex(12)}"), b',"custom_id":', _encode(custom_id),
        b',"response":{"status_code":', str(status_code).encode(), b',"request_id":', _encode(request_id),
        b',"body":', _json_body(body) if body else b"null", b'},"error":null}\n',
    ))


def error_only_line(custom_id: str, code: str, message: str) -> bytes:
    return b"".join((b'{"id":', _encode(f"batch_req_{secrets.token_hex(12)}"), b',"custom_id":',
                     _encode(custom_id), b',"response":null,"error":', _encode({"code": code, "message": message}),
                     b"}\n"))


def read_usage(body: bytes) -> Usage:
    """The token counts of a response body, in any endpoint's words (none: zeros)."""
    try:
        answer = _decode_answer(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Usage()
    usage = answer.usage or _Usage()
    inputs = usage.prompt_tokens_details or usage.input_tokens_details or _InputDetails()
    outputs = usage.completion_tokens_details or usage.output_tokens_details or _OutputDetails()
    return Usage(usage.prompt_tokens + usage.input_tokens, usage.completion_tokens + usage.output_tokens,
                 inputs.cached_tokens or 0, outputs.reasoning_tokens or 0)
