"""The real `tritonclient.http` against `/v2`: health, metadata, binary and JSON tensors, errors.

tritonclient sends infer bodies without a Content-Type, uses the binary tensor extension by
default, and when no outputs are named sets `parameters.binary_data_output` so that every
output comes back binary.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException


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
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]


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


def test_versioned_path_with_timeout_in_microseconds(client):
    rows = _rows(2)
    result = client.infer("emulated", [_input(rows)], model_version="1", timeout=5_000_000)
    assert result.get_response()["model_version"] == "1"
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), rows.sum(axis=1), rtol=1e-5)


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
