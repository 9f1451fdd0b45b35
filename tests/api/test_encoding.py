"""Compressed request bodies are decoded within the body limit, or refused with the right status."""

from __future__ import annotations

import gzip
import zlib

import pytest

from sluice.api.encoding import decoded_body
from sluice.errors import InvalidInput, PayloadTooLarge, UnsupportedEncoding

BODY = b'{"inputs": []}' * 100


def _raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


@pytest.mark.parametrize("encoding, sent", [
    (None, BODY), ("identity", BODY), ("gzip", gzip.compress(BODY)), ("x-gzip", gzip.compress(BODY)),
    ("GZip", gzip.compress(BODY)), ("deflate", zlib.compress(BODY)), ("deflate", _raw_deflate(BODY)),
    ("deflate, gzip", gzip.compress(zlib.compress(BODY))),  # codings in the order they were applied
    ("gzip", gzip.compress(BODY[:700]) + gzip.compress(BODY[700:])),  # two gzip members
])
def test_a_body_is_decoded_whatever_the_coding(encoding, sent):
    assert decoded_body(sent, encoding, len(BODY)) == BODY


def test_the_limit_counts_the_decoded_bytes():
    assert decoded_body(gzip.compress(BODY), "gzip", len(BODY)) == BODY
    with pytest.raises(PayloadTooLarge):
        decoded_body(gzip.compress(BODY), "gzip", len(BODY) - 1)
    with pytest.raises(PayloadTooLarge):  # the second member takes it over
        decoded_body(gzip.compress(BODY) + gzip.compress(b"x"), "gzip", len(BODY))


def test_an_unknown_coding_is_refused_before_decoding_anything():
    with pytest.raises(UnsupportedEncoding, match="'br'"):
        decoded_body(gzip.compress(BODY), "gzip, br", 1 << 20)


@pytest.mark.parametrize("encoding, sent", [
    ("gzip", gzip.compress(BODY)[:-12]), ("gzip", b"not gzip at all"), ("deflate", b"\x00\x01garbage"),
])
def test_a_corrupt_or_cut_body_is_invalid_input(encoding, sent):
    with pytest.raises(InvalidInput) as raised:
        decoded_body(sent, encoding, 1 << 20)
    assert type(raised.value) is InvalidInput
