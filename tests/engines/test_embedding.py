"""The embedding runner on the real all-MiniLM-L6-v2 from the demo repository, on the CPU.

The reference is sentence-transformers itself, loaded from the same installed package folder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest

from sluice import wire
from sluice.engines import ItemFailure, load_runner
from sluice.engines.embedding import EmbeddingRunner
from sluice.errors import ConfigError, InvalidInput
from sluice.repository import ModelVersion, demo_repository, scan_repository, verify

SENTENCES = [
    "A man is playing a guitar.",
    "The new movie is awesome!",
    "Sluice batches inference requests that arrive one at a time into groups that share the device.",
    "x",
    "",
]


@pytest.fixture(scope="module")
def version() -> ModelVersion:
    repository = scan_repository(demo_repository())
    return next(v for v in repository.versions if v.name == "minilm")


@pytest.fixture(scope="module")
def runner(version: ModelVersion) -> Iterator[EmbeddingRunner]:
    loaded = load_runner(version, "cpu")
    assert isinstance(loaded, EmbeddingRunner)
    yield loaded
    loaded.close()


def embed(runner: EmbeddingRunner, texts: list[str]) -> np.ndarray:
    items = runner.prepare(wire.TextPayload(texts))
    outputs = runner.run_batch(items)
    assert not any(isinstance(out, ItemFailure) for out in outputs)
    payload = runner.pack(outputs)  # type: ignore[arg-type]
    assert isinstance(payload, wire.TensorPayload)
    return np.frombuffer(payload.data, dtype=payload.dtype).reshape(payload.shape)


def test_demo_version_verifies_against_its_manifest(version: ModelVersion) -> None:
    verify(version)
    assert version.kind == "embedding"
    assert version.batching.max_batch_size == 32
    assert version.batching.max_batch_cost == 4096


def test_info_describes_a_text_to_384_dims_model(runner: EmbeddingRunner) -> None:
    info = runner.info
    assert (info.name, info.version, info.kind) == ("minilm", "1", "embedding")
    assert info.accepts_text and not info.accepts_tensor
    assert info.outputs == (wire.TensorSpec("embedding", "FP32", (-1, 384)),)
    assert info.max_batch_size == 32
    assert info.slo_s == pytest.approx(0.5)
    assert info.max_model_len == 256  # what it keeps of an input: the bound a tokens limit reserves


def test_embeddings_match_sentence_transformers(runner: EmbeddingRunner, version: ModelVersion) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(version.weights_dir), device="cpu")
    expected = reference.encode(SENTENCES, convert_to_numpy=True)
    actual = embed(runner, SENTENCES)
    assert actual.dtype == np.float32
    assert actual.shape == (len(SENTENCES), 384)
    cosines = np.sum(actual * expected, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosines.min() > 0.9999


def test_padding_in_a_batch_does_not_change_vectors(runner: EmbeddingRunner) -> None:
    batched = embed(runner, SENTENCES)
    alone = np.stack([embed(runner, [text])[0] for text in SENTENCES])
    np.testing.assert_allclose(batched, alone, atol=1e-5)


def test_vectors_have_unit_norm(runner: EmbeddingRunner) -> None:
    norms = np.linalg.norm(embed(runner, SENTENCES), axis=1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-5)


def test_similar_sentences_score_higher_than_unrelated(runner: EmbeddingRunner) -> None:
    texts = ["The cat sits on the mat.", "A kitten is resting on a rug.", "Invoices are due on Friday."]
    cat, kitten, invoice = embed(runner, texts)
    assert float(cat @ kitten) > float(cat @ invoice) + 0.2


def test_costs_are_token_counts_truncated_to_max_seq_len(runner: EmbeddingRunner) -> None:
    short, long = runner.prepare(wire.TextPayload(["hello world", "word " * 1000]))
    assert short.cost == short.num_tokens == 4  # [CLS] hello world [SEP]
    assert long.cost == long.num_tokens == runner.max_seq_len == 256
    vector = runner.run_batch([long])[0]
    assert isinstance(vector, np.ndarray) and vector.shape == (384,)


def test_tensor_payload_is_invalid_input(runner: EmbeddingRunner) -> None:
    tensor = np.zeros((2, 3), dtype=np.float32)
    payload = wire.TensorPayload(dtype="float32", shape=(2, 3), data=tensor.tobytes())
    with pytest.raises(InvalidInput, match="text"):
        runner.prepare(payload)


def test_empty_request_packs_to_an_empty_matrix(runner: EmbeddingRunner) -> None:
    assert runner.prepare(wire.TextPayload([])) == []
    payload = runner.pack([])
    assert isinstance(payload, wire.TensorPayload)
    assert payload.shape == (0, 384)


def test_warmup_returns_timed_observations(runner: EmbeddingRunner) -> None:
    observations = runner.warmup()
    assert len(observations) >= 4
    assert {cost for cost, _ in observations} >= {16, 64, 256}
    assert all(seconds > 0 for _, seconds in observations)
    alpha_s, beta_s, reference_cost = runner.prior()
    assert alpha_s > 0 and beta_s > 0 and reference_cost > 0


@pytest.mark.parametrize("params", [{"num_threads": 0}, {"num_threads": "two"}])
def test_bad_num_threads_is_a_config_error(version: ModelVersion, params: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="num_threads"):
        EmbeddingRunner(dataclasses.replace(version, params={**version.params, **params}), "cpu")


def test_unknown_device_is_a_config_error(version: ModelVersion) -> None:
    with pytest.raises(ConfigError, match="device"):
        EmbeddingRunner(version, "tpu")


@pytest.fixture(scope="module")
def onnx_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddingRunner]:
    from tests.user_models import write_onnx_embedding

    repo = write_onnx_embedding(tmp_path_factory.mktemp("models"))
    loaded = load_runner(scan_repository(repo).versions[0], "cpu")
    assert isinstance(loaded, EmbeddingRunner)
    yield loaded
    loaded.close()


def test_the_onnx_backend_gives_the_torch_backends_vectors(onnx_runner: EmbeddingRunner,
                                                          runner: EmbeddingRunner) -> None:
    """minilm's ONNX export (last hidden states, pooled by the runner) on ONNX Runtime: the same
    vectors as PyTorch's, batched with padding or alone, and the same interface."""
    assert onnx_runner.info.outputs == runner.info.outputs and onnx_runner.dims == 384
    batched = embed(onnx_runner, SENTENCES)
    np.testing.assert_allclose(batched, embed(runner, SENTENCES), atol=1e-5)
    alone = np.concatenate([embed(onnx_runner, [text]) for text in SENTENCES])
    np.testing.assert_allclose(batched, alone, atol=1e-5)
    assert [cost for cost, _ in onnx_runner.warmup()][:1] == [16]


@pytest.mark.parametrize(("params", "error"), [
    ({"backend": "tensorflow"}, "backend must be 'torch' or 'onnx'"),
    ({"backend": "onnx"}, "no ONNX file .*model.onnx"),
])
def test_bad_backend_settings_are_config_errors(version: ModelVersion, params: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        load_runner(dataclasses.replace(version, params={**version.params, **params}), "cpu")


def test_an_onnx_graph_that_is_not_an_encoder_is_refused(version: ModelVersion, tmp_path) -> None:
    from tests.user_models import write_onnx_scorer

    scorer = write_onnx_scorer(tmp_path / "models") / "scorer" / "1" / "model.onnx"
    with pytest.raises(ConfigError, match="takes features, offset, ids; it must take input_ids"):
        load_runner(dataclasses.replace(version, params={"backend": "onnx", "file": str(scorer)}), "cpu")
