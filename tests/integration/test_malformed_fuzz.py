"""Generated near-miss requests never make the server answer 5xx.

Each example starts as a valid request (JSON or binary tensors, a few rows or texts) and then
has zero to two of its fields replaced by junk, sizes nudged off by one, or the binary header
length cut wrong, so that most examples get past the first checks and reach the deeper ones
(and some reach the model). Junk includes what `json.dumps` cannot write: values nested far
deeper than the interpreter's stack and strings holding bytes that are not UTF-8, spliced into
the encoded body (`_encode`), in known fields and in unknown ones.
"""

from __future__ import annotations

import json
import math
import struct

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
DEEP = {"<deep-64>": 64, "<deep-5000>": 5000}
"""Placeholders `_encode` replaces with a value nested this many levels deep."""
BAD_UTF8 = "<bad-utf8>"
"""A placeholder `_encode` replaces with bytes that are not UTF-8, wherever it is in a string."""
ODD_VALUES = [-1, 0, 2**31, 2**63, 2**64 + 1, -(2**63), "", "1", [], {}, None, True, 1e308, [-1], [[1]]]
UNWRITABLE = [*DEEP, BAD_UTF8, f"ab{BAD_UTF8}"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
junk = st.sampled_from(ODD_VALUES) | st.sampled_from(UNWRITABLE) | st.recursive(
    scalars | st.sampled_from(UNWRITABLE),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
nudge = st.sampled_from([0, 0, 0, 0, 0, -1, 1])


def _mutate(draw, body: dict, keys: list[str]) -> None:
    for key in draw(st.lists(st.sampled_from([*keys, "unknown"]), max_size=2, unique=True)):
        body[key] = draw(junk)


def _encode(body: dict) -> bytes:
    """`body` as JSON, with the placeholders of `DEEP` and `BAD_UTF8` made real."""
    encoded = json.dumps(body).encode()
    for placeholder, depth in DEEP.items():
        encoded = encoded.replace(f'"{placeholder}"'.encode(), b"[" * depth + b"1" + b"]" * depth)
    return encoded.replace(BAD_UTF8.encode(), b"\xff\xfe")


@st.composite
def v2_requests(draw) -> tuple[str, dict, bytes, int]:
    """(model, JSON header, binary tail, header-length error)."""
    model = draw(st.sampled_from(["emulated", "minilm"]))
    is_binary = draw(st.booleans())
    if model == "emulated":
        shape = [draw(st.integers(0, 4)), draw(st.integers(0, 8))]
        count = max(0, math.prod(shape) + draw(nudge))
        values = draw(
            st.lists(st.floats(width=32, allow_nan=is_binary, allow_infinity=is_binary), min_size=count, max_size=count)
        )
        entry: dict = {"name": "INPUT0", "shape": shape, "datatype": "FP32"}
        raw = np.asarray(values, dtype="<f4").tobytes()
    else:
        shape = [draw(st.integers(0, 4))]
        count = max(0, shape[0] + draw(nudge))
        values = draw(st.lists(st.text(max_size=16), min_size=count, max_size=count))
        entry = {"name": "text", "shape": shape, "datatype": "BYTES"}
        raw = b"".join(struct.pack("<I", len(v.encode())) + v.encode() for v in values)
    if is_binary:
        entry["parameters"] = {"binary_data_size": len(raw) + draw(nudge)}
    else:
        entry["data"] = values
        raw = b""
    _mutate(draw, entry, ["name", "shape", "datatype", "data", "parameters"])
    body: dict = {"inputs": [entry]}
    if draw(st.booleans()):
        body["parameters"] = {
            "timeout": draw(st.integers(1_000_000, 10_000_000)),
            "binary_data_output": draw(st.booleans()),
        }
    if draw(st.booleans()):
        output = "OUTPUT0" if model == "emulated" else "embedding"
        body["outputs"] = [{"name": output, "parameters": {"binary_data": draw(st.booleans())}}]
    _mutate(draw, body, ["inputs", "parameters", "outputs", "id"])
    return model, body, raw, draw(nudge) if is_binary else 0


@st.composite
def v1_requests(draw) -> dict:
    body: dict = {
        "model": draw(st.sampled_from(["minilm", "emulated", "nope"])),
        "input": draw(st.text(min_size=1, max_size=40) | st.lists(st.text(min_size=1, max_size=20), max_size=4)),
    }
    if draw(st.booleans()):
        body["encoding_format"] = draw(st.sampled_from(["float", "base64"]))
    if draw(st.booleans()):
        body["dimensions"] = draw(st.sampled_from([16, 384, 1]))
    _mutate(draw, body, ["model", "input", "encoding_format", "dimensions", "user"])
    return body


@pytest.fixture(scope="module")
def http(demo_server):
    # A roomy default deadline: valid examples reach the model, and a loaded test machine does
    # not turn the models' short SLOs into 503/504 answers.
    headers = {"X-Request-Timeout-Ms": "30000"}
    with httpx.Client(base_url=demo_server.url, timeout=60, headers=headers) as client:
        yield client


def _may_time_out(body: dict) -> bool:
    """A junk `timeout` that happens to be a tiny positive number is a real, unmeetable deadline."""
    parameters = body.get("parameters")
    timeout = parameters.get("timeout") if isinstance(parameters, dict) else None
    return isinstance(timeout, int | float) and not isinstance(timeout, bool) and 0 < timeout < 1_000_000


def _assert_answered(response: httpx.Response, may_time_out: bool = False) -> None:
    allowed = {503, 504} if may_time_out else set()
    assert response.status_code < 500 or response.status_code in allowed, response.text
    assert response.headers["x-request-id"]
    if response.status_code != 200:
        assert response.headers["content-type"] == "application/json"


def _assert_answered_openai(response: httpx.Response) -> None:
    """Answered (never 5xx), and a refusal in OpenAI's error envelope."""
    _assert_answered(response)
    if response.status_code != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@SETTINGS
@given(request=v2_requests())
def test_v2_near_misses_are_never_5xx(http, request):
    _check_v2_near_miss(http, request)


def _check_v2_near_miss(client: httpx.Client, request: tuple[str, dict, bytes, int]) -> None:
    """Sends a `v2_requests` / `named_requests` example: answered, never 5xx, a refusal in
    KServe's error shape."""
    model, body, raw, cut = request
    header = _encode(body)
    headers = {"Inference-Header-Content-Length": str(len(header) + cut)} if raw or cut else {}
    response = client.post(f"/v2/models/{model}/infer", content=header + raw, headers=headers)
    _assert_answered(response, _may_time_out(body))
    if response.status_code != 200:
        assert isinstance(response.json()["error"], str)


@SETTINGS
@given(body=v1_requests())
def test_v1_near_misses_are_never_5xx(http, body):
    response = http.post("/v1/embeddings", content=_encode(body))
    _assert_answered_openai(response)


@st.composite
def generation_requests(draw) -> tuple[str, dict]:
    """(path, body): a completion or chat request with sampling fields, some of them junk."""
    is_chat = draw(st.booleans())
    body: dict = {"model": draw(st.sampled_from(["tiny", "tiny", "tiny", "nope"])),
                  "max_tokens": draw(st.integers(1, 4)), "temperature": draw(st.sampled_from([0, 0.7, 1.0]))}
    keys = ["model", "max_tokens", "temperature", "n", "logprobs", "logit_bias", "presence_penalty",
            "frequency_penalty", "seed", "stop", "stream", "top_k", "top_p"]
    if is_chat:
        body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=20))}]
        body["logprobs"] = draw(st.booleans())
        if body["logprobs"]:
            body["top_logprobs"] = draw(st.integers(0, 3))
        keys += ["messages", "top_logprobs"]
    else:
        body["prompt"] = draw(st.text(min_size=1, max_size=20) | st.lists(st.integers(0, 400), min_size=1, max_size=8))
        body["logprobs"] = draw(st.none() | st.integers(0, 3))
        body["echo"] = draw(st.booleans())
        if body["echo"] and draw(st.booleans()):
            body["max_tokens"] = 0  # scores the prompt only
        keys += ["prompt", "echo", "suffix"]
    for key, values in (("n", st.integers(1, 3)), ("logit_bias", st.dictionaries(
            st.integers(0, 400).map(str), st.floats(-100, 100), max_size=3)),
            ("presence_penalty", st.floats(-2, 2)), ("frequency_penalty", st.floats(-2, 2)),
            ("seed", st.integers(0, 2**63 - 1)), ("stop", st.lists(st.text(min_size=1, max_size=3), max_size=2)),
            ("stream", st.booleans())):
        if draw(st.booleans()):
            body[key] = draw(values)
    _mutate(draw, body, keys)
    return ("/v1/chat/completions" if is_chat else "/v1/completions"), body


@pytest.fixture(scope="module")
def generation_http(tmp_path_factory: pytest.TempPathFactory):
    from tests.conftest import start_server, write_tiny_lm_model

    server = start_server(write_tiny_lm_model(tmp_path_factory.mktemp("repo"), "tiny"),
                          tmp_path_factory.mktemp("log"))
    with httpx.Client(base_url=server.url, timeout=60, headers={"Cache-Control": "no-store"}) as client:
        yield client
    server.stop()


@SETTINGS
@given(request=generation_requests())
def test_generation_near_misses_are_never_5xx(generation_http, request):
    _assert_generated(generation_http, *request)


def _assert_generated(http: httpx.Client, path: str, body: dict) -> None:
    """Answered in OpenAI's shape, never 5xx; a stream that started ends cleanly."""
    response = http.post(path, content=_encode(body))
    _assert_answered_openai(response)
    if response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n") and '"error"' not in response.text


@st.composite
def responses_requests(draw) -> dict:
    """A Responses request: input as text or items (messages with text parts, a function call and
    its output), tools, a text format, sampling fields, some of them junk."""
    body: dict = {"model": draw(st.sampled_from(["tiny", "tiny", "tiny", "nope"])),
                  "max_output_tokens": draw(st.integers(1, 4)), "temperature": draw(st.sampled_from([0, 0.7]))}
    text = st.text(min_size=1, max_size=20)
    if draw(st.booleans()):
        body["input"] = draw(text)
    else:
        part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "input_image"]), "text": text})
        message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
                                         "content": text | st.lists(part, max_size=2)})
        call = st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("call_1"),
                                      "name": st.sampled_from(["f", "g"]), "arguments": st.just("{}")})
        output = st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("call_1"),
                                        "output": text})
        body["input"] = draw(st.lists(message | call | output, min_size=0, max_size=4))
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}
    for key, values in (("instructions", text), ("stream", st.booleans()), ("tools", st.just([tool])),
                        ("tool_choice", st.sampled_from(["none", "required", {"type": "function", "name": "f"}])),
                        ("text", st.sampled_from([{"format": {"type": "json_object"}},
                                                  {"format": {"type": "json_schema", "name": "t",
                                                              "schema": {"type": "boolean"}}}]))):
        if draw(st.booleans()):
            body[key] = draw(values)
    _mutate(draw, body, ["model", "input", "instructions", "max_output_tokens", "temperature", "tools",
                         "tool_choice", "text", "metadata", "store", "previous_response_id", "top_p",
                         "conversation"])
    return body


@SETTINGS
@given(body=responses_requests())
def test_responses_near_misses_are_never_5xx(generation_http, body):
    """Answered in OpenAI's shape, never 5xx; a stream that started ends with the response's end."""
    response = generation_http.post("/v1/responses", content=_encode(body))
    _assert_answered_openai(response)
    if response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream"):
        last = response.text.rstrip("\n").rsplit("\n", 2)
        assert last[-2] in ("event: response.completed", "event: response.incomplete"), response.text[-300:]


@st.composite
def conversation_requests(draw) -> tuple[bool, dict]:
    """(whether to a conversation's items, body): items as a Responses input's, some of them junk."""
    text = st.text(max_size=10)
    part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": text})
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "robot"]),
                                     "content": text | st.lists(part, max_size=2)})
    call = st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "image"]),
                                  "call_id": st.just("call_1"), "name": st.just("f"), "arguments": st.just("{}"),
                                  "output": text})
    body: dict = {"items": draw(st.lists(message | call, max_size=3))}
    if draw(st.booleans()):
        body["metadata"] = {"k": draw(text)}
    _mutate(draw, body, ["items", "metadata"])
    return draw(st.booleans()), body


@pytest.fixture(scope="module")
def conversation_id(generation_http) -> str:
    return generation_http.post("/v1/conversations", json={}).json()["id"]


@SETTINGS
@given(request=conversation_requests())
def test_conversation_near_misses_are_never_5xx(generation_http, conversation_id, request):
    to_items, body = request
    path = f"/v1/conversations/{conversation_id}/items" if to_items else "/v1/conversations"
    _assert_answered_openai(generation_http.post(path, content=_encode(body)))


@st.composite
def tokenizer_requests(draw) -> tuple[str, dict]:
    """(path, body): a /tokenize or /detokenize request, some of its fields junk."""
    body: dict = {}
    if draw(st.booleans()):
        body["model"] = draw(st.sampled_from(["tiny", "nope"]))
    if draw(st.booleans()):
        body["tokens"] = draw(st.lists(st.integers(0, 500), max_size=8))
        _mutate(draw, body, ["model", "tokens"])
        return "/detokenize", body
    if draw(st.booleans()):
        body["messages"] = [{"role": draw(st.sampled_from(["user", "system", "tool"])),
                             "content": draw(st.text(max_size=20))}]
    else:
        body["prompt"] = draw(st.text(max_size=20))
    if draw(st.booleans()):
        body["add_special_tokens"] = draw(st.booleans())
    _mutate(draw, body, ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"])
    return "/tokenize", body


@SETTINGS
@given(request=tokenizer_requests())
def test_tokenizer_near_misses_are_never_5xx(generation_http, request):
    path, body = request
    response = generation_http.post(path, content=_encode(body))
    _assert_answered_openai(response)


SCHEMAS = [{"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]},
           {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, {"type": "string", "maxLength": 3},
           {"type": "strng"}, {"$ref": "#/nowhere"}, {"type": "object", "properties": {"a": {"minimum": "x"}}}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMAS[0]}}


@st.composite
def structured_requests(draw) -> tuple[str, dict]:
    """(path, body): a request for a structured output or tool calls, near a valid one."""
    is_chat = draw(st.booleans())
    body: dict = {"model": "tiny", "max_tokens": draw(st.integers(1, 12)), "seed": draw(st.integers(0, 9))}
    if is_chat:
        body["messages"] = [{"role": "user", "content": "x"}]
    else:
        body["prompt"] = "x"
    schema = draw(st.sampled_from(SCHEMAS))
    fields = {
        "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"},
                                            {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}]),
        "guided_json": st.just(schema) | st.just(json.dumps(schema)),
        "guided_regex": st.sampled_from(["[a-z]{2}", "(", "a*", "\\d{1,3}"]),
        "guided_choice": st.lists(st.text(max_size=4), max_size=3),
        "guided_grammar": st.sampled_from(['start: "a" | "b"', "start: ((", "root ::= \"x\""]),
        "structured_outputs": st.sampled_from([{"regex": "[0-9]"}, {"choice": ["y", "n"]}, {"json": schema}, {}]),
    }
    if is_chat and draw(st.booleans()):
        body["tools"] = [TOOL]
        body["tool_choice"] = draw(st.sampled_from(["required", "none", "auto", {"type": "function", "function":
                                                    {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]))
    else:
        key = draw(st.sampled_from(sorted(fields)))
        body[key] = draw(fields[key])
    if draw(st.booleans()):
        body["stream"] = True
    _mutate(draw, body, ["response_format", "guided_json", "guided_regex", "guided_choice", "tools", "tool_choice",
                         "structured_outputs", "messages", "max_tokens"])
    return ("/v1/chat/completions" if is_chat else "/v1/completions"), body


@SETTINGS
@given(request=structured_requests())
def test_structured_output_and_tool_near_misses_are_never_5xx(generation_http, request):
    _assert_generated(generation_http, *request)


_NAMED_INPUTS = {
    "scorer": [("features", "FP32", [4]), ("offset", "FP32", [1]), ("ids", "INT64", [-1])],
    "labeller": [("text", "BYTES", []), ("x", "FP32", [2])],
}
"""The users' models of `tests/user_models.py`: each input's name, datatype and dims per row."""


@st.composite
def named_requests(draw) -> tuple[str, dict, bytes, int]:
    """(model, JSON header, binary tail, header-length error) for a model of several inputs:
    inputs dropped, repeated or reordered, rows disagreeing, besides `v2_requests`' junk."""
    model = draw(st.sampled_from(sorted(_NAMED_INPUTS)))
    rows, length = draw(st.integers(0, 3)), draw(st.integers(1, 4))
    is_binary = draw(st.booleans())
    entries, tail = [], b""
    for name, datatype, dims in _NAMED_INPUTS[model]:
        shape = [rows + draw(nudge), *(length if d < 0 else d for d in dims)]
        count = max(0, math.prod(max(d, 0) for d in shape) + draw(nudge))
        if datatype == "BYTES":
            values: list = draw(st.lists(st.text(max_size=6), min_size=count, max_size=count))
            raw = b"".join(struct.pack("<I", len(v.encode())) + v.encode() for v in values)
        elif datatype == "INT64":
            values = draw(st.lists(st.integers(-(2**40), 2**40), min_size=count, max_size=count))
            raw = np.asarray(values, dtype="<i8").tobytes()
        else:
            values = draw(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False),
                                   min_size=count, max_size=count))
            raw = np.asarray(values, dtype="<f4").tobytes()
        entry: dict = {"name": name, "shape": shape, "datatype": datatype}
        if is_binary:
            entry["parameters"] = {"binary_data_size": len(raw) + draw(nudge)}
            tail += raw
        else:
            entry["data"] = values
        _mutate(draw, entry, ["name", "shape", "datatype", "data", "parameters"])
        entries.append(entry)
    edit = draw(st.sampled_from(["none", "none", "drop", "repeat", "reverse"]))
    if edit == "drop" and entries:
        entries.pop(draw(st.integers(0, len(entries) - 1)))
    elif edit == "repeat":
        entries.append(entries[0])
    elif edit == "reverse":
        entries.reverse()
    body: dict = {"inputs": entries}
    if draw(st.booleans()):
        names = ["scores", "best", "total", "doubled"] if model == "scorer" else ["label", "score", "batch", "warmed"]
        body["outputs"] = [{"name": draw(st.sampled_from([*names, "nope"])),
                            "parameters": {"binary_data": draw(st.booleans())}}]
    _mutate(draw, body, ["inputs", "parameters", "outputs", "id"])
    return model, body, tail, draw(nudge) if is_binary else 0


@pytest.fixture(scope="module")
def named_http(tmp_path_factory: pytest.TempPathFactory):
    from tests.conftest import start_server
    from tests.user_models import write_onnx_scorer, write_python_labeller

    repo = tmp_path_factory.mktemp("repo")
    write_onnx_scorer(repo)
    write_python_labeller(repo)
    server = start_server(repo, tmp_path_factory.mktemp("log"))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
    server.stop()


@SETTINGS
@given(request=named_requests())
def test_near_misses_for_models_of_several_inputs_are_never_5xx(named_http, request):
    _check_v2_near_miss(named_http, request)
