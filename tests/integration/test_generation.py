"""Generation through a real server and the real `openai` SDK: completions and chat, unary and
streamed, stop strings, prefix-cache hits in usage, cancellation on disconnect, and 400s.
(OpenAI's further fields — log-probabilities, echo, n, batches of prompts, penalties, logit bias —
and the tokenizer endpoints: test_generation_fields.py.)"""

from __future__ import annotations

import base64
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import eventually, free_port, metric_total, start_server, write_tiny_lm_model

pytestmark = pytest.mark.slow

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_lm_server):
    return tiny_lm_server  # tests/integration/conftest.py


@pytest.fixture
def client(tiny_lm_client):
    return tiny_lm_client


def test_completion_is_deterministic_when_greedy_and_counts_usage(client):
    first = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=12, temperature=0)
    again = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=12, temperature=0)
    assert first.choices[0].text == again.choices[0].text
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 12
    assert first.usage.prompt_tokens > 0
    assert first.usage.total_tokens == first.usage.prompt_tokens + 12


def test_streamed_chat_equals_the_unary_answer_and_ends_with_usage(client):
    messages = [{"role": "user", "content": "Say something"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_openai_answers_streamed_or_whole_are_never_compressed(server):
    """A client asking for gzip (httpx and the openai SDK do by default) gets its SSE events as
    they are made, not held back for a compressor, and a whole answer as it is (`api.compression`)."""
    body = {"model": MODEL, "prompt": "Tell a story", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "n": 4}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      headers={"Accept-Encoding": "gzip"}, timeout=60) as streamed:
        raw = b"".join(streamed.iter_raw())
    assert streamed.status_code == 200, raw
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert "content-encoding" not in streamed.headers
    assert raw.startswith(b"data: {") and raw.endswith(b"data: [DONE]\n\n")
    whole = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Accept-Encoding": "gzip"}, timeout=60)
    assert whole.status_code == 200 and "content-encoding" not in whole.headers and len(whole.content) > 1024
    assert [c["finish_reason"] for c in whole.json()["choices"]] == ["length"] * 4


def test_a_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    text = full.choices[0].text
    assert len(text) >= 4
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    assert len(cut.choices[0].text) < len(text)


def test_a_repeated_long_prompt_hits_the_prefix_cache(client):
    prompt = "A long shared system prompt that many requests start with. " * 8
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


def test_finished_generations_count_as_ok_with_their_tokens(server, client):
    ok = metric_total(server, "sluice_requests_total", model=MODEL, outcome="ok")
    cancelled = metric_total(server, "sluice_requests_total", model=MODEL, outcome="cancelled")
    generated = metric_total(server, "sluice_generation_tokens_total", model=MODEL)
    goodput = metric_total(server, "sluice_tenant_goodput_total", tenant="local")
    busy_s = metric_total(server, "sluice_device_busy_seconds_total")
    charged_s = metric_total(server, "sluice_tenant_device_seconds_total", tenant="local")
    client.completions.create(model=MODEL, prompt="Count me", max_tokens=5, temperature=0)
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "and me"}],
                                        max_tokens=7, temperature=0, stream=True))
    assert metric_total(server, "sluice_requests_total", model=MODEL, outcome="ok") == ok + 2
    assert metric_total(server, "sluice_requests_total", model=MODEL, outcome="cancelled") == cancelled
    assert metric_total(server, "sluice_generation_tokens_total", model=MODEL) == generated + 12
    assert metric_total(server, "sluice_tenant_goodput_total", tenant="local") == goodput + 2
    # the engine's steps keep the device busy (the demand signal autoscaling reads), at least
    # as long as the device time the two requests were charged
    charged_s = metric_total(server, "sluice_tenant_device_seconds_total", tenant="local") - charged_s
    assert metric_total(server, "sluice_device_busy_seconds_total") - busy_s >= charged_s * 0.999 > 0


def test_a_client_that_disconnects_frees_its_sequence_and_is_charged_for_what_it_used(server, client):
    device_s = metric_total(server, "sluice_tenant_device_seconds_total", tenant="local")
    cancelled = metric_total(server, "sluice_requests_total", model=MODEL, outcome="cancelled")
    stream = client.completions.create(model=MODEL, prompt="Keep going", max_tokens=800, temperature=0.8,
                                       stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(5), stream, strict=False):
        pass
    eventually(lambda: metric_total(server, "vllm:num_requests_running", model_name=MODEL) == 1,
              "the running sequence never showed in the gauge")  # (refreshed every 0.5 s)
    stream.close()
    eventually(lambda: metric_total(server, "vllm:num_requests_running", model_name=MODEL) == 0,
              "the disconnected client's sequence kept running")
    eventually(lambda: metric_total(server, "sluice_requests_total", model=MODEL, outcome="cancelled") == cancelled + 1,
              "the cut stream was never accounted")
    assert metric_total(server, "sluice_tenant_device_seconds_total", tenant="local") > device_s
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "sluice_time_to_first_token_seconds_count" in metrics
    assert 'vllm:kv_cache_usage_perc{model_name="tiny"}' in metrics


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Keep going", "max_tokens": 800, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Keep going"}], "max_tokens": 800,
                              "ignore_eos": True}),
    (f"/v2/models/{MODEL}/generate", {"text_input": "Keep going", "max_tokens": 800, "ignore_eos": True}),
])
def test_a_client_that_disconnects_while_waiting_for_a_whole_answer_frees_its_sequence(server, path, body):
    cancelled = metric_total(server, "sluice_requests_total", model=MODEL, outcome="cancelled")

    def ask_and_leave() -> None:  # gives up on the answer after 2 s: its connection is closed
        with pytest.raises(httpx.ReadTimeout):
            model = {"model": MODEL} if path.startswith("/v1") else {}  # /v2: the model is in the path
            httpx.post(f"{server.url}{path}", json={**model, "temperature": 0.8, **body},
                       headers={"Cache-Control": "no-cache"}, timeout=httpx.Timeout(10, read=2))

    with ThreadPoolExecutor(1) as pool:
        asking = pool.submit(ask_and_leave)
        eventually(lambda: metric_total(server, "vllm:num_requests_running", model_name=MODEL) == 1,
                   "the running sequence never showed in the gauge")
        asking.result()
    # within a step or so (the gauge is refreshed every 0.5 s), not when its 800 tokens are done
    eventually(lambda: metric_total(server, "vllm:num_requests_running", model_name=MODEL) == 0,
               "the disconnected client's sequence kept running", timeout_s=2)
    eventually(lambda: metric_total(server, "sluice_requests_total", model=MODEL, outcome="cancelled") == cancelled + 1,
               "the abandoned request was never accounted")


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "temperature": 5}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": ["a", [5]]}, "prompt"),
    ({"prompt": [[5, 6], []]}, "prompt"),
    ({"prompt": ["a"] * 65, "n": 2}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
])
def test_unsupported_or_invalid_fields_are_400(server, body, param):
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_a_prompt_longer_than_the_context_is_400_not_500(server):
    response = httpx.post(f"{server.url}/v1/completions",
                          json={"model": MODEL, "prompt": list(range(5, 1100)), "max_tokens": 4})
    assert response.status_code == 400


def test_vllm_bench_fields_are_accepted(client):
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True, "top_k": 1, "min_tokens": 5,
                                                "repetition_penalty": 1.0})
    assert out.usage.completion_tokens == 5


def test_the_model_is_listed_with_its_context_and_refused_by_embeddings(client, server):
    assert MODEL in {m.id for m in client.models.list().data}
    assert httpx.get(f"{server.url}/v1/models/{MODEL}").json()["max_model_len"] == 1024  # as vLLM says it
    response = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert response.status_code == 400


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "stop_token_ids": [99_999_999], "min_tokens": 2}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": [5, 99_999_999]}, "prompt"),
    ({"prompt": "x", "max_tokens": 100_000}, "max_tokens"),
    ({"prompt": [5] * 1000, "max_tokens": 100}, "max_tokens"),
    ({"prompt": "word " * 3_000_000, "max_tokens": 2}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
])
def test_values_the_model_cannot_take_are_400_naming_the_field(server, body, param):
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if param == "max_tokens":
        assert "maximum context length is 1024 tokens" in error["message"]


def test_a_chat_that_cannot_fit_names_the_max_tokens_field_the_client_sent(client):
    messages = [{"role": "user", "content": "Tell me " * 100}]
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens") as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=900)
    assert refused.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=900)
    assert refused.value.body["param"] == "max_tokens"


def test_chat_messages_far_longer_than_the_context_are_400(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "word " * 200_000}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_a_tokenized_prompt_that_leaves_too_little_room_is_400_not_cut(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
        client.completions.create(model=MODEL, prompt="The weather today is " * 120, max_tokens=600)


def test_a_chat_without_max_tokens_gets_what_the_context_leaves(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me " * 180}],
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 1024


def test_a_vanishing_temperature_is_greedy(client):
    greedy = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8, temperature=0)
    tiny = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8, temperature=1e-45)
    assert tiny.choices[0].text == greedy.choices[0].text


def test_null_optional_fields_mean_not_given(server):
    nulls = dict.fromkeys(("n", "stream", "stream_options", "min_tokens", "ignore_eos", "seed", "stop",
                           "stop_token_ids", "top_k", "top_p", "temperature", "logprobs", "max_tokens"))
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "echo": None, **nulls})
    assert response.status_code == 200, response.text
    # Sampled at the default temperature, the random-weight model may draw its end-of-sequence token
    # early; only a text cut by length shows the default limit of 16 tokens.
    body = response.json()
    finish, tokens = body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]
    assert (finish, tokens) == ("length", 16) or (finish == "stop" and tokens < 16), body
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **nulls, "max_tokens": 3})
    assert chat.status_code == 200, chat.text


def test_with_include_usage_every_chunk_but_the_last_has_null_usage(server):
    chunks = []
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
    assert len(chunks) >= 2
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path, extra", [("completions", {"prompt": "Hi"}),
                                         ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_with_continuous_usage_stats_every_chunk_carries_the_counts_so_far(server, path, extra):
    """vLLM's `stream_options.continuous_usage_stats` (sent by agent frameworks and RL rollouts):
    every chunk's usage counts the prompt and the tokens generated so far, never less than the
    chunk before, and ends at the final usage."""
    # greedy: a sampled token can end inside a character, whose text (and chunk) waits for the next
    body = {"model": MODEL, **extra, "max_tokens": 5, "ignore_eos": True, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server.url}/v1/{path}", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: {")]
    usages = [chunk["usage"] for chunk in chunks]
    assert all(usage is not None for usage in usages)
    final = usages[-1]
    assert final["completion_tokens"] == 5 and final["prompt_tokens"] > 0
    assert all(u["prompt_tokens"] == final["prompt_tokens"] for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[0] < 5 and len(set(counts)) > 2
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    without = {**body, "stream_options": {"continuous_usage_stats": True}}  # only with include_usage, as vLLM
    with httpx.stream("POST", f"{server.url}/v1/{path}", json=without, timeout=60) as response:
        lines = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: {")]
    assert lines and all("usage" not in chunk or chunk["usage"] is None for chunk in lines)


def test_a_request_refused_at_the_api_leaves_a_running_stream_alone(client, server):
    """The body is refused (400) before it reaches the worker; the stream beside it ends as it
    would have. (A sequence failing inside the engine ending alone is tested in test_engine.py:
    `test_a_sequence_that_cannot_be_sampled_ends_alone`.)"""
    stream = client.completions.create(model=MODEL, prompt="Keep going", max_tokens=40, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "min_tokens": 2,
                                                           "stop_token_ids": [99_999_999], "temperature": 1e-45})
    assert bad.status_code == 400
    rest = list(stream)
    assert [c.choices[0].finish_reason for c in [first, *rest] if c.choices[0].finish_reason] == ["length"]


@pytest.fixture(scope="module")
def one_seq_server(tmp_path_factory: pytest.TempPathFactory):
    """tiny-lm running one sequence at a time: a second request waits in the engine's queue."""
    repo = write_tiny_lm_model(tmp_path_factory.mktemp("repo"), MODEL, max_num_seqs=1)
    started = start_server(repo, tmp_path_factory.mktemp("log"))
    yield started
    started.stop()


def _gauge(server, name: str) -> float:
    return metric_total(server, name, model_name=MODEL)


def _num_cancelled(server) -> float:
    return metric_total(server, "sluice_requests_total", model=MODEL, outcome="cancelled")


LONG = {"model": MODEL, "prompt": "Keep going", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}


def test_a_client_that_stops_waiting_for_a_whole_answer_frees_its_sequence(one_seq_server):
    server = one_seq_server
    cancelled = _num_cancelled(server)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=httpx.Timeout(60, read=1.0))
    eventually(lambda: _num_cancelled(server) > cancelled, "the abandoned request was not cancelled")
    eventually(lambda: _gauge(server, "vllm:num_requests_running") == 0, "its sequence kept running")
    assert _gauge(server, "vllm:kv_cache_usage_perc") == 0


def test_a_stream_abandoned_before_its_first_token_leaves_the_queue(one_seq_server):
    server = one_seq_server
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=60) as running:
        assert running.status_code == 200
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # it holds the engine's one slot
        with ThreadPoolExecutor(1) as pool:  # queued behind it until its client gives up
            queued = pool.submit(httpx.post, f"{server.url}/v1/completions", json={**LONG, "stream": True},
                                 timeout=httpx.Timeout(60, read=1.5))
            eventually(lambda: _gauge(server, "vllm:num_requests_waiting") == 1, "the second stream did not queue")
            with pytest.raises(httpx.ReadTimeout):
                queued.result()
        eventually(lambda: _gauge(server, "vllm:num_requests_waiting") == 0, "the abandoned stream stayed queued")
        assert _gauge(server, "vllm:num_requests_running") == 1  # the first one is still going
    eventually(lambda: _gauge(server, "vllm:num_requests_running") == 0, "the closed stream kept running")


def test_preemptions_are_exported_from_the_start(one_seq_server):
    eventually(lambda: 'sluice_preemptions_total{model="tiny"} 0.0' in httpx.get(f"{one_seq_server.url}/metrics").text,
              "sluice_preemptions is not exported before the first preemption")


def test_kserve_infer_with_text_input_answers_text_output_as_the_completions_endpoint_does(server, client):
    """Triton's vLLM-backend convention, built from the model's own metadata: BYTES text_input in,
    BYTES text_output out (the prompt and its continuation, unless exclude_input_in_output);
    sampling from the request's parameters or a sampling_parameters input, whose numbers may be
    strings as the backend's own client sends them."""
    import numpy as np
    import tritonclient.http as triton

    http = triton.InferenceServerClient(server.url.removeprefix("http://"))
    metadata = http.get_model_metadata(MODEL)
    assert [i["name"] for i in metadata["inputs"]] == ["text_input"]
    optional = {i["name"]: i["data_type"] for i in http.get_model_config(MODEL)["input"] if i.get("optional")}
    assert optional == {"stream": "TYPE_BOOL", "sampling_parameters": "TYPE_STRING",
                        "exclude_input_in_output": "TYPE_BOOL"}
    prompts = ["The weather today is", "Once upon a time"]
    text = triton.InferInput("text_input", [2], "BYTES")
    text.set_data_from_numpy(np.array([p.encode() for p in prompts], dtype=np.object_))
    answer = http.infer(MODEL, [text], parameters={"max_tokens": 6, "temperature": 0, "ignore_eos": True})
    got = [value.decode() for value in answer.as_numpy("text_output")]
    expected = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert got == [p + e for p, e in zip(prompts, expected, strict=True)]

    def flag(name: str, value: bool):
        tensor = triton.InferInput(name, [1], "BOOL")
        tensor.set_data_from_numpy(np.array([value], dtype=bool))
        return tensor

    sampling = triton.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([json.dumps({"max_tokens": "6", "temperature": "0",
                                                        "ignore_eos": True}).encode()], dtype=np.object_))
    json_out = http.infer(MODEL, [text, sampling, flag("stream", False), flag("exclude_input_in_output", True)],
                          outputs=[triton.InferRequestedOutput("text_output", binary_data=False)])  # as JSON
    assert list(json_out.as_numpy("text_output")) == expected  # JSON's BYTES come back as str

    bad = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", timeout=30, json={
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hi"]}],
        "parameters": {"max_tokens": "many"}})
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]
    wrong = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", timeout=30, json={
        "inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["Hi"]}]})
    assert wrong.status_code == 400 and "text_input" in wrong.json()["error"]
    streamed = httpx.post(f"{server.url}/v2/models/{MODEL}/infer", timeout=30, json={
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hi"]},
                   {"name": "stream", "datatype": "BOOL", "shape": [1], "data": [True]}]})
    assert streamed.status_code == 400 and "generate_stream" in streamed.json()["error"]


def test_triton_generate_answers_the_completions_text_whole_or_streamed(server, client):
    """Triton's generate extension: `text_output` is the prompt and its continuation (as the vLLM
    and TensorRT-LLM backends answer) unless `exclude_input_in_output`; a stream's events carry the
    new text only; sampling given in `parameters`, beside `text_input`, or as `sampling_parameters`."""
    prompt = "The weather today is"
    expected = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    sampling = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    url = f"{server.url}/v2/models/{MODEL}"
    whole = httpx.post(f"{url}/generate", json={"id": "q1", "text_input": prompt, "parameters": sampling}, timeout=60)
    assert whole.status_code == 200 and whole.headers["content-type"] == "application/json"
    assert whole.json() == {"id": "q1", "model_name": MODEL, "model_version": "1", "text_output": prompt + expected}
    beside = httpx.post(f"{url}/versions/1/generate", timeout=60,
                        json={"text_input": prompt, "exclude_input_in_output": True, **sampling})
    assert beside.json()["text_output"] == expected
    as_inputs = httpx.post(f"{url}/generate", timeout=60, json={  # as the backends' generate clients send
        "text_input": [prompt], "exclude_input_in_output": [True], "stream": False,
        "sampling_parameters": json.dumps({"max_tokens": "6", "temperature": 0, "ignore_eos": True})})
    assert as_inputs.json()["text_output"] == expected

    with httpx.stream("POST", f"{url}/generate_stream", json={"text_input": prompt, "parameters": sampling},
                      headers={"Cache-Control": "no-cache"}, timeout=60) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in stream.iter_lines() if line]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert all(line.startswith("data: ") for line in lines) and len(events) > 1  # no [DONE]: Triton sends none
    assert all(e["model_name"] == MODEL and e["model_version"] == "1" for e in events)
    assert "".join(e["text_output"] for e in events) == expected
    # a stop string in the first token: no text, and still an event saying so (it was an empty body)
    stopped = httpx.post(f"{url}/generate_stream", json={"text_input": prompt, "stop": [expected[0]], **sampling},
                         headers={"Cache-Control": "no-cache"}, timeout=60)
    assert stopped.status_code == 200 and stopped.text == (
        f'data: {{"model_name":"{MODEL}","model_version":"1","text_output":""}}\n\n')


@pytest.mark.parametrize("route, body, words", [
    ("generate", {"parameters": {"max_tokens": 3}}, ["text_input"]),
    ("generate", {"text_input": "Hi", "parameters": {"max_tokens": "many"}}, ["max_tokens"]),
    ("generate", {"text_input": "Hi", "bad_words": ""}, ["bad_words"]),
    ("generate", {"text_input": "Hi", "stream": True}, ["/generate_stream"]),
    ("generate", {"text_input": "Hi", "sampling_parameters": "[1]"}, ["sampling_parameters"]),
    ("generate", {"text_input": "Hi", "sampling_parameters": {"max_tokens": 3}}, ["as a string", "'parameters'"]),
    ("generate", {"text_input": ""}, ["'text_input' must not be empty"]),
    ("generate_stream", {"text_input": "Hi", "parameters": {"temperature": 5}}, ["temperature"]),
    ("generate_stream", {"text_input": "word " * 3000}, ["1024"]),
])
def test_a_bad_triton_generate_request_is_a_kserve_400_before_the_stream_starts(server, route, body, words):
    answer = httpx.post(f"{server.url}/v2/models/{MODEL}/{route}", json=body, timeout=60)
    assert answer.status_code == 400 and answer.headers["content-type"] == "application/json"
    assert all(word in answer.json()["error"] for word in words), answer.json()


@pytest.fixture(scope="module")
def grpc_server(tmp_path_factory: pytest.TempPathFactory):
    """tiny-lm served with KServe's gRPC port open."""
    port = free_port()
    repo = write_tiny_lm_model(tmp_path_factory.mktemp("repo"), MODEL)
    started = start_server(repo, tmp_path_factory.mktemp("log"), "--grpc-port", str(port))
    yield started, port
    started.stop()


def test_kserve_grpc_infer_generates_as_http_does(grpc_server):
    """`tritonclient.grpc` gets the answers `tritonclient.http` gets, unary and on a stream; a
    sampling parameter of the wrong type is INVALID_ARGUMENT naming it."""
    import numpy as np
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton_http
    from tritonclient.utils import InferenceServerException

    server, port = grpc_server
    prompts = ["The weather today is", "Once upon a time"]
    parameters = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}

    def text_input(module):
        text = module.InferInput("text_input", [2], "BYTES")
        text.set_data_from_numpy(np.array([p.encode() for p in prompts], dtype=np.object_))
        return text

    http = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    expected = list(http.infer(MODEL, [text_input(triton_http)], parameters=parameters).as_numpy("text_output"))
    grpc_client = triton_grpc.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        answer = grpc_client.infer(MODEL, [text_input(triton_grpc)], parameters=parameters)
        assert list(answer.as_numpy("text_output")) == expected and len(expected) == 2

        streamed = []
        done = threading.Event()

        def collect(result, error):
            streamed.append(error if error is not None else list(result.as_numpy("text_output")))
            done.set()

        grpc_client.start_stream(callback=collect)
        grpc_client.async_stream_infer(MODEL, [text_input(triton_grpc)], parameters=parameters)
        assert done.wait(60)
        grpc_client.stop_stream()
        assert streamed == [expected]

        with pytest.raises(InferenceServerException) as caught:
            grpc_client.infer(MODEL, [text_input(triton_grpc)], parameters={"max_tokens": "many"})
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT" and "max_tokens" in caught.value.message()
    finally:
        grpc_client.close()


def test_a_kserve_grpc_stream_with_stream_true_answers_chunk_by_chunk_as_tritons_llm_backends(grpc_server):
    """The vLLM backend's own client: a `stream` BOOL input set, sampling as a JSON string of
    strings, on ModelStreamInfer: one answer per chunk of new text (together the completion), then
    Triton's empty final answer when asked; ModelInfer refuses a stream with INVALID_ARGUMENT."""
    import numpy as np
    import tritonclient.grpc as triton_grpc
    from tritonclient.utils import InferenceServerException

    server, port = grpc_server
    prompt = "The weather today is"
    expected = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()
    inputs = [triton_grpc.InferInput("text_input", [1], "BYTES"), triton_grpc.InferInput("stream", [1], "BOOL"),
              triton_grpc.InferInput("sampling_parameters", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([True], dtype=bool))
    inputs[2].set_data_from_numpy(np.array([json.dumps({"max_tokens": "8", "temperature": "0",
                                                        "ignore_eos": "true"}).encode()], dtype=np.object_))
    answers = []
    ended = threading.Event()

    def collect(result, error):
        answers.append(error or result.get_response(as_json=True))
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            ended.set()

    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        client.start_stream(callback=collect)
        client.async_stream_infer(MODEL, inputs, request_id="r7", enable_empty_final_response=True)
        assert ended.wait(60), answers
        client.stop_stream()
        with pytest.raises(InferenceServerException) as caught:
            client.infer(MODEL, inputs)
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT" and "ModelStreamInfer" in caught.value.message()
    finally:
        client.close()
    *chunks, final = answers
    assert all(answer["id"] == "r7" for answer in answers) and len(chunks) > 1
    assert all(chunk["parameters"]["triton_final_response"] == {"bool_param": False} for chunk in chunks)
    assert final["parameters"]["triton_final_response"] == {"bool_param": True} and not final.get("outputs")
    texts = [base64.b64decode(chunk["raw_output_contents"][0])[4:].decode() for chunk in chunks]
    assert "".join(texts) == expected["choices"][0]["text"]


def test_kserve_grpc_streams_interleaved_on_one_stream_each_end_final_and_cancel_frees_them(grpc_server):
    """Three streamed generations and a whole one on one ModelStreamInfer stream: each request's
    chunks, by its id, are its own completion and its last says `triton_final_response` (as
    Triton's vLLM backend marks its last answer, no empty final answer asked); the whole one gets
    its one answer; one stopped in its first token gets one final answer with no text. Cancelling
    the stream mid-generation frees its sequences on the worker."""
    import numpy as np
    import tritonclient.grpc as triton_grpc

    server, port = grpc_server

    def inputs(prompt: str, is_stream: bool) -> list:
        tensors = [triton_grpc.InferInput("text_input", [1], "BYTES"), triton_grpc.InferInput("stream", [1], "BOOL")]
        tensors[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        tensors[1].set_data_from_numpy(np.array([is_stream], dtype=bool))
        return tensors

    texts: dict[str, list[str]] = {}
    finals: list[str] = []
    errors: list[Exception] = []
    all_final = threading.Event()

    def collect(result, error):
        if error is not None:
            errors.append(error)
            return
        response = result.get_response()
        texts.setdefault(response.id, []).extend(v.decode() for v in result.as_numpy("text_output"))
        if "triton_final_response" not in response.parameters or \
                response.parameters["triton_final_response"].bool_param:
            finals.append(response.id)
        if len(finals) == 5:
            all_final.set()

    prompts = {"a": "The weather today is", "b": "Once upon a time", "c": "Hello there", "whole": "Tell me"}
    sampling = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    expected = {request_id: httpx.post(f"{server.url}/v1/completions", timeout=60, headers={
        "Cache-Control": "no-cache"}, json={"model": MODEL, "prompt": prompt, **sampling}).json()["choices"][0]["text"]
        for request_id, prompt in prompts.items()}
    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        client.start_stream(callback=collect)
        for request_id, prompt in prompts.items():
            client.async_stream_infer(MODEL, inputs(prompt, request_id != "whole"), request_id=request_id,
                                      parameters={**sampling, "exclude_input_in_output": True})
        # a stop string in its first token: its one answer, final, holds no text
        client.async_stream_infer(MODEL, inputs(prompts["a"], True), request_id="stopped",
                                  parameters={**sampling, "stop": expected["a"][0]})
        assert all_final.wait(60), (texts, finals, errors)
        client.stop_stream()
        assert not errors and sorted(finals) == sorted([*prompts, "stopped"])
        for request_id in prompts:
            assert "".join(texts[request_id]) == expected[request_id], request_id
            assert len(texts[request_id]) == 1 if request_id == "whole" else len(texts[request_id]) > 1
        assert texts["stopped"] == [""]

        cancelled = _num_cancelled(server)
        texts.clear()
        client.start_stream(callback=collect)
        for request_id in ("x", "y"):
            client.async_stream_infer(MODEL, inputs("Keep going", True), request_id=request_id,
                                      parameters={"max_tokens": 800, "temperature": 0.8, "ignore_eos": True})
        eventually(lambda: len(texts.get("x", [])) > 2 and len(texts.get("y", [])) > 2, "both streams to start")
        eventually(lambda: _gauge(server, "vllm:num_requests_running") == 2, "both sequences in the gauge")
        client.stop_stream(cancel_requests=True)
        eventually(lambda: _gauge(server, "vllm:num_requests_running") == 0, "the cancelled stream's sequences ended")
        eventually(lambda: _num_cancelled(server) == cancelled + 2, "the two cancelled requests were not counted")
    finally:
        client.close()


def test_a_deadline_passing_mid_stream_ends_that_request_with_an_error_and_a_cut_stream_frees_its_sequence(
        grpc_server):
    """After the first chunk: on /generate_stream an error event ends the stream; on a gRPC stream
    that request's answer is the error (by its id) and the stream serves the next request. A
    /generate_stream client that goes mid-stream has its sequence freed and counted cancelled."""
    import numpy as np
    import tritonclient.grpc as triton_grpc

    server, port = grpc_server
    long = {"text_input": "Keep going", "max_tokens": 1000, "ignore_eos": True, "temperature": 0.8}
    with httpx.stream("POST", f"{server.url}/v2/models/{MODEL}/generate_stream", timeout=60,
                      json={**long, "parameters": {"timeout": 2_000_000}}) as stream:  # microseconds
        events = [json.loads(line.removeprefix("data: ")) for line in stream.iter_lines() if line]
    assert len(events) > 1 and all("text_output" in event for event in events[:-1])
    assert events[-1] == {"error": "the deadline passed before the generation finished"}

    answers: list[object] = []
    second_done = threading.Event()

    def collect(result, error):
        if error is not None:
            answers.append(("error", str(error)))
            return
        response = result.get_response()
        answers.append((response.id, response.parameters["triton_final_response"].bool_param))
        if response.id == "after" and answers[-1][1]:
            second_done.set()

    def inputs(prompt: str) -> list:
        tensors = [triton_grpc.InferInput("text_input", [1], "BYTES"), triton_grpc.InferInput("stream", [1], "BOOL")]
        tensors[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        tensors[1].set_data_from_numpy(np.array([True], dtype=bool))
        return tensors

    with triton_grpc.InferenceServerClient(f"127.0.0.1:{port}") as client:
        client.start_stream(callback=collect)
        client.async_stream_infer(MODEL, inputs("Keep going"), request_id="late", timeout=2_000_000,
                                  parameters={"max_tokens": 1000, "ignore_eos": True})
        eventually(lambda: ("error", "request 'late': the deadline passed before the generation finished") in answers,
                   "the late request's error")
        assert answers.index(("late", False)) < answers.index(("error", "request 'late': the deadline passed "
                                                                        "before the generation finished"))
        client.async_stream_infer(MODEL, inputs("Then"), request_id="after", parameters={"max_tokens": 4})
        assert second_done.wait(60), answers
        client.stop_stream()

    cancelled = _num_cancelled(server)
    with httpx.stream("POST", f"{server.url}/v2/models/{MODEL}/generate_stream", json=long, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        eventually(lambda: _gauge(server, "vllm:num_requests_running") == 1, "the sequence in the gauge")
    eventually(lambda: _gauge(server, "vllm:num_requests_running") == 0, "the cut stream's sequence kept running")
    eventually(lambda: _num_cancelled(server) == cancelled + 1, "the cut stream was never counted cancelled")
