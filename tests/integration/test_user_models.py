"""A user's own models through a real server: an ONNX graph (`kind = "onnx"`) and a `model.py`
(`kind = "python"`), each with several named inputs and outputs, driven by `tritonclient` over
HTTP (JSON and binary) and gRPC; rows of concurrent requests batched together; bad input and a
failing model answered with clear errors. And an embedding model's ONNX export (`kind =
"embedding"`, `backend = "onnx"`) through the `openai` SDK."""

from __future__ import annotations

import base64
import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, free_port, metric_total, start_server
from tests.user_models import (
    SCORER_WEIGHTS,
    write_onnx_embedding,
    write_onnx_fixed_rows,
    write_onnx_scorer,
    write_python_bf16,
    write_python_labeller,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, int]]:
    folder = tmp_path_factory.mktemp("user-models")
    repo = folder / "models"
    write_onnx_scorer(repo)
    write_python_labeller(repo, params='suffix = "!"\ndelay_ms = 10')
    write_onnx_embedding(repo)
    write_onnx_fixed_rows(repo, 1)
    write_python_bf16(repo)
    grpc_port = free_port()
    started = start_server(repo, folder, "--grpc-port", str(grpc_port))
    yield started, grpc_port
    started.stop()


@pytest.fixture(scope="module")
def client(server) -> Iterator[triton.InferenceServerClient]:
    sdk = triton.InferenceServerClient(url=f"127.0.0.1:{server[0].port}", network_timeout=60)
    yield sdk
    sdk.close()


def _input(name: str, array: np.ndarray, datatype: str, binary_data: bool = True, module=triton):
    tensor = module.InferInput(name, list(array.shape), datatype)
    if module is triton:
        tensor.set_data_from_numpy(array, binary_data=binary_data)
    else:
        tensor.set_data_from_numpy(array)
    return tensor


def _scorer_inputs(features: np.ndarray, offset: np.ndarray, ids: np.ndarray, binary_data: bool = True,
                   module=triton):
    return [_input("features", features, "FP32", binary_data, module),
            _input("offset", offset, "FP32", binary_data, module),
            _input("ids", ids, "INT64", binary_data, module)]


def _scorer_data(rows: int, length: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, 4)).astype(np.float32), rng.standard_normal((rows, 1)).astype(np.float32),
            rng.integers(0, 100, (rows, length)).astype(np.int64))


def test_metadata_comes_from_the_onnx_graph_and_the_model_toml(client):
    scorer = client.get_model_metadata("scorer")
    assert scorer["platform"] == "sluice_onnx"
    assert scorer["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 4]},
                                {"name": "offset", "datatype": "FP32", "shape": [-1, 1]},
                                {"name": "ids", "datatype": "INT64", "shape": [-1, -1]}]
    assert [o["name"] for o in scorer["outputs"]] == ["scores", "best", "total", "doubled"]
    labeller = client.get_model_metadata("labeller")
    assert labeller["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]},
                                  {"name": "x", "datatype": "FP32", "shape": [-1, 2]}]
    config = client.get_model_config("scorer")
    assert [i["name"] for i in config["input"]] == ["features", "offset", "ids"]


@pytest.mark.parametrize("binary_data", [True, False])
def test_onnx_model_answers_every_output_over_http(client, binary_data):
    features, offset, ids = _scorer_data(5)
    result = client.infer("scorer", _scorer_inputs(features, offset, ids, binary_data),
                          outputs=[triton.InferRequestedOutput(name, binary_data=binary_data)
                                   for name in ("scores", "best", "total")])
    scores = features @ SCORER_WEIGHTS + offset
    np.testing.assert_allclose(result.as_numpy("scores"), scores, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(result.as_numpy("best"), scores.argmax(axis=1))
    np.testing.assert_array_equal(result.as_numpy("total"), ids.sum(axis=1))


def test_only_the_outputs_asked_for_come_back(client):
    features, offset, ids = _scorer_data(2)
    result = client.infer("scorer", _scorer_inputs(features, offset, ids),
                          outputs=[triton.InferRequestedOutput("total")])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["total"]
    np.testing.assert_array_equal(result.as_numpy("total"), ids.sum(axis=1))


def test_onnx_model_over_grpc(server):
    features, offset, ids = _scorer_data(3, length=7)
    with triton_grpc.InferenceServerClient(url=f"127.0.0.1:{server[1]}") as grpc_client:
        result = grpc_client.infer("scorer", _scorer_inputs(features, offset, ids, module=triton_grpc))
        np.testing.assert_allclose(result.as_numpy("scores"), features @ SCORER_WEIGHTS + offset,
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(result.as_numpy("total"), ids.sum(axis=1))
        labelled = grpc_client.infer("labeller", [
            _input("text", np.array([b"grpc", b"ok"], dtype=object), "BYTES", module=triton_grpc),
            _input("x", np.ones((2, 2), np.float32), "FP32", module=triton_grpc)])
        assert labelled.as_numpy("label").tolist() == [b"GRPC!", b"OK!"]


def test_python_model_with_text_in_and_out(server, client):
    texts = np.array([b"hello", "naïve".encode()], dtype=object)
    x = np.array([[1, 2], [3, 4]], dtype=np.float32)
    result = client.infer("labeller", [_input("text", texts, "BYTES"), _input("x", x, "FP32")])
    assert result.as_numpy("label").tolist() == [b"HELLO!", "NAÏVE!".encode()]
    np.testing.assert_array_equal(result.as_numpy("score"), [3, 7])
    assert result.as_numpy("warmed").tolist() == [True, True]  # its warmup() ran before it served
    as_json = httpx.post(f"{server[0].url}/v2/models/labeller/infer", json={"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["json"]},
        {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [0.5, 0.25]}]})
    assert as_json.status_code == 200, as_json.text
    outputs = {o["name"]: o for o in as_json.json()["outputs"]}
    assert outputs["label"] == {"name": "label", "datatype": "BYTES", "shape": [1], "data": ["JSON!"]}
    assert outputs["score"]["data"] == [0.75]


def _every_bf16() -> np.ndarray:
    """Every BF16 bit pattern (NaNs, infinities, zeros of both signs, subnormals), as 4 rows."""
    return np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(4, -1)


def _check_bf16_answer(result, x: np.ndarray) -> None:
    same, wide, half = result.as_numpy("same"), result.as_numpy("wide"), result.as_numpy("half")
    assert same.dtype == half.dtype == ml_dtypes.bfloat16 and same.shape == x.shape
    assert same.tobytes() == x.tobytes()  # every bit as sent, NaN payloads too
    assert wide.dtype == np.float32
    np.testing.assert_array_equal(wide, x.astype(np.float32))  # the model saw each value exactly
    with np.errstate(invalid="ignore"):  # (signalling NaNs among the patterns)
        expected_half = (x.astype(np.float32) / 2).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(half.astype(np.float32), expected_half.astype(np.float32))  # (NaN == NaN)


def test_bf16_tensors_round_trip_through_tritonclient_http_and_grpc(server, client):
    """BF16 in and out, as tritonclient sends and reads it (`ml_dtypes.bfloat16` arrays): binary
    over HTTP (its only way for BF16), raw contents over gRPC; the model sees bfloat16 arrays."""
    x = _every_bf16()
    assert client.get_model_metadata("bf16")["inputs"] == [{"name": "x", "datatype": "BF16", "shape": [-1, -1]}]
    _check_bf16_answer(client.infer("bf16", [_input("x", x, "BF16")],
                                    outputs=[triton.InferRequestedOutput(n, binary_data=True)
                                             for n in ("same", "wide", "half")]), x)
    with triton_grpc.InferenceServerClient(url=f"127.0.0.1:{server[1]}") as grpc_client:
        _check_bf16_answer(grpc_client.infer("bf16", [_input("x", x, "BF16", module=triton_grpc)]), x)


def test_bf16_as_json_numbers(server, client):
    """In JSON a BF16 tensor is numbers: rounded to the nearest bfloat16 going in, and given back
    exactly (tritonclient reads them into a bfloat16 array)."""
    sent = [1.5, -2.25, 3.14159, 1e-40, 0]
    response = httpx.post(f"{server[0].url}/v2/models/bf16/infer", json={
        "inputs": [{"name": "x", "datatype": "BF16", "shape": [1, 5], "data": sent}]})
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o for o in response.json()["outputs"]}
    rounded = np.array(sent, dtype=ml_dtypes.bfloat16).astype(np.float64).tolist()
    assert rounded[2] == 3.140625
    assert outputs["same"] == {"name": "same", "datatype": "BF16", "shape": [1, 5], "data": rounded}
    assert outputs["wide"]["data"] == rounded
    as_json = client.infer("bf16", [_input("x", np.array([[0.5, -8]], ml_dtypes.bfloat16), "BF16")],
                           outputs=[triton.InferRequestedOutput("half", binary_data=False)])
    assert as_json.as_numpy("half").tolist() == [[0.25, -4]]


def test_bf16_mistakes_are_refused_with_the_reason(server, client):
    url = f"{server[0].url}/v2/models/bf16/infer"
    cases = [  # (body, what the error says)
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}, "must be BF16, got FP32"),
        ({"inputs": [{"name": "x", "datatype": "BF16", "shape": [1, 2], "data": [1, 1e39]}]}, "out of range for BF16"),
        ({"inputs": [{"name": "x", "datatype": "BF16", "shape": [1, 2], "data": [1, "2"]}]}, "not a BF16 array"),
    ]
    for body, message in cases:
        response = httpx.post(url, json=body)
        assert response.status_code == 400 and message in response.json()["error"], response.text
    header = b'{"inputs": [{"name": "x", "datatype": "BF16", "shape": [1, 2], "parameters": {"binary_data_size": 3}}]}'
    response = httpx.post(url, content=header + b"\0\0\0",
                          headers={"Inference-Header-Content-Length": str(len(header))})
    assert response.status_code == 400 and "3 bytes do not match shape [1, 2]" in response.json()["error"]
    x = np.ones((1, 2), ml_dtypes.bfloat16)
    with pytest.raises(InferenceServerException) as caught:  # BF16 is not converted to a model's FP32
        client.infer("labeller", [_input("text", np.array([b"a"], dtype=object), "BYTES"), _input("x", x, "BF16")])
    assert caught.value.status() == "400" and "must be FP32, got BF16" in caught.value.message()

    short = service_pb2.ModelInferRequest(model_name="bf16")  # (tritonclient sends only whole arrays)
    short.inputs.add(name="x", datatype="BF16", shape=[1, 2])
    short.raw_input_contents.append(b"\0\0\0")
    typed = service_pb2.ModelInferRequest(model_name="bf16")  # Triton takes BF16 only raw, too
    typed.inputs.add(name="x", datatype="BF16", shape=[1, 2]).contents.fp32_contents.extend([1.0, 2.0])
    with grpc.insecure_channel(f"127.0.0.1:{server[1]}") as channel:
        infer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        for request, message in ((short, "3 bytes do not match shape [1, 2]"),
                                 (typed, "BF16 data must be sent in raw_input_contents")):
            with pytest.raises(grpc.RpcError) as caught:
                infer(request, timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in caught.value.details()


def test_concurrent_requests_rows_run_in_one_call(server):
    """Rows of concurrent requests share calls of the model (its `batch` output is the size of
    the call each row ran in); rows of different lengths are answered right (that they run as one
    call per shape is `tests/engines/test_user_models.py`'s)."""
    url = server[0].url

    def label(i: int) -> int:
        response = httpx.post(f"{url}/v2/models/labeller/infer", timeout=60, json={"inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [1], "data": [f"r{i}"]},
            {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [i, i]}]})
        outputs = {o["name"]: o["data"] for o in response.json()["outputs"]}
        assert outputs["label"] == [f"R{i}!"] and outputs["score"] == [2 * i]
        return int(outputs["batch"][0])

    before = metric_total(server[0], "sluice_batch_size_count", model="labeller")
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        sizes = list(pool.map(label, range(96)))
    assert max(sizes) > 1, sizes
    assert metric_total(server[0], "sluice_batch_size_count", model="labeller") - before < 96

    def score(i: int) -> None:
        features, offset, ids = _scorer_data(1, length=1 + i % 5, seed=i)
        response = httpx.post(f"{url}/v2/models/scorer/infer", timeout=60, json={"inputs": [
            {"name": "features", "datatype": "FP32", "shape": [1, 4], "data": features.ravel().tolist()},
            {"name": "offset", "datatype": "FP32", "shape": [1, 1], "data": offset.ravel().tolist()},
            {"name": "ids", "datatype": "INT64", "shape": list(ids.shape), "data": ids.ravel().tolist()}],
            "outputs": [{"name": "total"}]})
        assert response.json()["outputs"][0]["data"] == ids.sum(axis=1).tolist()

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(score, range(60)))


def test_a_row_the_model_raises_on_fails_alone(client):
    texts = np.array([b"fine", b"boom", b"also fine"], dtype=object)
    x = np.zeros((3, 2), dtype=np.float32)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("labeller", [_input("text", texts, "BYTES"), _input("x", x, "FP32")])
    assert caught.value.status() == "422"
    assert "cannot label boom" in caught.value.message()
    alone = client.infer("labeller", [_input("text", texts[:1], "BYTES"), _input("x", x[:1], "FP32")])
    assert alone.as_numpy("label").tolist() == [b"FINE!"]


@pytest.mark.parametrize(("inputs", "status", "message"), [
    ([{"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}], 400, "needs input 'offset'"),
    ([{"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
      {"name": "offset", "datatype": "FP32", "shape": [1, 1], "data": [0]},
      {"name": "ids", "datatype": "INT64", "shape": [1, 1], "data": [1]},
      {"name": "extra", "datatype": "FP32", "shape": [1], "data": [1]}], 400, "no input named 'extra'"),
    ([{"name": "features", "datatype": "FP64", "shape": [1, 4], "data": [1, 2, 3, 4]},
      {"name": "offset", "datatype": "FP32", "shape": [1, 1], "data": [0]},
      {"name": "ids", "datatype": "INT64", "shape": [1, 1], "data": [1]}], 400, "must be FP32"),
    ([{"name": "features", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]},
      {"name": "offset", "datatype": "FP32", "shape": [1, 1], "data": [0]},
      {"name": "ids", "datatype": "INT64", "shape": [1, 1], "data": [1]}], 400, "must have shape like [-1, 4]"),
    ([{"name": "features", "datatype": "FP32", "shape": [2, 4], "data": [0] * 8},
      {"name": "offset", "datatype": "FP32", "shape": [1, 1], "data": [0]},
      {"name": "ids", "datatype": "INT64", "shape": [2, 1], "data": [1, 2]}], 400, "same first (batch) dimension"),
    ([{"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
      {"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
      {"name": "offset", "datatype": "FP32", "shape": [1, 1], "data": [0]},
      {"name": "ids", "datatype": "INT64", "shape": [1, 1], "data": [1]}], 400, "given more than once"),
])
def test_bad_inputs_are_refused_with_the_reason(server, inputs, status, message):
    response = httpx.post(f"{server[0].url}/v2/models/scorer/infer", json={"inputs": inputs})
    assert response.status_code == status, response.text
    assert message in response.json()["error"]


def test_an_unknown_requested_output_is_refused_before_running(server):
    response = httpx.post(f"{server[0].url}/v2/models/scorer/infer", json={
        "inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
                   {"name": "offset", "datatype": "FP32", "shape": [1, 1], "data": [0]},
                   {"name": "ids", "datatype": "INT64", "shape": [1, 1], "data": [1]}],
        "outputs": [{"name": "nope"}]})
    assert response.status_code == 400
    assert "no output named 'nope'" in response.json()["error"]
    assert "'scores', 'best', 'total'" in response.json()["error"]


def test_a_changed_model_py_is_refused_and_others_serve(tmp_path: Path):
    repo = tmp_path / "models"
    write_python_labeller(repo)
    write_onnx_scorer(repo)
    code = repo / "labeller" / "1" / "model.py"
    code.write_text(code.read_text() + "\n# changed after its checksum was taken\n")
    started = start_server(repo, tmp_path)
    try:
        for answer in (httpx.get(f"{started.url}/v2/models/labeller"),
                       httpx.post(f"{started.url}/v2/models/labeller/infer", json={"inputs": []})):
            assert answer.status_code == 404  # not served, with why, until the repository is fixed
            assert "checksum mismatch for model.py" in answer.json()["error"]
        features, offset, ids = _scorer_data(1)
        with triton.InferenceServerClient(url=f"127.0.0.1:{started.port}") as sdk:
            result = sdk.infer("scorer", _scorer_inputs(features, offset, ids))
        np.testing.assert_array_equal(result.as_numpy("total"), ids.sum(axis=1))
    finally:
        started.stop()


def test_an_onnx_embedding_model_through_the_openai_sdk(server):
    import openai

    client = openai.OpenAI(base_url=f"{server[0].url}/v1", api_key="unused", max_retries=0)
    texts = ["A man is playing a guitar.", "A man plays the guitar.", "The stock market fell today."]
    answer = client.embeddings.create(model="minilm-onnx", input=texts)
    vectors = np.array([item.embedding for item in answer.data])
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert vectors[0] @ vectors[1] > 0.8 > vectors[0] @ vectors[2]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 10
    packed = client.embeddings.create(model="minilm-onnx", input=texts[0], encoding_format="base64")
    raw = base64.b64decode(packed.data[0].embedding)  # asked for by name, the SDK leaves it encoded
    np.testing.assert_allclose(np.frombuffer(raw, np.float32), vectors[0], atol=1e-6)


def test_the_banner_shows_a_request_that_works(server):
    """With no model of one FP32 input, `sluice serve` prints a curl line for a model of named
    inputs; its body is answered."""
    line = next(line for line in server[0].log().splitlines() if "/infer -d '" in line)
    url, body = line.split("curl ", 1)[1].split(" -d ", 1)
    response = httpx.post(url, content=body.strip().strip("'"), timeout=60)
    assert response.status_code == 200, response.text


def test_a_graph_exported_for_one_row_takes_one_row_per_request(server):
    one = httpx.post(f"{server[0].url}/v2/models/fixed/infer", timeout=30, json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, -2, 3, -4]}]})
    assert one.status_code == 200, one.text
    assert one.json()["outputs"][0]["data"] == [1, 0, 3, 0]
    two = httpx.post(f"{server[0].url}/v2/models/fixed/infer", timeout=30, json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "data": [0] * 8}]})
    assert two.status_code == 400 and "must have shape like [1, 4]" in two.json()["error"]
