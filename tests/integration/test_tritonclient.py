"""The real `tritonclient.http` against `/v2`: health, metadata, binary and JSON tensors, errors.

tritonclient sends infer bodies without a Content-Type, uses the binary tensor extension by
default, and when no outputs are named sets `parameters.binary_data_output` so that every
output comes back binary.
"""

from __future__ import annotations

import gzip
import json
import time
import zlib

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.conftest import eventually, metric_total


def roomy() -> dict[str, str]:
    """A roomy deadline, so that a loaded test machine does not turn the models' short SLOs into
    504s (deadlines have their own tests). A fresh dict each call: tritonclient writes
    Inference-Header-Content-Length into the headers dict it is given."""
    return {"X-Request-Timeout-Ms": "30000"}


@pytest.fixture(scope="module")
def client(demo_server):
    sdk = triton.InferenceServerClient(url=f"127.0.0.1:{demo_server.port}", network_timeout=60)
    yield sdk
    sdk.close()


def _rows(num_rows: int = 4, length: int = 16) -> np.ndarray:
    return np.random.default_rng(num_rows).standard_normal((num_rows, length)).astype(np.float32)


def _input(array: np.ndarray, binary_data: bool = True, name: str = "INPUT0", datatype: str = "FP32"):
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary_data)
    return tensor


def test_health_and_readiness(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("emulated")
    assert client.is_model_ready("minilm", model_version="1")
    assert not client.is_model_ready("no-such-model")
    assert {"binary_tensor_data", "classification"} <= set(client.get_server_metadata()["extensions"])


def test_model_metadata_describes_inputs_and_outputs(client):
    emulated = client.get_model_metadata("emulated")
    assert emulated["versions"] == ["1"]
    assert emulated["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, -1]}]
    assert emulated["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1]}]
    minilm = client.get_model_metadata("minilm", model_version="1")
    assert minilm["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert minilm["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]


def test_default_binary_infer_returns_binary_row_sums(client):
    rows = _rows()
    result = client.infer("emulated", [_input(rows)], headers=roomy())
    output = result.get_output("OUTPUT0")
    assert output["parameters"]["binary_data_size"] == 4 * len(rows)  # binary_data_output honoured
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), rows.sum(axis=1), rtol=1e-5)


def test_requested_binary_output(client):
    rows = _rows(3)
    result = client.infer("emulated", [_input(rows)], outputs=[triton.InferRequestedOutput("OUTPUT0")], headers=roomy())
    assert "binary_data_size" in result.get_output("OUTPUT0")["parameters"]
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), rows.sum(axis=1), rtol=1e-5)


def test_json_input_and_json_output(client):
    rows = _rows(5)
    outputs = [triton.InferRequestedOutput("OUTPUT0", binary_data=False)]
    result = client.infer(
        "emulated", [_input(rows, binary_data=False)], outputs=outputs, request_id="r-1", headers=roomy()
    )
    assert "data" in result.get_output("OUTPUT0")
    assert result.get_response()["id"] == "r-1"
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), rows.sum(axis=1), rtol=1e-5)


@pytest.mark.parametrize("output, is_binary", [({}, True), ({"binary_data": False}, False)])
def test_binary_data_output_applies_to_listed_outputs_unless_they_say_otherwise(demo_server, output, is_binary):
    """The extension's rule: `binary_data_output` makes every output binary, and an output's own
    `binary_data` overrides it."""
    body = {"inputs": [{"name": "INPUT0", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}],
            "parameters": {"binary_data_output": True}, "outputs": [{"name": "OUTPUT0", "parameters": output}]}
    response = httpx.post(f"{demo_server.url}/v2/models/emulated/infer", json=body, headers=roomy(), timeout=60)
    assert response.status_code == 200, response.text
    length = response.headers.get("inference-header-content-length")
    assert (length is not None) == is_binary
    header = json.loads(response.content[:int(length)] if length else response.content)
    (entry,) = header["outputs"]
    if is_binary:
        assert entry["parameters"] == {"binary_data_size": 8}
        assert np.frombuffer(response.content[int(length):], "<f4").tolist() == [3.0, 7.0]
    else:
        assert entry["data"] == [3.0, 7.0]


def test_versioned_path_with_timeout_in_microseconds(client):
    rows = _rows(2)
    result = client.infer("emulated", [_input(rows)], model_version="1", timeout=5_000_000)
    assert result.get_response()["model_version"] == "1"
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), rows.sum(axis=1), rtol=1e-5)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("num_rows, length", [(4, 16), (64, 512)])  # answered early; a body past the read buffer
def test_a_compressed_request_body_is_decompressed(client, algorithm, num_rows, length):
    rows = _rows(num_rows, length)
    result = client.infer("emulated", [_input(rows)], headers=roomy(), request_compression_algorithm=algorithm)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), rows.sum(axis=1), rtol=1e-4)


def _decompressed(raw: bytes, coding: str | None) -> bytes:
    return gzip.decompress(raw) if coding == "gzip" else zlib.decompress(raw) if coding == "deflate" else raw


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("binary_data", [True, False])
@pytest.mark.parametrize("length", [4, 64])  # answered early; a body past the read buffer (the ASGI path)
def test_a_response_is_compressed_as_tritonclient_asks(demo_server, client, algorithm, binary_data, length):
    """`response_compression_algorithm` (Accept-Encoding) gets a gzip or deflate body, whose
    Inference-Header-Content-Length counts the uncompressed JSON header, as in Triton."""
    rows = _rows(512, length)
    inputs = [_input(rows, binary_data)]
    outputs = [triton.InferRequestedOutput("OUTPUT0", binary_data=binary_data)]
    result = client.infer("emulated", inputs, outputs=outputs, headers=roomy(),
                          response_compression_algorithm=algorithm)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), rows.sum(axis=1), rtol=1e-4)

    body, json_size = triton.InferenceServerClient.generate_request_body(inputs, outputs=outputs)
    headers = {"Accept-Encoding": algorithm, **roomy()}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    with httpx.stream("POST", f"{demo_server.url}/v2/models/emulated/infer", content=body, headers=headers,
                      timeout=60) as response:
        raw = b"".join(response.iter_raw())  # as sent, not decompressed
    assert response.status_code == 200, raw
    assert response.headers["content-encoding"] == algorithm
    assert "accept-encoding" in response.headers["vary"].lower()
    assert int(response.headers["content-length"]) == len(raw)
    whole = _decompressed(raw, algorithm)
    assert len(raw) < len(whole)
    header_length = response.headers.get("inference-header-content-length")
    assert (header_length is not None) == binary_data
    if header_length is not None:  # the uncompressed header's length
        assert json.loads(whole[:int(header_length)])["outputs"][0]["parameters"]["binary_data_size"] == 512 * 4
    again = triton.InferResult.from_response_body(raw, header_length=None if header_length is None
                                                  else int(header_length), content_encoding=algorithm)
    np.testing.assert_allclose(again.as_numpy("OUTPUT0"), rows.sum(axis=1), rtol=1e-4)


@pytest.mark.parametrize("accept, coding", [
    (None, None), ("identity", None), ("br", None), ("gzip;q=0", None), ("gzip;q=0.4, identity;q=0.9", None),
    ("gzip, deflate", "gzip"), ("deflate;q=1, gzip;q=0.5", "deflate"), ("*", "gzip"), ("x-gzip", "gzip"),
    ("gzip;q=0, *;q=0.1", "deflate"),
])
def test_accept_encoding_q_values_and_identity_are_honoured(demo_server, accept, coding):
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [256, 2], "datatype": "FP32", "data": [0.5] * 512}]})
    headers = {"Content-Type": "application/json", **roomy()}
    if accept is not None:
        headers["Accept-Encoding"] = accept
    with httpx.Client(timeout=60) as http:
        http.headers.pop("accept-encoding")  # httpx's own default asks for gzip and deflate
        with http.stream("POST", f"{demo_server.url}/v2/models/emulated/infer", content=body,
                         headers=headers) as response:
            raw = b"".join(response.iter_raw())
    assert response.status_code == 200, raw
    assert response.headers.get("content-encoding") == coding
    assert "accept-encoding" in response.headers["vary"].lower()  # the answer depends on it, whatever was sent
    assert json.loads(_decompressed(raw, coding))["outputs"][0]["data"] == [1.0] * 256


def test_json_answers_of_other_routes_are_compressed_and_small_ones_are_not(demo_server):
    """httpx (and the `openai` SDK on it) asks for gzip on every request and decompresses itself:
    /metrics is compressed (Prometheus asks too), OpenAI's answers never (the SDK asks unbidden;
    compressing each embedding would cost the gateway more than it saves on a cluster's network)."""
    metrics = httpx.get(f"{demo_server.url}/metrics")
    assert metrics.headers["content-encoding"] == "gzip" and "sluice_requests_total" in metrics.text
    import openai

    sdk = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="unused", max_retries=0)
    raw = sdk.embeddings.with_raw_response.create(model="minilm", input=["hello", "world"], extra_headers=roomy())
    assert "content-encoding" not in raw.headers and int(raw.headers["content-length"]) > 1024
    assert [len(item.embedding) for item in raw.parse().data] == [384, 384]
    small = httpx.get(f"{demo_server.url}/v2/health/ready")
    assert "content-encoding" not in small.headers and small.json() == {"ready": True}


def _post(server, path: str, body: bytes, encoding: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=body, timeout=60,
                      headers={"Content-Type": "application/json", "Content-Encoding": encoding, **roomy()})


@pytest.mark.parametrize("path", ["/v2/models/emulated/infer", "/v1/embeddings"])
def test_a_body_that_decompresses_past_the_limit_is_413_not_held_in_memory(demo_server, path):
    bomb = gzip.compress(b" " * (64 << 20))  # 64 KB on the wire, 64 MiB once decompressed
    response = _post(demo_server, path, bomb, "gzip")
    assert response.status_code == 413
    error = response.json()["error"]
    assert "limit" in (error if path.startswith("/v2") else error["message"])


@pytest.mark.parametrize("path", ["/v2/models/emulated/infer", "/v1/embeddings"])
def test_an_unknown_encoding_is_415_and_a_corrupt_body_400_in_the_routes_error_shape(demo_server, path):
    body = json.dumps({"model": "minilm", "input": "hi"}).encode()
    unknown = _post(demo_server, path, body, "br")
    assert unknown.status_code == 415
    corrupt = _post(demo_server, path, gzip.compress(body)[:-9], "gzip")
    assert corrupt.status_code == 400
    for response, word in ((unknown, "br"), (corrupt, "gzip")):
        error = response.json()["error"]
        assert word in (error if path.startswith("/v2") else error["message"])


def test_a_compressed_openai_request_is_answered(demo_server):
    body = json.dumps({"model": "minilm", "input": ["hello", "world"]}).encode()
    for encoding, compressed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        response = _post(demo_server, "/v1/embeddings", compressed, encoding)
        assert response.status_code == 200, response.text
        assert len(response.json()["data"]) == 2


@pytest.mark.parametrize("binary_data", [True, False])
def test_bytes_input_to_minilm(client, binary_data):
    texts = np.array([b"hello world", "caf\u00e9 au lait".encode(), b"a third sentence"], dtype=object)
    result = client.infer("minilm", [_input(texts, binary_data, name="text", datatype="BYTES")], headers=roomy())
    embeddings = result.as_numpy("embedding")
    assert embeddings.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-3)


def test_bytes_input_with_trailing_unit_dimension(client):
    texts = np.array([[b"one"], [b"two"]], dtype=object)
    result = client.infer("minilm", [_input(texts, name="text", datatype="BYTES")], headers=roomy())
    assert result.as_numpy("embedding").shape == (2, 384)


def test_bytes_input_that_is_not_utf8_is_400_naming_the_input_and_element(client):
    texts = np.array([b"fine", b"caf\xe9"], dtype=object)  # latin-1, not UTF-8
    error = _error(lambda: client.infer("minilm", [_input(texts, name="text", datatype="BYTES")], headers=roomy()))
    assert error.status() == "400"
    assert "input 'text': element 1 holds bytes that are not UTF-8" in error.message(), error.message()


def _error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def test_unknown_model_raises_with_404(client):
    error = _error(lambda: client.infer("no-such-model", [_input(_rows())]))
    assert error.status() == "404"
    assert "no-such-model" in error.message()
    assert _error(lambda: client.get_model_metadata("no-such-model")).status() == "404"


def test_unknown_version_raises_with_404(client):
    error = _error(lambda: client.infer("emulated", [_input(_rows())], model_version="9"))
    assert error.status() == "404"
    assert "9" in error.message()


def test_wrong_input_name_raises_with_expected_name(client):
    error = _error(lambda: client.infer("emulated", [_input(_rows(), name="X")]))
    assert error.status() == "400"
    assert "INPUT0" in error.message()


def test_wrong_datatype_raises(client):
    ints = np.ones((2, 4), dtype=np.int32)
    error = _error(lambda: client.infer("emulated", [_input(ints, datatype="INT32")]))
    assert error.status() == "400"
    assert "FP32" in error.message()


def test_unknown_requested_output_raises(client):
    outputs = [triton.InferRequestedOutput("NOPE")]
    error = _error(lambda: client.infer("emulated", [_input(_rows())], outputs=outputs))
    assert error.status() == "400"
    assert "NOPE" in error.message()


def test_an_output_requested_twice_raises(client):
    outputs = [triton.InferRequestedOutput("OUTPUT0"), triton.InferRequestedOutput("OUTPUT0", binary_data=False)]
    error = _error(lambda: client.infer("emulated", [_input(_rows())], outputs=outputs, headers=roomy()))
    assert error.status() == "400"
    assert "'OUTPUT0' is requested more than once" in error.message()


def test_nan_row_raises_422(client):
    rows = _rows(2)
    rows[1, 3] = np.nan
    error = _error(lambda: client.infer("emulated", [_input(rows)], headers=roomy()))
    assert error.status() == "422"
    assert "NaN" in error.message()


def test_one_microsecond_timeout_raises_504(client):
    error = _error(lambda: client.infer("emulated", [_input(_rows())], timeout=1))
    assert error.status() == "504"
    assert "deadline" in error.message()


# -- Triton's classification extension -----------------------------------------------------------


def _top_classes(row: np.ndarray, count: int) -> list[tuple[float, int]]:
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:count]
    return [(float(row[i]), i) for i in order]


def _class(entry: bytes | str) -> list[str]:
    """A class as its value and index (tritonclient gives binary BYTES as bytes, JSON ones as str)."""
    return (entry.decode() if isinstance(entry, bytes) else entry).split(":")


@pytest.mark.parametrize("binary_data", [True, False])
def test_classification_answers_each_rows_top_classes_as_triton_does(client, binary_data):
    """`class_count=k`: each row's k highest values as `"value:index"` strings, highest first."""
    texts = np.array([b"a cat sits on the mat", b"stocks fell today"], dtype=object)
    text = _input(texts, name="text", datatype="BYTES")
    embeddings = client.infer("minilm", [text], headers=roomy()).as_numpy("embedding")
    outputs = [triton.InferRequestedOutput("embedding", binary_data=binary_data, class_count=3)]
    result = client.infer("minilm", [text], outputs=outputs, headers=roomy())
    assert result.get_output("embedding")["datatype"] == "BYTES"
    classes = result.as_numpy("embedding")
    assert classes.shape == (2, 3)
    for row, got in zip(embeddings, classes, strict=True):
        values, indices = zip(*(_class(entry) for entry in got), strict=True)
        expected = _top_classes(row, 3)
        assert [int(i) for i in indices] == [i for _, i in expected]
        assert [float(v) for v in values] == pytest.approx([v for v, _ in expected], abs=1e-6)
        assert all(len(v.split(".")[1]) == 6 for v in values)  # as C++'s std::to_string writes them


def test_classification_of_one_value_per_row_and_of_more_classes_than_a_row_holds(client):
    rows = _rows(3)
    outputs = [triton.InferRequestedOutput("OUTPUT0", class_count=5)]
    classes = client.infer("emulated", [_input(rows)], outputs=outputs, headers=roomy()).as_numpy("OUTPUT0")
    assert classes.shape == (3, 1)
    assert [float(_class(c)[0]) for c in classes[:, 0]] == pytest.approx(rows.sum(axis=1), abs=1e-4)
    assert {_class(c)[1] for c in classes[:, 0]} == {"0"}


@pytest.mark.parametrize("model, output, count, word", [
    ("emulated", "OUTPUT0", 0, "positive integer"),
    ("emulated", "OUTPUT0", "3", "positive integer"),
    ("tiny-lm", "text_output", 2, "numeric"),
])
def test_a_classification_that_cannot_be_answered_is_400(demo_server, model, output, count, word):
    inputs = [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}] if model == "emulated" else \
        [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]
    body = {"inputs": inputs, "outputs": [{"name": output, "parameters": {"classification": count}}]}
    response = httpx.post(f"{demo_server.url}/v2/models/{model}/infer", json=body, headers=roomy(), timeout=60)
    assert response.status_code == 400, response.text
    assert word in response.json()["error"]


# -- Triton's extensions: model configuration, statistics, repository index ---------------------


def test_model_configuration_is_what_triton_clients_read(client):
    """Triton's example clients size their batches and inputs from `max_batch_size` and `dims`
    (which leave out the batch dimension)."""
    extensions = set(client.get_server_metadata()["extensions"])
    assert {"model_configuration", "statistics", "model_repository", "schedule_policy"} <= extensions
    emulated = client.get_model_config("emulated")
    assert (emulated["name"], emulated["platform"], emulated["max_batch_size"]) == ("emulated", "sluice_emulated", 32)
    assert emulated["input"] == [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}]
    assert emulated["output"] == [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": []}]
    batching = emulated["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 0  # a batch starts when the device frees
    assert batching["default_queue_policy"]["default_timeout_microseconds"] == 90_000  # the model's SLO
    assert batching["default_queue_policy"]["timeout_action"] == "REJECT"
    assert emulated["instance_group"][0]["count"] == 1  # one worker serves it
    assert emulated["response_cache"] == {"enable": True}
    minilm = client.get_model_config("minilm", model_version="1")
    assert minilm["input"] == [{"name": "text", "data_type": "TYPE_STRING", "dims": []}]
    assert minilm["output"] == [{"name": "embedding", "data_type": "TYPE_FP32", "dims": [384]}]
    assert minilm["parameters"]["sluice_slo_ms"] == {"string_value": "500"}
    assert _error(lambda: client.get_model_config("no-such-model")).status() == "404"
    assert _error(lambda: client.get_model_config("emulated", model_version="9")).status() == "404"


def _version_stats(client, model: str) -> dict:
    (stats,) = client.get_inference_statistics(model, model_version="1")["model_stats"]
    return stats


def test_statistics_count_requests_items_batches_and_cache_hits(make_server, emulated_repo):
    """On a server of its own, so that the counts are exactly this test's requests."""
    server = make_server(emulated_repo(slo_ms=30000))
    own = triton.InferenceServerClient(url=f"127.0.0.1:{server.port}", network_timeout=60)
    for seed in range(3):  # one after another: each runs alone, a batch of its own 2 rows
        rows = np.random.default_rng(1000 + seed).standard_normal((2, 16)).astype(np.float32)
        own.infer("emulated", [_input(rows)])
    own.infer("emulated", [_input(rows)])  # the last one again: from the cache
    _error(lambda: own.infer("emulated", [_input(_rows())], timeout=1))  # past its deadline
    eventually(lambda: _version_stats(own, "emulated")["execution_count"] == 3, "the worker's batch report")
    stats = _version_stats(own, "emulated")
    inference = stats["inference_stats"]
    assert (inference["success"]["count"], inference["cache_hit"]["count"], inference["cache_miss"]["count"],
            inference["fail"]["count"]) == (4, 1, 3, 1)
    assert stats["inference_count"] == 6  # rows computed on the device, not the cached answer's
    assert inference["queue"]["count"] == inference["compute_infer"]["count"] == 3
    assert inference["compute_infer"]["ns"] >= 3 * 8_000_000  # ~8.5 ms per batch of 2 short rows
    assert inference["success"]["ns"] > inference["compute_infer"]["ns"]
    (batches,) = stats["batch_stats"]
    assert batches["batch_size"] == 2 and batches["compute_infer"]["count"] == 3
    assert batches["compute_infer"]["ns"] == pytest.approx(inference["compute_infer"]["ns"], rel=0.01)
    assert stats["last_inference"] / 1000 == pytest.approx(time.time(), abs=60)
    own.close()


def test_statistics_of_every_model_and_unknown_ones(client):
    client.infer("emulated", [_input(_rows(1))], headers=roomy())
    everything = client.get_inference_statistics()["model_stats"]
    assert {("emulated", "1"), ("minilm", "1")} <= {(s["name"], s["version"]) for s in everything}
    assert _error(lambda: client.get_inference_statistics("no-such-model")).status() == "404"


def test_repository_index_lists_ready_versions_and_loading_follows_the_repository(client):
    index = client.get_model_repository_index()
    assert {"name": "emulated", "version": "1", "state": "READY", "reason": ""} in index
    assert {(entry["name"], entry["state"]) for entry in index} >= {("minilm", "READY")}
    client.load_model("emulated")  # the repository has not changed: nothing to do
    assert client.is_model_ready("emulated")
    error = _error(lambda: client.load_model("emulated", config='{"max_batch_size": 8}'))
    assert error.status() == "400" and "repository folder" in error.message()


# -- Triton's extensions sluice does not offer: shared memory, trace, logging ----------------------


@pytest.mark.parametrize("call, words", [
    (lambda c: c.get_system_shared_memory_status(), "shared-memory"),
    (lambda c: c.register_system_shared_memory("region", "/sluice-test", 64), "shared-memory"),
    (lambda c: c.unregister_system_shared_memory("region"), "shared-memory"),
    (lambda c: c.get_cuda_shared_memory_status(), "shared-memory"),
    (lambda c: c.unregister_cuda_shared_memory(), "shared-memory"),
    (lambda c: c.get_trace_settings(model_name="emulated"), "OpenTelemetry"),
    (lambda c: c.update_trace_settings(settings={"trace_rate": "1"}), "OpenTelemetry"),
    (lambda c: c.get_log_settings(), "--log-level"),
    (lambda c: c.update_log_settings({"log_verbose_level": 1}), "--log-level"),
])
def test_an_extension_sluice_does_not_offer_is_501_saying_what_to_do_instead(client, call, words):
    error = _error(lambda: call(client))
    assert error.status() == "501"  # Triton's answer to a feature it lacks; not a 404 "no route"
    assert words in error.message()


def test_tensors_in_shared_memory_are_refused_with_501_not_read_as_missing_or_answered_in_the_body(client,
                                                                                                  demo_server):
    invalid = metric_total(demo_server, "sluice_requests_total", model="emulated", outcome="invalid")
    tensor = triton.InferInput("INPUT0", [2, 4], "FP32")
    tensor.set_shared_memory("region", 32)
    error = _error(lambda: client.infer("emulated", [tensor], headers=roomy()))
    assert error.status() == "501" and "input 'INPUT0' is in shared memory" in error.message()
    # the client's request, counted as its other mistakes are (not a failure of the model's)
    assert metric_total(demo_server, "sluice_requests_total", model="emulated", outcome="invalid") == invalid + 1
    output = triton.InferRequestedOutput("OUTPUT0")
    output.set_shared_memory("region", 8)
    error = _error(lambda: client.infer("emulated", [_input(_rows(2))], outputs=[output], headers=roomy()))
    assert error.status() == "501" and "output 'OUTPUT0' is in shared memory" in error.message()
