"""Compressed responses (`Accept-Encoding: gzip | deflate`), as Triton's HTTP server sends them.

tritonclient's `response_compression_algorithm` asks with `Accept-Encoding: gzip` (or `deflate`)
and decompresses the whole body before it reads it: `Inference-Header-Content-Length` counts the
*uncompressed* JSON header, in Triton and here alike. httpx, aiohttp and the `openai` SDK ask for
gzip and deflate on every request and decompress transparently.

    whole body (never a stream: SSE, file downloads) ─▶ eligible? ─ no ──────────────▶ as it is
        ≥ MIN_BYTES, JSON / text / a binary tensor       │ yes: Vary: Accept-Encoding
        answer, no Content-Encoding yet, not HEAD         ▼
                                          the client's preferred coding (q-values) ─▶ compressed
                                          none (or identity preferred) ────────────▶ as it is

OpenAI's routes (`/v1/...`) are never compressed: the `openai` SDK (through httpx) asks for gzip
on every request without its caller choosing it, and on the networks an inference server sits on
(a load balancer's, a cluster's), compressing an embedding or a completion costs the gateway's
event loop more than it saves on the wire (~30 µs per 4 KiB, where parsing the whole request
costs less). Triton's clients ask only when told to (`response_compression_algorithm`), and
Prometheus for its scrapes, so `/v2` and `/metrics` answers are compressed when asked.

The HTTP protocol's early answers (`SluiceApp.answer_early`) go through `compress_response`;
everything else through `CompressionMiddleware`: the same rules either way.

Cost (benchmarks/README.md, "Response compression"): zlib at `LEVEL` 1 halves a JSON tensor
answer for ~30 µs per 4 KiB; level 6 saves up to 3 points more for 1.4-9x the time. A body of
`OFF_LOOP_BYTES` or more is compressed in a thread (zlib releases the GIL), so a 1 MiB answer's
~10-30 ms do not stall the event loop.
"""

from __future__ import annotations

import asyncio
import zlib

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MIN_BYTES = 1024
"""Smaller bodies go as they are: they fit one TCP segment either way, and gzip's 18 bytes of
framing would eat most of what it saves."""
LEVEL = 1
OFF_LOOP_BYTES = 64 * 1024
CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""The codings sent, in the order preferred when the client weighs them alike, and zlib's window
bits for each: gzip's framing, or zlib's (HTTP's `deflate`, what tritonclient's `zlib.decompress` reads)."""
_ALIASES = {"x-gzip": "gzip"}
_TYPES = (b"application/json", b"text/plain", b"application/jsonl", b"application/x-ndjson")
"""Content types compressed (a binary KServe answer too: `_is_eligible`); not `text/event-stream`."""
_HEADER_LENGTH = b"inference-header-content-length"
_VARY = (b"vary", b"Accept-Encoding")


def chosen_coding(accept_encoding: str | None) -> str | None:
    """The coding to send for an `Accept-Encoding` value (RFC 9110 12.5.3): the supported one of
    the highest q-value above 0 (`*` stands for those not named), unless `identity` is named with
    a higher q-value; None (identity) without the header or with no acceptable coding."""
    if not accept_encoding:
        return None
    weights: dict[str, float] = {}
    for item in accept_encoding.split(","):
        name, _, params = item.partition(";")
        name = name.strip().lower()
        name = _ALIASES.get(name, name)
        if name:
            weights[name] = _q_value(params)
    star = weights.get("*", 0.0)
    best, best_q = None, 0.0
    for coding in CODINGS:
        q = weights.get(coding, star)
        if q > best_q:
            best, best_q = coding, q
    if best is None or best_q < weights.get("identity", 0.0):
        return None
    return best


def _q_value(params: str) -> float:
    """An entry's `q` (1 if absent); a malformed one counts as 0, not acceptable."""
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "q":
            try:
                q = float(value.strip())
            except ValueError:
                return 0.0
            return q if 0.0 <= q <= 1.0 else 0.0
    return 1.0


def compress(body: bytes, coding: str) -> bytes:
    compressor = zlib.compressobj(LEVEL, zlib.DEFLATED, CODINGS[coding])
    return compressor.compress(body) + compressor.flush()


async def compressed(body: bytes, coding: str) -> bytes:
    """`compress`, in a thread for a body of `OFF_LOOP_BYTES` or more."""
    if len(body) >= OFF_LOOP_BYTES:
        return await asyncio.to_thread(compress, body, coding)
    return compress(body, coding)


def is_compressed_path(path: str) -> bool:
    """Whether answers on this path are compressed for a client that asks: all but OpenAI's."""
    return not (path == "/v1" or path.startswith("/v1/"))


def _is_eligible(headers: list[tuple[bytes, bytes]], size: int) -> bool:
    """Whether an answer of these headers and `size` bytes is one to compress, for a client that asks."""
    if size < MIN_BYTES:
        return False
    content_type = b""
    for name, value in headers:
        name = name.lower()
        if name == b"content-encoding":
            return False
        if name == b"content-type":
            content_type = value.split(b";", 1)[0].strip().lower()
    if content_type == b"application/octet-stream":
        return any(name.lower() == _HEADER_LENGTH for name, _ in headers)  # a binary KServe answer
    return content_type in _TYPES or (content_type.startswith(b"text/") and content_type != b"text/event-stream")


def _recoded(headers: list[tuple[bytes, bytes]], coding: str | None, size: int) -> list[tuple[bytes, bytes]]:
    """`headers` with `Vary: Accept-Encoding` and, if `coding`, its `Content-Encoding` and new length."""
    kept = [(n, v) for n, v in headers if not (coding and n.lower() == b"content-length")]
    if not any(n.lower() == b"vary" for n, _ in kept):
        kept.append(_VARY)
    elif not any(n.lower() == b"vary" and b"accept-encoding" in v.lower() for n, v in kept):
        kept = [(n, v + b", Accept-Encoding" if n.lower() == b"vary" else v) for n, v in kept]
    if coding:
        kept += [(b"content-encoding", coding.encode()), (b"content-length", b"%d" % size)]
    return kept


async def compress_response(response: Response, accept_encoding: str | None, path: str,
                            method: str = "POST") -> Response:
    """`response` (a whole body) to a request for `path`, compressed in place if eligible and the client asks."""
    body = bytes(response.body)
    if method == "HEAD" or not is_compressed_path(path) or not _is_eligible(response.raw_headers, len(body)):
        return response
    coding = chosen_coding(accept_encoding)
    if coding is not None:
        body = response.body = await compressed(body, coding)
    response.raw_headers[:] = _recoded(response.raw_headers, coding, len(body))
    return response


class CompressionMiddleware:
    """Compresses a whole-body answer (`http.response.start` with a `content-length`, then one
    `http.response.body`) by the rules above; a streamed one (SSE, file downloads) passes as it is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "HEAD" or not is_compressed_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        accept = next((v for k, v in scope["headers"] if k == b"accept-encoding"), b"").decode("latin-1")
        held: Message | None = None

        async def send_compressed(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                length = next((v for k, v in headers if k.lower() == b"content-length"), b"")
                if length.isdigit() and _is_eligible(headers, int(length)):
                    held = {**message, "headers": headers}  # until its body: compressed or not
                    return
            elif message["type"] == "http.response.body" and held is not None:
                start, held = held, None
                body = message.get("body", b"")
                coding = None if message.get("more_body", False) else chosen_coding(accept)
                if coding is not None:
                    body = await compressed(body, coding)
                await send({**start, "headers": _recoded(start["headers"], coding, len(body))})
                message = {**message, "body": body}
            await send(message)

        await self.app(scope, receive, send_compressed)
