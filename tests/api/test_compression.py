"""Response compression's rules (`api.compression`): which coding an `Accept-Encoding` gets, and
which answers are left as they are. Through a real server: tests/integration/test_tritonclient.py
(tritonclient, httpx, the `openai` SDK) and test_generation.py (SSE streams)."""

from __future__ import annotations

import gzip
import zlib

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from sluice.api.compression import MIN_BYTES, CompressionMiddleware, chosen_coding, compress


@pytest.mark.parametrize("accept, coding", [
    (None, None), ("", None), ("identity", None), ("br, zstd", None), ("gzip;q=0", None), ("*;q=0", None),
    ("gzip", "gzip"), ("GZIP", "gzip"), ("x-gzip", "gzip"), ("deflate", "deflate"), ("gzip, deflate, br", "gzip"),
    ("deflate, gzip", "gzip"),  # alike: the server's preference
    ("gzip;q=0.5, deflate;q=0.8", "deflate"), ("gzip ; q=0.5 , deflate ; Q=0.9", "deflate"),
    ("*", "gzip"), ("gzip;q=0, *", "deflate"), ("identity;q=1, gzip;q=0.5", None), ("gzip, identity", "gzip"),
    ("identity;q=0, gzip;q=0.1", "gzip"), ("gzip;q=abc, deflate", "deflate"), ("gzip;q=2", None),
])
def test_the_coding_is_the_clients_preferred_one(accept, coding):
    assert chosen_coding(accept) == coding


def test_gzip_and_deflate_are_what_clients_decompress():
    body = b'{"outputs": [1.0, 2.0]}' * 100
    assert gzip.decompress(compress(body, "gzip")) == body
    assert zlib.decompress(compress(body, "deflate")) == body  # zlib's framing, as tritonclient reads it


BIG = b'{"x": "' + b"a" * (2 * MIN_BYTES) + b'"}'


def _app() -> CompressionMiddleware:
    async def whole(request: Request) -> Response:
        size = int(request.query_params.get("size", len(BIG)))
        return Response(BIG[:size], media_type=request.query_params.get("type", "application/json"))

    async def encoded(request: Request) -> Response:
        return Response(gzip.compress(BIG), media_type="application/json", headers={"Content-Encoding": "gzip"})

    async def streamed(request: Request) -> StreamingResponse:
        async def parts():
            yield b"data: " + BIG + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(parts(), media_type=request.query_params.get("type", "text/event-stream"))

    return CompressionMiddleware(Starlette(routes=[Route("/whole", whole, methods=["GET", "HEAD"]),
                                                   Route("/v1/whole", whole),
                                                   Route("/encoded", encoded), Route("/streamed", streamed)]))


@pytest.fixture
async def http():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://test") as client:
        yield client


async def _raw(http: httpx.AsyncClient, method: str, path: str) -> tuple[httpx.Response, bytes]:
    async with http.stream(method, path, headers={"Accept-Encoding": "gzip"}) as response:
        return response, b"".join([part async for part in response.aiter_raw()])


async def test_a_whole_json_answer_is_compressed_with_its_new_length(http):
    response, raw = await _raw(http, "GET", "/whole")
    assert response.headers["content-encoding"] == "gzip" and response.headers["vary"] == "Accept-Encoding"
    assert int(response.headers["content-length"]) == len(raw) and gzip.decompress(raw) == BIG


@pytest.mark.parametrize("path", ["/whole?size=100", "/whole?type=image/png", "/encoded", "/streamed",
                                  "/streamed?type=application/json", "/v1/whole"])
async def test_small_binary_already_encoded_and_streamed_answers_pass_as_they_are(http, path):
    response, raw = await _raw(http, "GET", path)
    assert response.headers.get("content-encoding") == ("gzip" if path == "/encoded" else None)
    assert "vary" not in response.headers  # never a candidate
    assert raw.startswith(b"data: " if path.startswith("/streamed") else b"\x1f\x8b" if path == "/encoded" else b"{")
    # /v1: OpenAI's routes, which the openai SDK asks gzip of on every request unasked by its caller


async def test_a_head_answer_is_not_compressed(http):
    response, _ = await _raw(http, "HEAD", "/whole")
    assert "content-encoding" not in response.headers
    assert response.headers["content-length"] == str(len(BIG))
