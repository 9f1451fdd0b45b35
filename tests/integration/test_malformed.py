"""Client mistakes on every endpoint get a clear error in the protocol's shape, never a 500.

KServe v2 errors are `{"error": "..."}`; OpenAI errors are the envelope
`{"error": {"message", "type", "param", "code"}}`. Every response carries `x-request-id`.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
import time

import httpx
import numpy as np
import pytest

from tests.conftest import metric_total

INFER = "/v2/models/emulated/infer"
EMBED = "/v1/embeddings"


def _has_request_id(response: httpx.Response) -> None:
    assert response.headers.get("x-request-id"), f"{response.request.url} answered without x-request-id"


@pytest.fixture(scope="module")
def http(demo_server):
    with httpx.Client(base_url=demo_server.url, timeout=60, event_hooks={"response": [_has_request_id]}) as client:
        yield client


def v2_error(response: httpx.Response, status: int, *fragments: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    for fragment in fragments:
        assert fragment in body["error"]
    return body["error"]


def v1_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    return error["message"]


def tensor(shape=(2, 4), data=None, name="INPUT0", datatype="FP32", **extra):
    """One input entry; `data` defaults to 0..n-1 for the shape."""
    if data is None:
        data = list(range(int(np.prod(shape))))
    return {"name": name, "shape": list(shape), "datatype": datatype, "data": data, **extra}


def binary(
    http: httpx.Client,
    path: str,
    header: dict,
    raw: bytes,
    header_length: int | None = None,
    headers: dict | None = None,
) -> httpx.Response:
    head = json.dumps(header).encode()
    length = len(head) if header_length is None else header_length
    return http.post(
        path, content=head + raw, headers={"Inference-Header-Content-Length": str(length), **(headers or {})}
    )


# -- KServe v2: the body -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [b"{bad", b"", b"[]", b"null", b"{}", b'{"inputs": []}', b'{"inputs": "x"}', b"\xff\xfe", b'{"inputs": [{}]}'],
)
def test_v2_body_that_is_not_an_inference_request(http, body):
    v2_error(http.post(INFER, content=body), 400)


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"shape": "2x4"}, "shape"),
        ({"shape": [2.5, 4]}, "shape"),
        ({"datatype": 5}, "datatype"),
        ({"datatype": "FP8"}, "FP8"),
        ({"name": None}, "name"),
        ({"data": ["1.5", "2"] * 4}, "str"),
        ({"data": [True] * 8}, "bool"),
        ({"data": [{"a": 1}] * 8}, "object"),
        ({"data": None}, "no data"),
        ({"parameters": []}, "parameters"),
    ],
)
def test_v2_input_with_wrong_types(http, bad, fragment):
    v2_error(http.post(INFER, json={"inputs": [{**tensor(), **bad}]}), 400, fragment)


@pytest.mark.parametrize("missing", ["name", "shape", "datatype"])
def test_v2_input_missing_a_field(http, missing):
    entry = tensor()
    del entry[missing]
    v2_error(http.post(INFER, json={"inputs": [entry]}), 400, missing)


@pytest.mark.parametrize(
    "entry, fragment",
    [
        (tensor(name="INPUT1"), "INPUT0"),
        (tensor(datatype="INT32"), "FP32"),
        (tensor(datatype="BYTES", data=["a"] * 8), "FP32"),
        (tensor(shape=(8,)), "shape"),
        (tensor(shape=(2, 2, 2)), "shape"),
        (tensor(shape=(2, 4), data=list(range(7))), "7 values"),
        (tensor(shape=(2, 4), data=[[1, 2, 3, 4], [5, 6, 7]]), "FP32"),
        (tensor(shape=(2, -4), data=list(range(8))), "non-negative"),
        (tensor(shape=(), data=[1]), "shape"),
        (tensor(shape=(2, 4), data=[1e300] * 8), "out of range"),
        (tensor(shape=[1] * 100, data=[1]), "dimensions"),
    ],
)
def test_v2_input_that_does_not_fit_the_model(http, entry, fragment):
    v2_error(http.post(INFER, json={"inputs": [entry]}), 400, fragment)


def test_v2_two_inputs_for_a_one_input_model(http):
    v2_error(http.post(INFER, json={"inputs": [tensor(), tensor(name="INPUT1")]}), 400, "one input")


@pytest.mark.parametrize("shape", [(2**31, 2**31), (0, 2**62), (1, 2**64 + 1), (1 << 20, 1 << 20, 0)])
def test_v2_huge_shape_is_refused_before_allocation(http, shape):
    started = time.monotonic()
    v2_error(http.post(INFER, json={"inputs": [tensor(shape=shape, data=[1.0])]}), 400, "elements")
    header = _binary_header(4, shape=list(shape))
    v2_error(binary(http, INFER, header, b"\0\0\0\0"), 400, "elements")
    assert time.monotonic() - started < 2.0


def test_v2_unknown_requested_output(http):
    v2_error(http.post(INFER, json={"inputs": [tensor()], "outputs": [{"name": "X"}]}), 400, "'X'")


@pytest.mark.parametrize("timeout", [-5, 0, 1e30, "soon", True, [1]])
def test_v2_timeout_parameter_out_of_range(http, timeout):
    response = http.post(INFER, json={"inputs": [tensor()], "parameters": {"timeout": timeout}})
    v2_error(response, 400, "timeout")


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/nope/infer",
        "/v2/models/nope",
        "/v2/models/nope/ready",
        "/v2/models/emulated/versions/9/infer",
        "/v2/models/emulated/versions/9",
        "/v2/models/nope/versions/1/ready",
    ],
)
def test_v2_unknown_model_or_version_is_404(http, path):
    method = "POST" if path.endswith("infer") else "GET"
    v2_error(http.request(method, path, json={"inputs": [tensor()]}), 404, "nope" if "nope" in path else "'9'")


@pytest.mark.parametrize("method, path", [("POST", f"{INFER}/"), ("GET", "/v2/models/emulated/"),
                                          ("GET", "/v2/health/ready/")])
def test_v2_a_path_with_a_trailing_slash_is_404_not_a_redirect(http, method, path):
    v2_error(http.request(method, path, json={"inputs": [tensor()]}), 404, path)


DEEP = b"[" * 3000 + b"1" + b"]" * 3000  # a 6 KB body nested past the interpreter's stack
ONE_ROW = b'{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}'


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b'{"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": ' + DEEP + b"}]}", "deeply"),
        (b'{"inputs": [' + ONE_ROW + b'], "unknown": ' + DEEP + b"}", "deeply"),
        (b'{"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": '
         + b"[" * 100 + b"1" + b"]" * 100 + b"}]}", "nested"),
        (b'{"inputs": [{"name": "\xff", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}', "UTF-8"),
        (b'{"inputs": [' + ONE_ROW + b'], "id": "\xc3("}', "UTF-8"),
    ],
)
def test_v2_deep_nesting_and_invalid_utf8_are_400(http, body, fragment):
    v2_error(http.post(INFER, content=body), 400, fragment)
    # the same JSON as the header of a binary-extension request
    headers = {"Inference-Header-Content-Length": str(len(body))}
    v2_error(http.post(INFER, content=body + b"\0" * 4, headers=headers), 400, fragment)


# -- KServe v2: the binary tensor extension ------------------------------------------------------

ROWS = np.arange(8, dtype=np.float32).reshape(2, 4)


def _binary_header(size=32, **extra) -> dict:
    entry = {"name": "INPUT0", "shape": [2, 4], "datatype": "FP32", "parameters": {"binary_data_size": size}}
    return {"inputs": [{**entry, **extra}]}


def test_v2_binary_round_trip_works(http):
    response = binary(http, INFER, _binary_header(), ROWS.tobytes(), headers={"X-Request-Timeout-Ms": "30000"})
    assert response.status_code == 200
    assert response.json()["outputs"][0]["data"] == [6.0, 22.0]


@pytest.mark.parametrize(
    "header_length, fragment",
    [
        ("12x", "non-negative integer"),
        ("-1", "non-negative integer"),
        ("", "non-negative integer"),
        (b"\xb2", "non-negative integer"),  # '²' in latin-1: str.isdigit() says yes, int() says no
        ("9" * 40, "non-negative integer"),
        (10**9, "larger than the body"),
        (5, "JSON"),
    ],
)
def test_v2_wrong_inference_header_content_length(http, header_length, fragment):
    head = json.dumps(_binary_header()).encode()
    value = header_length if isinstance(header_length, bytes) else str(header_length)
    response = http.post(INFER, content=head + ROWS.tobytes(), headers={"Inference-Header-Content-Length": value})
    v2_error(response, 400, fragment)


@pytest.mark.parametrize("size", [31, 33, 10**6, -1, True, "32", 2**70])
def test_v2_wrong_binary_data_size(http, size):
    v2_error(binary(http, INFER, _binary_header(size), ROWS.tobytes()), 400, "INPUT0")


def test_v2_binary_data_longer_than_declared(http):
    v2_error(binary(http, INFER, _binary_header(), ROWS.tobytes() + b"junk"), 400, "binary_data_size")


def _bytes_header(raw: bytes, shape=(1,)) -> dict:
    return {
        "inputs": [
            {"name": "text", "shape": list(shape), "datatype": "BYTES", "parameters": {"binary_data_size": len(raw)}}
        ]
    }


@pytest.mark.parametrize(
    "raw, shape, fragment",
    [
        (struct.pack("<I", 2) + b"\xff\xfe", (1,), "UTF-8"),
        (struct.pack("<I", 200) + b"ab", (1,), "truncated"),
        (b"\x01\x00", (1,), "truncated"),
        (struct.pack("<I", 2) + b"hi", (2,), "1 BYTES elements"),
    ],
)
def test_v2_malformed_bytes_tensor(http, raw, shape, fragment):
    v2_error(binary(http, "/v2/models/minilm/infer", _bytes_header(raw, shape), raw), 400, fragment)


def test_v2_bytes_in_json_must_be_strings(http):
    entry = tensor(shape=(2,), data=["a", 1], name="text", datatype="BYTES")
    v2_error(http.post("/v2/models/minilm/infer", json={"inputs": [entry]}), 400, "string")


@pytest.mark.parametrize(
    "data, shape, fragments",
    [
        (["a", "b", "c"], (2,), ("input 'text'", "3 strings do not fill shape [2]")),
        (["a"], (2,), ("input 'text'", "1 strings do not fill shape [2]")),
        (["a", 1], (2,), ("input 'text'", "element 1 is a number, not a string")),
        ([["a"], [None]], (2, 1), ("input 'text'", "element 1 is null, not a string")),
        (["a", {"b": 1}], (2,), ("input 'text'", "element 1 is an object")),
        ([True], (1,), ("input 'text'", "element 0 is a boolean")),
    ],
)
def test_v2_a_bytes_tensor_in_json_that_is_wrong_says_which_input_and_what(http, data, shape, fragments):
    entry = tensor(shape=shape, data=data, name="text", datatype="BYTES")
    v2_error(http.post("/v2/models/minilm/infer", json={"inputs": [entry]}), 400, *fragments)


@pytest.mark.parametrize(
    "raw, shape, fragments",
    [
        (struct.pack("<I", 2) + b"ok" + struct.pack("<I", 2) + b"\xc3(", (2,),
         ("input 'text'", "element 1 holds bytes that are not UTF-8")),
        (struct.pack("<I", 9) + b"short", (1,), ("input 'text'", "truncated", "4-byte little-endian length")),
        (struct.pack("<I", 1) + b"a" + struct.pack("<I", 1) + b"b", (3,),
         ("input 'text'", "2 BYTES elements do not fill shape [3]")),
    ],
)
def test_v2_a_binary_bytes_tensor_that_is_wrong_says_which_input_and_what(http, raw, shape, fragments):
    v2_error(binary(http, "/v2/models/minilm/infer", _bytes_header(raw, shape), raw), 400, *fragments)


# -- OpenAI /v1 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{bad", None),
        (b"", None),
        (b"null", None),
        (b"[]", None),
        (b"\xff", None),
        (b'{"input": "hi"}', "model"),
        (b'{"model": "minilm"}', "input"),
        (b'{"model": 5, "input": "hi"}', "model"),
        (b'{"model": "minilm", "input": 5}', "input"),
        (b'{"model": "minilm", "input": "hi", "encoding_format": "hex"}', "encoding_format"),
        (b'{"model": "minilm", "input": "hi", "user": 5}', "user"),
        (b'{"model": "minilm", "input": "hi", "dimensions": "384"}', "dimensions"),
        (b'{"model": "minilm", "input": "hi", "dimensions": 1.5}', "dimensions"),
    ],
)
def test_v1_body_that_is_not_an_embeddings_request(http, body, param):
    v1_error(http.post(EMBED, content=body), 400, "invalid_request", param)


@pytest.mark.parametrize("texts", [[], "", ["ok", ""], [1, -2], [[1, 2], ["a"]], ["x"] * 2049, "x" * 100_001, [None]])
def test_v1_bad_input_values(http, texts):
    v1_error(http.post(EMBED, json={"model": "minilm", "input": texts}), 400, "invalid_request", "input")


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "minilm", "input": ' + DEEP + b"}",
        b'{"model": "minilm", "input": "hi", "unknown": ' + DEEP + b"}",
        b'{"model": "minilm", "input": "\xff"}',
        b'{"model": "minilm", "input": ["ok", "\xe2\x82"]}',
        b'{"model": "\xff", "input": "hi"}',
    ],
)
def test_v1_deep_nesting_and_invalid_utf8_are_400(http, body):
    v1_error(http.post(EMBED, content=body), 400, "invalid_request")


@pytest.mark.parametrize("texts", [rb'"\ud800"', rb'"a \udfff b"', rb'"\ud800\u0041"', rb'["ok", "x\udbff"]'])
def test_a_lone_utf16_surrogate_is_400_saying_the_text_is_not_unicode(http, texts):
    """JSON can escape half of a UTF-16 surrogate pair alone (`"\\ud800"`); no Unicode text holds
    one, so no tokenizer can take it. Each JSON route says so, rather than that the body was cut
    short (msgspec's words for it)."""
    for path, body in ((EMBED, b'{"model": "minilm", "input": ' + texts + b"}"),
                       ("/v1/completions", b'{"model": "tiny-lm", "max_tokens": 1, "prompt": ' + texts + b"}")):
        message = v1_error(http.post(path, content=body), 400, "invalid_request")
        assert http.post(path, content=body).json()["error"]["type"] == "invalid_request_error"
        assert "surrogate" in message and "not valid Unicode" in message, message
    data = texts if texts.startswith(b"[") else b"[" + texts + b"]"
    entry = b'{"inputs": [{"name": "text", "shape": [%d], "datatype": "BYTES", "data": %b}]}' % (data.count(b'"') // 2,
                                                                                              data)
    v2_error(http.post("/v2/models/minilm/infer", content=entry), 400, "surrogate", "not valid Unicode")
    # a pair is a character: answered
    paired = http.post(EMBED, content=b'{"model": "minilm", "input": "smile \ud83d\ude00"}')
    assert paired.status_code == 200, paired.text


@pytest.mark.parametrize(
    "texts, fragment",
    [([], "must not be empty"), ([""], "empty strings"), (["ok", ""], "empty strings"),
     (["x"] * 2049, "at most 2048"), (["x" * 100_001], "longer than 100000")],
)
def test_texts_are_checked_alike_on_both_protocols(http, texts, fragment):
    """One check for the texts of `/v1/embeddings` and of a KServe BYTES input."""
    assert fragment in v1_error(http.post(EMBED, json={"model": "minilm", "input": texts}), 400, "invalid_request",
                                "input")
    entry = tensor(shape=(len(texts),), data=texts, name="text", datatype="BYTES")
    v2_error(http.post("/v2/models/minilm/infer", json={"inputs": [entry]}), 400, fragment)
    raw = b"".join(struct.pack("<I", len(t)) + t.encode() for t in texts)
    v2_error(binary(http, "/v2/models/minilm/infer", _bytes_header(raw, (len(texts),)), raw), 400, fragment)


@pytest.mark.parametrize("dimensions", [2**63 - 1, 2**63, 2**64 + 7, -(2**63), 0, -1, 383])
def test_v1_absurd_dimensions(http, dimensions):
    response = http.post(EMBED, json={"model": "minilm", "input": "hi", "dimensions": dimensions})
    v1_error(response, 400, "invalid_request", "dimensions")


def test_v1_null_optional_fields_mean_their_defaults(http):
    body = {"model": "emulated", "input": "hi", "encoding_format": None, "dimensions": None, "user": None}
    response = http.post(EMBED, json=body, headers={"X-Request-Timeout-Ms": "30000"})
    assert response.status_code == 200, response.text
    assert len(response.json()["data"][0]["embedding"]) == 16


def test_v1_unknown_model_is_404(http):
    v1_error(http.post(EMBED, json={"model": "nope", "input": "hi"}), 404, "model_not_found")
    v1_error(http.get("/v1/models/nope"), 404, "model_not_found")


# -- both: headers, sizes, routes --------------------------------------------------------------------


@pytest.mark.parametrize("value", ["abc", "", "-1", "0", "nan", "inf", "1e12", "12ms"])
def test_timeout_header_garbage_is_400(http, value):
    headers = {"X-Request-Timeout-Ms": value}
    v2_error(http.post(INFER, json={"inputs": [tensor()]}, headers=headers), 400, "timeout")
    response = http.post(EMBED, json={"model": "minilm", "input": "hi"}, headers=headers)
    assert "timeout" in v1_error(response, 400, "invalid_request", "x-request-timeout-ms")


def test_timeout_header_over_the_servers_limit_is_400_naming_the_header(http):
    headers = {"X-Request-Timeout-Ms": "700000"}  # the limit is 600 s
    message = v2_error(http.post(INFER, json={"inputs": [tensor()]}, headers=headers), 400, "600000")
    assert message.startswith("x-request-timeout-ms")
    response = http.post(EMBED, json={"model": "minilm", "input": "hi"}, headers=headers)
    assert "600000" in v1_error(response, 400, "invalid_request", "x-request-timeout-ms")
    body = {"inputs": [tensor()], "parameters": {"timeout": 700_000_000}}  # microseconds
    v2_error(http.post(INFER, json=body), 400, "'timeout'", "600000000")
    at_limit = http.post(INFER, json={"inputs": [tensor()]}, headers={"X-Request-Timeout-Ms": "600000"})
    assert at_limit.status_code == 200, at_limit.text


def test_timeout_header_is_checked_even_with_a_timeout_parameter(http):
    body = {"inputs": [tensor()], "parameters": {"timeout": 1_000_000}}
    v2_error(http.post(INFER, json=body, headers={"X-Request-Timeout-Ms": "abc"}), 400, "timeout")


def test_body_over_the_limit_is_413(http):
    big = b"[" + b"1," * (17 * 1024 * 1024) + b"1]"  # > 32 MiB
    v2_error(http.post(INFER, content=big), 413, "limit")
    v1_error(http.post(EMBED, content=big), 413, "payload_too_large")

    def chunks():  # no Content-Length: the limit holds while streaming
        for _ in range(40):
            yield b" " * (1024 * 1024)

    v2_error(http.post(INFER, content=chunks()), 413, "limit")


@pytest.mark.parametrize("path", ["/v1/nope", "/v1/assistants", "/v2/nope", "/nope", "/v2/models"])
def test_unknown_route_is_404_json(http, path):
    response = http.post(path, json={})
    if path.startswith("/v2"):
        v2_error(response, 404, path)
    else:
        v1_error(response, 404, "not_found")


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", EMBED),
        ("DELETE", "/v1/models"),
        ("GET", INFER),
        ("POST", "/v2/health/live"),
        ("PUT", "/v2/models/emulated"),
    ],
)
def test_wrong_method_is_405_json(http, method, path):
    response = http.request(method, path)
    if path.startswith("/v2"):
        v2_error(response, 405, method)
    else:
        v1_error(response, 405, "invalid_request")
    assert response.headers["allow"]


def test_client_that_hangs_up_mid_body_is_not_logged_as_a_bug(http, demo_server):
    request_id = f"hangup-{time.monotonic_ns()}"
    with socket.create_connection(("127.0.0.1", demo_server.port)) as raw:
        raw.sendall(
            f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nx-request-id: {request_id}\r\n\r\n".encode()
            + b'{"inputs": ['
        )
        time.sleep(0.2)
    time.sleep(0.3)
    assert http.get("/v2/health/ready").status_code == 200
    assert not [line for line in demo_server.log().splitlines() if request_id in line and "internal error" in line]


def test_request_id_is_echoed_when_sane_and_replaced_when_not(http):
    assert http.get("/v2/health/live", headers={"x-request-id": "abc-123"}).headers["x-request-id"] == "abc-123"
    replaced = http.get("/v2/health/live", headers={"x-request-id": "bad id\t!"}).headers["x-request-id"]
    another = http.get("/v2/health/live").headers["x-request-id"]
    assert replaced != "bad id\t!" and re.fullmatch(r"[0-9a-f]{12}-[0-9a-f]+", replaced)
    assert another != replaced, "every request gets its own id"


# -- per-item failure in a batch ----------------------------------------------------------------------


async def test_nan_request_fails_alone_among_concurrent_good_ones(demo_server):
    rows = np.random.default_rng(0).standard_normal((20, 2, 8)).astype(np.float32)
    poisoned = np.ones((2, 8), dtype=np.float32)
    poisoned[1, 5] = np.nan
    header = json.dumps(_binary_header(64, shape=[2, 8])).encode()

    async with httpx.AsyncClient(base_url=demo_server.url, timeout=30) as client:

        def post(array: np.ndarray):
            headers = {"Inference-Header-Content-Length": str(len(header)), "X-Request-Timeout-Ms": "30000"}
            return client.post(INFER, content=header + array.tobytes(), headers=headers)

        responses = await asyncio.gather(*(post(r) for r in rows), post(poisoned))
    *good, bad = responses
    assert [r.status_code for r in good] == [200] * 20
    for response, array in zip(good, rows, strict=True):
        np.testing.assert_allclose(response.json()["outputs"][0]["data"], array.sum(axis=1), rtol=1e-5)
    v2_error(bad, 422, "NaN")


def test_refused_input_counts_as_invalid_in_metrics_and_statistics(http, demo_server):
    """Whether the gateway or the worker finds the input wrong, the request is counted as
    `invalid` (the client's input) and as a failed inference in the model's statistics."""
    def counts(model: str) -> tuple[float, int]:
        stats = http.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
        return (metric_total(demo_server, "sluice_requests_total", model=model, outcome="invalid"),
                stats["inference_stats"]["fail"]["count"])

    bad_bodies = [
        {"inputs": [{"name": "WRONG", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]},
        {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "INT32", "data": [1, 2, 3, 4]}]},
        {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3]}]},
    ]
    invalid, failed = counts("emulated")
    for body in bad_bodies:
        assert http.post(INFER, json=body).status_code == 400
    assert http.post(INFER, content=b'{"inputs": [', headers={"content-type": "application/json"}).status_code == 400
    assert http.post(INFER, json=bad_bodies[0], headers={"x-request-timeout-ms": "soon"}).status_code == 400
    assert counts("emulated") == (invalid + 5, failed + 5)

    invalid, failed = counts("minilm")
    assert http.post(EMBED, json={"model": "minilm", "input": [""]}).status_code == 400
    assert http.post(EMBED, json={"model": "minilm", "input": "hi", "dimensions": 7}).status_code == 400
    assert counts("minilm") == (invalid + 2, failed + 2)
