"""Compressed request bodies (`Content-Encoding: gzip | deflate`), as Triton's HTTP server reads them.

tritonclient's `request_compression_algorithm` compresses the whole body (the JSON header and any
binary tensors after it; `Inference-Header-Content-Length` counts the uncompressed header), so
a body is decoded before anything reads it. The decoded size obeys the route's body limit, as
an uncompressed body's does: the decompressor is asked for at most one byte past the limit, so
a small body that would inflate to gigabytes (a zip bomb) costs no more memory than the limit.

    raw body (already within the limit) ─▶ codings, last applied first ─▶ body (within the limit)
                                             unknown coding: 415 · corrupt or cut short: 400 · too big: 413
"""

from __future__ import annotations

import zlib

from sluice.errors import InvalidInput, PayloadTooLarge, UnsupportedEncoding

_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""zlib's window bits for each coding: gzip's header and trailer, or zlib's (HTTP's `deflate`)."""
_RAW_DEFLATE = -zlib.MAX_WBITS
"""Some clients send `deflate` without zlib's header, as raw DEFLATE: read that too."""


def decoded_body(body: bytes, content_encoding: str | None, limit_bytes: int) -> bytes:
    """`body` with its `Content-Encoding` undone (codings listed in the order they were applied),
    refusing an unknown coding (415), a corrupt body (400), or one that decodes to over `limit_bytes` (413)."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    for coding in codings:
        if coding not in _WBITS:
            raise UnsupportedEncoding(f"Content-Encoding {coding[:32]!r} is not supported (use gzip or deflate)")
    for coding in reversed(codings):
        if body:
            body = _inflate(body, coding, limit_bytes)
    return body


def _inflate(data: bytes, coding: str, limit_bytes: int) -> bytes:
    try:
        return _inflate_members(data, _WBITS[coding], coding, limit_bytes)
    except zlib.error as exc:
        if coding == "deflate":
            try:
                return _inflate_members(data, _RAW_DEFLATE, coding, limit_bytes)
            except zlib.error:
                pass
        raise InvalidInput(f"request body is not valid {coding} data: {exc}") from exc


def _inflate_members(data: bytes, wbits: int, coding: str, limit_bytes: int) -> bytes:
    """Every member of `data` (gzip allows several, one after another), at most `limit_bytes` in all."""
    out: list[bytes] = []
    size = 0
    while data:
        inflater = zlib.decompressobj(wbits)
        chunk = inflater.decompress(data, limit_bytes - size + 1)
        size += len(chunk)
        if size > limit_bytes:
            raise PayloadTooLarge(f"request body decompresses to over the {limit_bytes}-byte limit")
        out.append(chunk)
        if not inflater.eof:
            raise InvalidInput(f"request body is not valid {coding} data: it ends before its stream does")
        data = inflater.unused_data if wbits == _WBITS["gzip"] else b""
    return b"".join(out)
