"""Request bodies: valid for each protocol, distinct per request, built without I/O."""

from __future__ import annotations

import json

import pytest

from sluice.bench.workloads import (
    TIMEOUT_HEADER,
    Endpoint,
    InputSpec,
    LengthRange,
    build_workload,
    input_specs_from_metadata,
    sentences,
)


def test_kserve_fp32_bodies_follow_the_model_metadata() -> None:
    metadata = {"name": "m", "inputs": [{"name": "IN", "datatype": "FP32", "shape": [-1, -1]}]}
    workload = build_workload(Endpoint.KSERVE, "http://h:1/", "m", 16, 250, input_specs_from_metadata(metadata))
    assert workload.url == "http://h:1/v2/models/m/infer"
    assert workload.headers == {"Content-Type": "application/json", TIMEOUT_HEADER: "250"}
    tensor = json.loads(workload.body(5))["inputs"][0]
    assert (tensor["name"], tensor["datatype"], tensor["shape"]) == ("IN", "FP32", [1, 16])
    assert len(tensor["data"]) == 16 and all(isinstance(x, int | float) for x in tensor["data"])


def test_bytes_inputs_get_a_sentence() -> None:
    workload = build_workload(Endpoint.KSERVE, "http://h", "minilm", 16, None, InputSpec("text", "BYTES"))
    tensor = json.loads(workload.body(0))["inputs"][0]
    assert tensor["shape"] == [1] and tensor["datatype"] == "BYTES"
    assert isinstance(tensor["data"][0], str) and len(tensor["data"][0].split()) > 3
    assert TIMEOUT_HEADER not in workload.headers


def test_embeddings_bodies_name_the_model() -> None:
    workload = build_workload(Endpoint.EMBEDDINGS, "http://h", "minilm", 16, None)
    body = json.loads(workload.body(3))
    assert workload.url == "http://h/v1/embeddings"
    assert body["model"] == "minilm" and isinstance(body["input"], str)


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_every_request_body_is_distinct(endpoint: Endpoint) -> None:
    workload = build_workload(endpoint, "http://h", "m", 4, None, InputSpec("IN", "FP32"))
    bodies = [workload.body(i) for i in range(1000)]
    assert len(set(bodies)) == 1000  # so a result cache cannot answer them


@pytest.mark.parametrize("spec", [InputSpec("IN", "FP32"), InputSpec("text", "BYTES")])
@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_another_runs_bodies_differ_from_this_ones(endpoint: Endpoint, spec: InputSpec) -> None:
    """A second `sluice bench` against the same server is not answered from the first's cached results."""
    first, second = (build_workload(endpoint, "http://h", "m", 16, None, spec) for _ in range(2))
    assert not {first.body(i) for i in range(1000)} & {second.body(i) for i in range(1000)}
    again = [build_workload(endpoint, "http://h", "m", 16, None, spec, run_mark=7) for _ in range(2)]
    assert again[0].body(3) == again[1].body(3)  # and a given mark repeats a run exactly


def test_sentences_are_varied_and_repeatable() -> None:
    texts = sentences(50)
    assert texts == sentences(50)
    assert len(set(texts)) == 50


def test_unusable_metadata_and_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="inputs"):
        input_specs_from_metadata({"name": "m", "inputs": []})
    with pytest.raises(ValueError, match="spec"):
        build_workload(Endpoint.KSERVE, "http://h", "m", 4, None)
    with pytest.raises(ValueError, match="positive"):
        build_workload(Endpoint.EMBEDDINGS, "http://h", "m", 4, 0)


def test_bodies_for_a_model_of_several_inputs_follow_each_inputs_metadata() -> None:
    metadata = {"name": "m", "inputs": [{"name": "ids", "datatype": "INT64", "shape": [-1, -1]},
                                        {"name": "features", "datatype": "FP32", "shape": [-1, 4]},
                                        {"name": "text", "datatype": "BYTES", "shape": [-1]}]}
    workload = build_workload(Endpoint.KSERVE, "http://h", "m", 8, None, input_specs_from_metadata(metadata))
    ids, features, text = json.loads(workload.body(3))["inputs"]
    assert (ids["shape"], ids["data"]) == ([1, 8], [1] * 8)
    assert features["shape"] == [1, 4] and features["data"][0] == 3  # the request's index: bodies differ
    assert text["shape"] == [1] and isinstance(text["data"][0], str)
    assert len({workload.body(i) for i in range(500)}) == 500
    assert "Cache-Control" not in workload.headers


def test_integer_only_inputs_skip_the_cache_by_header() -> None:
    specs = (InputSpec("input_ids", "INT64"), InputSpec("attention_mask", "INT64"))
    workload = build_workload(Endpoint.KSERVE, "http://h", "bert", 16, None, specs)
    assert workload.headers["Cache-Control"] == "no-cache"
    body = json.loads(workload.body(9))
    assert [t["shape"] for t in body["inputs"]] == [[1, 16], [1, 16]]
    assert workload.body(1) == workload.body(2)


def test_a_range_of_input_lengths_varies_the_bodies_repeatably() -> None:
    specs = (InputSpec("input_ids", "INT64"), InputSpec("attention_mask", "INT64"))
    first, again = (build_workload(Endpoint.KSERVE, "http://h", "bert", LengthRange(8, 24), None, specs, run_mark=1)
                    for _ in range(2))
    shapes = [json.loads(template.render(0))["inputs"][0]["shape"] for template in first.templates]
    assert {shape[1] for shape in shapes} <= set(range(8, 25)) and len({shape[1] for shape in shapes}) > 5
    assert [t.render(0) for t in first.templates] == [t.render(0) for t in again.templates]
    emulated = build_workload(Endpoint.KSERVE, "http://h", "m", LengthRange(4, 6), None, InputSpec("IN", "FP32"))
    lengths = {len(json.loads(emulated.body(i))["inputs"][0]["data"]) for i in range(64)}
    assert lengths == {4, 5, 6}
