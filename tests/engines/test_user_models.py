"""The `onnx` and `python` runners on their own: named tensors in and out, rows of different
shapes run as separate calls, warm-up, and what a broken model folder or model answers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sluice import wire
from sluice.engines import load_runner
from sluice.engines.named_tensors import NamedTensorRunner
from sluice.errors import ConfigError, InvalidInput
from sluice.repository import MANIFEST, ModelVersion, scan_repository, write_manifest
from sluice.worker.device import run_isolating
from tests.user_models import (
    LABELLER,
    SCORER_WEIGHTS,
    write_onnx_fixed_rows,
    write_onnx_scorer,
    write_python_labeller,
)


def _version(repo: Path, name: str) -> ModelVersion:
    found = scan_repository(repo)
    assert not found.refused, found.refused
    return next(v for v in found.versions if v.name == name)


def _tensor(name: str, array: np.ndarray, datatype: str) -> wire.NamedTensor:
    if datatype == "BYTES":
        return wire.NamedTensor(name, datatype, array.shape, wire.encode_bytes_elements(list(array.ravel())))
    return wire.NamedTensor(name, datatype, array.shape, array.tobytes())


def _scorer_request(rows: int, length: int) -> tuple[wire.TensorsPayload, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(length)
    features = rng.standard_normal((rows, 4)).astype(np.float32)
    ids = rng.integers(0, 50, (rows, length)).astype(np.int64)
    offset = np.ones((rows, 1), np.float32)
    # inputs in another order than the model declares them: matched by name
    payload = wire.TensorsPayload([_tensor("ids", ids, "INT64"), _tensor("features", features, "FP32"),
                                   _tensor("offset", offset, "FP32")])
    return payload, features @ SCORER_WEIGHTS + 1, ids.sum(axis=1)


@pytest.fixture
def scorer(tmp_path: Path) -> NamedTensorRunner:
    runner = load_runner(_version(write_onnx_scorer(tmp_path / "models"), "scorer"), "cpu")
    assert isinstance(runner, NamedTensorRunner)
    return runner


@pytest.fixture
def labeller(tmp_path: Path) -> NamedTensorRunner:
    runner = load_runner(_version(write_python_labeller(tmp_path / "models"), "labeller"), "cpu")
    assert isinstance(runner, NamedTensorRunner)
    return runner


def test_onnx_interface_comes_from_the_graph(scorer):
    assert scorer.info.named_io and not scorer.info.accepts_text
    assert [(s.name, s.datatype, s.shape) for s in scorer.info.inputs] == [
        ("features", "FP32", (-1, 4)), ("offset", "FP32", (-1, 1)), ("ids", "INT64", (-1, -1))]
    assert [(s.name, s.datatype, s.shape) for s in scorer.info.outputs] == [
        ("scores", "FP32", (-1, 3)), ("best", "INT64", (-1,)), ("total", "INT64", (-1,)),
        ("doubled", "INT64", (-1, -1))]


def test_rows_of_several_requests_and_shapes_in_one_batch(scorer):
    requests = [_scorer_request(2, 3), _scorer_request(1, 5), _scorer_request(3, 3)]
    items_per_request = [scorer.prepare(payload) for payload, _, _ in requests]
    assert [item.cost for item in items_per_request[1]] == [5]  # the most elements of a row's inputs
    outputs = scorer.run_batch([item for items in items_per_request for item in items])
    start = 0
    for (_, scores, totals), items in zip(requests, items_per_request, strict=True):
        answer = scorer.pack(outputs[start:start + len(items)])
        start += len(items)
        assert isinstance(answer, wire.TensorsPayload)
        by_name = {t.name: t for t in answer.tensors}
        assert by_name["scores"].shape == scores.shape
        np.testing.assert_allclose(np.frombuffer(by_name["scores"].data, np.float32).reshape(scores.shape), scores,
                                   rtol=1e-5)
        np.testing.assert_array_equal(np.frombuffer(by_name["total"].data, np.int64), totals)


def test_onnx_warmup_times_batches_for_the_profile(scorer):
    observations = scorer.warmup()
    assert [cost for cost, _ in observations[::3]] == [4, 16, 64]  # 1, 4 and 16 rows of 4 elements
    assert all(seconds > 0 for _, seconds in observations)


def test_a_tensor_payload_is_refused_with_the_inputs_named(scorer):
    with pytest.raises(InvalidInput, match="takes named tensors \\(features, offset, ids\\)"):
        scorer.prepare(wire.TensorPayload("float32", (1, 4), bytes(16)))


def _fixed_batch_graph(repo: Path, rows: int) -> ModelVersion:
    return _version(write_onnx_fixed_rows(repo, rows), "fixed")


def test_a_graph_exported_for_one_row_runs_one_row_per_call(tmp_path: Path):
    runner = load_runner(_fixed_batch_graph(tmp_path / "models", 1), "cpu")
    assert isinstance(runner, NamedTensorRunner) and runner.one_row_per_call
    assert runner.info.inputs[0].shape == (1, 4)  # requests give the shape as it is (the API checks it)
    rows = [np.array([[i, -i, 2 * i, -1]], np.float32) for i in range(3)]
    items = [item for row in rows for item in runner.prepare(wire.TensorsPayload([_tensor("x", row, "FP32")]))]
    for row, output in zip(rows, runner.run_batch(items), strict=True):  # a batch of 3 runs as 3 calls
        answer = runner.pack([output])
        np.testing.assert_array_equal(np.frombuffer(answer.tensors[0].data, np.float32), np.maximum(row, 0).ravel())


def test_a_graph_with_another_fixed_batch_dimension_is_refused(tmp_path: Path):
    with pytest.raises(ConfigError, match="input 'x' has shape \\[2, 4\\]: its first dimension must be variable"):
        load_runner(_fixed_batch_graph(tmp_path / "models", 2), "cpu")


def test_a_file_onnx_runtime_cannot_read_is_refused(tmp_path: Path):
    repo = write_onnx_scorer(tmp_path / "models")
    (repo / "scorer" / "1" / "model.onnx").write_bytes(b"not a graph")
    with pytest.raises(ConfigError, match=r"ONNX Runtime cannot load model\.onnx"):
        load_runner(_version(repo, "scorer"), "cpu")


def test_python_model_gets_params_text_and_numbers(labeller):
    payload = wire.TensorsPayload([_tensor("text", np.array([b"ab", b"c"], dtype=object), "BYTES"),
                                   _tensor("x", np.array([[1, 2], [3, 5]], np.float32), "FP32")])
    answer = labeller.pack(labeller.run_batch(labeller.prepare(payload)))
    assert isinstance(answer, wire.TensorsPayload)
    by_name = {t.name: t for t in answer.tensors}
    assert wire.decode_bytes_elements(by_name["label"].data) == [b"AB!", b"C!"]
    assert np.frombuffer(by_name["score"].data, np.float32).tolist() == [3, 8]
    assert np.frombuffer(by_name["batch"].data, np.int64).tolist() == [2, 2]


def test_only_the_row_the_model_raises_on_fails(labeller):
    texts = np.array([b"a", b"boom", b"b", b"c"], dtype=object)
    payload = wire.TensorsPayload([_tensor("text", texts, "BYTES"), _tensor("x", np.zeros((4, 2), np.float32), "FP32")])
    outputs = run_isolating(labeller, labeller.prepare(payload))
    failures = [i for i, output in enumerate(outputs) if not isinstance(output, tuple)]
    assert failures == [1]
    assert "cannot label boom" in outputs[1].message


@pytest.mark.parametrize(("answer", "error"), [
    ("[1, 2]", "not a dict of output name -> array"),
    ('{"label": texts, "score": x.sum(axis=1), "warmed": np.ones(len(texts), bool)}', "gave no output 'batch'"),
    ('{"label": texts, "score": x.sum(axis=1), "batch": np.zeros(1, np.int64), "warmed": np.ones(len(texts), bool)}',
     "its first dimension must be the batch's 2 items"),
    ('{"label": texts, "score": x.sum(axis=1), "batch": np.full(len(texts), 0.5), "warmed": np.ones(len(texts), bool)}',
     "output 'batch' is float64, which is not INT64"),
    ('{"label": [1, 2], "score": x.sum(axis=1), "batch": np.zeros(len(texts), np.int64), '
     '"warmed": np.ones(len(texts), bool)}', "output 'label' \\(BYTES\\) holds int"),
])
def test_answers_that_do_not_fit_the_declared_outputs_fail_with_the_reason(tmp_path: Path, answer, error):
    code = LABELLER.replace("        return {\n", f"        return {answer}\n        return {{\n", 1)
    runner = load_runner(_version(write_python_labeller(tmp_path / "models", code=code), "labeller"), "cpu")
    payload = wire.TensorsPayload([_tensor("text", np.array([b"a", b"b"], dtype=object), "BYTES"),
                                   _tensor("x", np.zeros((2, 2), np.float32), "FP32")])
    with pytest.raises((TypeError, KeyError, ValueError), match=error):
        runner.run_batch(runner.prepare(payload))


@pytest.mark.parametrize(("code", "params", "error"), [
    ("class Other:\n    pass\n", "", "defines no class 'Model'"),
    ("class Model:\n    def __init__(self, path, device, params):\n        pass\n", "", "has no predict"),
    ("raise RuntimeError('no GPU here')\n", "", "loading model.py failed: RuntimeError: no GPU here"),
    (LABELLER, 'file = "other.py"', "no other.py in"),
])
def test_a_broken_model_py_is_refused_with_the_reason(tmp_path: Path, code, params, error):
    repo = write_python_labeller(tmp_path / "models", code=code, params=params)
    with pytest.raises(ConfigError, match=error):
        load_runner(_version(repo, "labeller"), "cpu")


def test_two_versions_of_a_python_model_keep_their_own_code(tmp_path: Path):
    repo = write_python_labeller(tmp_path / "models")
    second = repo / "labeller" / "2"
    second.mkdir()
    (second / "model.py").write_text(LABELLER.replace('t.decode().upper()', 't.decode().lower()'))
    write_manifest(second, second / MANIFEST)
    found = scan_repository(repo)
    runners = {v.version: load_runner(v, "cpu") for v in found.versions}
    payload = wire.TensorsPayload([_tensor("text", np.array([b"Ab"], dtype=object), "BYTES"),
                                   _tensor("x", np.zeros((1, 2), np.float32), "FP32")])
    labels = {}
    for version, runner in runners.items():
        answer = runner.pack(runner.run_batch(runner.prepare(payload)))
        labels[version] = wire.decode_bytes_elements(answer.tensors[0].data)
        runner.close()
    assert labels == {"1": [b"AB!"], "2": [b"ab!"]}


def test_model_py_imports_its_folders_other_files_relatively(tmp_path: Path):
    code = LABELLER.replace("import numpy as np\n", "import numpy as np\n\nfrom .suffixes import SUFFIX\n", 1)
    code = code.replace('params.get("suffix", "!")', "SUFFIX")
    repo = write_python_labeller(tmp_path / "models", code=code, params="")
    version = repo / "labeller" / "1"
    (version / "suffixes.py").write_text('SUFFIX = "?"\n')
    write_manifest(version, version / MANIFEST)
    version_info = _version(repo, "labeller")
    runner = load_runner(version_info, "cpu")
    payload = wire.TensorsPayload([_tensor("text", np.array([b"q"], dtype=object), "BYTES"),
                                   _tensor("x", np.zeros((1, 2), np.float32), "FP32")])
    answer = runner.pack(runner.run_batch(runner.prepare(payload)))
    assert wire.decode_bytes_elements(answer.tensors[0].data) == [b"Q?"]
    import sys

    package = f"sluice_model_labeller_1_{version_info.revision}"
    assert {name for name in sys.modules if name.startswith(package)} == \
        {package, f"{package}.model", f"{package}.suffixes"}
    runner.close()
    assert not [name for name in sys.modules if name.startswith(package)]


def test_a_request_of_no_rows_gets_empty_outputs_of_the_declared_shape(scorer):
    payload, _, _ = _scorer_request(0, 3)
    answer = scorer.pack(scorer.run_batch(scorer.prepare(payload)))
    assert [(t.name, t.shape) for t in answer.tensors] == [("scores", (0, 3)), ("best", (0,)), ("total", (0,)),
                                                           ("doubled", (0, 0))]


def test_padded_inputs_let_rows_of_different_lengths_share_a_call(tmp_path: Path):
    """With `[params.pad] ids = 0`, rows of 2, 5 and 3 ids run in one call padded to 5; the
    sums are unchanged by the zeros, and `doubled` (as long as the padded ids) comes back at
    each row's own length."""
    repo = write_onnx_scorer(tmp_path / "models", extra="[params.pad]\nids = 0\n")
    runner = load_runner(_version(repo, "scorer"), "cpu")
    assert isinstance(runner, NamedTensorRunner)
    calls: list[tuple[int, ...]] = []
    infer = runner.infer
    runner.infer = lambda inputs: calls.append(inputs["ids"].shape) or infer(inputs)  # type: ignore[method-assign]
    requests = [_scorer_request(1, 2), _scorer_request(2, 5), _scorer_request(1, 3)]
    items = [runner.prepare(payload) for payload, _, _ in requests]
    outputs = runner.run_batch([item for request in items for item in request])
    assert calls == [(4, 5)]
    start = 0
    for (payload, _, totals), request in zip(requests, items, strict=True):
        answer = runner.pack(outputs[start:start + len(request)])
        start += len(request)
        by_name = {t.name: t for t in answer.tensors}
        ids = next(t for t in payload.tensors if t.name == "ids")
        assert by_name["doubled"].shape == ids.shape
        np.testing.assert_array_equal(np.frombuffer(by_name["doubled"].data, np.int64),
                                      2 * np.frombuffer(ids.data, np.int64))
        np.testing.assert_array_equal(np.frombuffer(by_name["total"].data, np.int64), totals)


@pytest.mark.parametrize(("pad", "error"), [
    ("features = 0", "input 'features' has no variable dimension to pad"),
    ("nope = 0", "the model has no input 'nope'"),
    ('ids = "0"', "ids must be a number"),
])
def test_bad_padding_is_refused(tmp_path: Path, pad, error):
    repo = write_onnx_scorer(tmp_path / "models", extra=f"[params.pad]\n{pad}\n")
    with pytest.raises(ConfigError, match=error):
        load_runner(_version(repo, "scorer"), "cpu")


def test_an_onnx_model_on_cuda_without_the_cuda_provider_is_refused_with_what_to_install(tmp_path: Path):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    repo = write_onnx_scorer(tmp_path / "models")
    with pytest.raises(ConfigError, match="install onnxruntime-gpu"):
        load_runner(_version(repo, "scorer"), "cuda:0")


@pytest.mark.parametrize(("setting", "error"), [
    ("num_threads = 0", "num_threads must be a positive integer"),
    ('optimization = "max"', "optimization must be one of all, extended, basic, none"),
])
def test_bad_onnx_runtime_settings_are_refused(tmp_path: Path, setting, error):
    repo = write_onnx_scorer(tmp_path / "models")
    toml = repo / "scorer" / "model.toml"
    toml.write_text(toml.read_text().replace("num_threads = 1", setting))
    with pytest.raises(ConfigError, match=error):
        load_runner(_version(repo, "scorer"), "cpu")
