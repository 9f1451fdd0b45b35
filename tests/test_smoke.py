"""A first end-to-end check that the embedded server answers both protocols."""

import httpx


def test_kserve_infer_on_emulated_returns_row_sums(demo_server):
    body = {"inputs": [{"name": "INPUT0", "shape": [2, 4], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6, 7, 8]}]}
    response = httpx.post(f"{demo_server.url}/v2/models/emulated/infer", json=body,
                          headers={"x-request-id": "smoke-1"})
    assert response.status_code == 200
    assert response.json()["outputs"][0]["data"] == [10.0, 26.0]
    assert response.headers.get_list("x-request-id") == ["smoke-1"]  # the client's own, once


def test_embeddings_on_minilm_have_384_dims_and_usage(demo_server):
    response = httpx.post(f"{demo_server.url}/v1/embeddings", json={"model": "minilm", "input": ["a cat", "a dog"]})
    assert response.status_code == 200
    body = response.json()
    assert [len(d["embedding"]) for d in body["data"]] == [384, 384]
    assert body["usage"]["prompt_tokens"] > 0
