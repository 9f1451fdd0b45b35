"""An `openai-upstream` model: a front sluice whose worker forwards generations to a second, real
sluice serving a tiny generative model, driven through the `openai` SDK.

    client ──openai SDK──▶ front sluice (tenants, deadlines, max_concurrency = 1)
                                 └── worker ──HTTP SSE──▶ upstream sluice (tiny-lm, no keys)
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from sluice.gateway.tenants import hash_key
from tests.conftest import ServerProcess, eventually, free_port, metric_total, start_server, write_tiny_lm_model

pytestmark = pytest.mark.slow

UPSTREAM_MODEL = "tiny"
KEY = "sk-front-test-key"


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory):
    repo = write_tiny_lm_model(tmp_path_factory.mktemp("upstream-repo"), UPSTREAM_MODEL)
    toml = repo / UPSTREAM_MODEL / "model.toml"
    toml.write_text(toml.read_text() + 'tool_call_parser = "hermes"\n')  # it answers tool_choice "auto"
    started = start_server(repo, tmp_path_factory.mktemp("upstream-log"))
    yield started
    started.stop()


def _upstream_model(repo: Path, name: str, url: str, **settings: object) -> None:
    (repo / name / "1").mkdir(parents=True)
    lines = ['kind = "openai-upstream"', "[slo]", "default_ms = 60000", "[upstream]", f'url = "{url}"']
    lines += [f"{key} = {value!r}".replace("'", '"') for key, value in settings.items()]
    (repo / name / "model.toml").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, upstream: ServerProcess):
    repo = tmp_path_factory.mktemp("front-repo")
    _upstream_model(repo, "proxy", f"{upstream.url}/v1", model=UPSTREAM_MODEL, max_concurrency=1)
    _upstream_model(repo, "down", f"http://127.0.0.1:{free_port()}/v1", max_attempts=2, backoff_ms=5,
                    failure_threshold=1000)
    tenants = repo.parent / "tenants.toml"
    tenants.write_text(f'[tenants.acme]\napi_keys = ["{hash_key(KEY)}"]\n')
    started = start_server(repo, tmp_path_factory.mktemp("front-log"), "--tenants", str(tenants))
    yield started
    started.stop()


@pytest.fixture
def via_front(front):
    with openai.OpenAI(base_url=f"{front.url}/v1", api_key=KEY, max_retries=0, timeout=60) as sdk:
        yield sdk


@pytest.fixture
def direct(upstream):
    with openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="unused", max_retries=0, timeout=60) as sdk:
        yield sdk


def test_greedy_completion_equals_asking_the_upstream_with_its_usage(via_front, direct):
    ask = dict(prompt="The weather today is", max_tokens=12, temperature=0)
    mine = via_front.completions.create(model="proxy", **ask)
    theirs = direct.completions.create(model=UPSTREAM_MODEL, **ask)
    assert mine.choices[0].text == theirs.choices[0].text
    assert mine.choices[0].finish_reason == theirs.choices[0].finish_reason == "length"
    assert mine.model == "proxy"
    assert (mine.usage.prompt_tokens, mine.usage.completion_tokens) == (theirs.usage.prompt_tokens, 12)
    assert mine.usage.total_tokens == mine.usage.prompt_tokens + 12


def test_streamed_completion_equals_the_unary_answer(via_front, direct):
    ask = dict(prompt="Once upon a time", max_tokens=10, temperature=0)
    chunks = list(via_front.completions.create(model="proxy", stream=True, stream_options={"include_usage": True},
                                               **ask))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == direct.completions.create(model=UPSTREAM_MODEL, **ask).choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_a_response_through_the_front_is_the_upstreams_chat_answer(via_front, direct):
    theirs = direct.chat.completions.create(model=UPSTREAM_MODEL, max_tokens=10, temperature=0, messages=[
        {"role": "system", "content": "Be brief"}, {"role": "user", "content": "Say something"}])
    ask = dict(instructions="Be brief", input="Say something", max_output_tokens=10, temperature=0)
    mine = via_front.responses.create(model="proxy", **ask)
    assert mine.output_text == theirs.choices[0].message.content and mine.status == "incomplete"
    assert (mine.usage.input_tokens, mine.usage.output_tokens) == (theirs.usage.prompt_tokens, 10)
    streamed = via_front.responses.create(model="proxy", stream=True, **ask)
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == mine.output_text


def test_chat_goes_through_the_upstreams_chat_template_unary_and_streamed(via_front, direct):
    ask = dict(messages=[{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Say something"}],
               max_tokens=10, temperature=0)
    theirs = direct.chat.completions.create(model=UPSTREAM_MODEL, **ask)
    mine = via_front.chat.completions.create(model="proxy", **ask)
    assert mine.choices[0].message.content == theirs.choices[0].message.content
    assert mine.usage.prompt_tokens == theirs.usage.prompt_tokens
    chunks = list(via_front.chat.completions.create(model="proxy", stream=True,
                                                    stream_options={"include_usage": True}, **ask))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == theirs.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == theirs.usage.completion_tokens


def test_a_stop_string_is_forwarded(via_front, direct):
    full = direct.completions.create(model=UPSTREAM_MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = via_front.completions.create(model="proxy", prompt="Once upon a time", max_tokens=16, temperature=0,
                                       stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]


def test_penalties_and_logit_bias_are_forwarded(via_front, direct):
    ask = dict(prompt="Once upon a time", max_tokens=8, temperature=0, frequency_penalty=1.5, presence_penalty=0.5,
               logit_bias={"300": 100}, extra_body={"ignore_eos": True})
    theirs = direct.completions.create(model=UPSTREAM_MODEL, **ask).choices[0].text
    assert via_front.completions.create(model="proxy", **ask).choices[0].text == theirs
    assert theirs != direct.completions.create(model=UPSTREAM_MODEL, prompt="Once upon a time", max_tokens=8,
                                               temperature=0, extra_body={"ignore_eos": True}).choices[0].text


def test_structured_outputs_are_forwarded(via_front):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    answer = via_front.chat.completions.create(
        model="proxy", messages=[{"role": "user", "content": "JSON please"}], max_tokens=40, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    value = json.loads(answer.choices[0].message.content)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
    choice = via_front.completions.create(model="proxy", prompt="Pick:", max_tokens=10, seed=2,
                                          extra_body={"guided_choice": ["left", "right"]})
    assert choice.choices[0].text in ("left", "right")


def test_tool_calls_are_asked_of_the_upstream_as_structured_output(via_front):
    """The upstream gets the tools (with tool_choice "none") and the calls' JSON schema as its
    response_format; sluice turns the JSON it answers into tool_calls. History is forwarded."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"],
        "additionalProperties": False}}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": "unknown city"}]
    answer = via_front.chat.completions.create(
        model="proxy", messages=messages, tools=[weather], max_tokens=40, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Lima")
    assert answer.choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_is_the_upstreams_decision_and_its_calls_come_back(via_front):
    """With tool_choice "auto" the upstream decides (here a regular expression makes its model
    write a call in its own format); the calls it answers reach the client as tool_calls, unary
    and streamed, and the text before them as content."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    forced = dict(model="proxy", messages=[{"role": "user", "content": "Weather?"}], tools=[weather],
                  tool_choice="auto", max_tokens=200, seed=1, extra_body={
                      "guided_regex": r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
                                      r'\{"city": "(Oslo|Lima)"\}\}\n</tool_call>'})
    choice = via_front.chat.completions.create(**forced).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Lima")
    chunks = list(via_front.chat.completions.create(**forced, stream=True))
    (streamed,) = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert streamed.function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == "Checking."


def test_n_choices_are_relayed_unary_and_streamed(via_front, direct):
    ask = dict(prompt="Once upon a time", max_tokens=5, temperature=0.9, seed=5, n=3, logprobs=0,
               extra_body={"ignore_eos": True})
    theirs = direct.completions.create(model=UPSTREAM_MODEL, **ask)
    mine = via_front.completions.create(model="proxy", **ask)
    assert [(c.index, c.text, c.finish_reason) for c in mine.choices] == [
        (c.index, c.text, c.finish_reason) for c in theirs.choices]
    assert [c.logprobs.tokens for c in mine.choices] == [c.logprobs.tokens for c in theirs.choices]
    assert mine.usage.completion_tokens == theirs.usage.completion_tokens == 15
    streamed = ["", "", ""]
    for chunk in via_front.completions.create(model="proxy", stream=True, **ask):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in theirs.choices]


def test_log_probabilities_are_relayed_unary_and_streamed(via_front, direct):
    ask = dict(prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    theirs = direct.completions.create(model=UPSTREAM_MODEL, **ask).choices[0].logprobs
    mine = via_front.completions.create(model="proxy", **ask).choices[0].logprobs
    assert mine.tokens == theirs.tokens and mine.token_logprobs == pytest.approx(theirs.token_logprobs)
    assert mine.top_logprobs == theirs.top_logprobs
    streamed = [t for c in via_front.completions.create(model="proxy", stream=True, **ask)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == theirs.tokens
    chat = dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logprobs=True,
                top_logprobs=2, extra_body={"ignore_eos": True})
    theirs_chat = direct.chat.completions.create(model=UPSTREAM_MODEL, **chat).choices[0].logprobs.content
    mine_chat = via_front.chat.completions.create(model="proxy", **chat).choices[0].logprobs.content
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in mine_chat] == [
        (e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in theirs_chat]


@pytest.mark.parametrize("path, body, param", [
    ("completions", {"prompt": "x", "echo": True}, "echo"),
])
def test_what_sluice_does_not_relay_from_an_upstream_is_400(front, path, body, param):
    response = httpx.post(f"{front.url}/v1/{path}", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "proxy", **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_upstream_refusal_reaches_the_client_with_its_status(front):
    response = httpx.post(f"{front.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "proxy", "prompt": list(range(5, 1100)), "max_tokens": 4}, timeout=30)
    assert response.status_code == 400, response.text
    assert "context" in response.json()["error"]["message"]


SKEW_S = 0.05


def test_max_concurrency_one_runs_calls_one_at_a_time(front, upstream, via_front):
    # the upstream idle first: an earlier test's sequences (n choices run at once) must not count here
    eventually(lambda: metric_total(upstream, "vllm:num_requests_running", model_name=UPSTREAM_MODEL) == 0,
               "the upstream kept running an earlier test's sequences")
    observed: list[float] = []
    is_done = threading.Event()

    def watch() -> None:
        while not is_done.is_set():
            text = httpx.get(f"{upstream.url}/metrics").text
            found = re.search(rf'vllm:num_requests_running\{{model_name="{UPSTREAM_MODEL}"\}} (\S+)', text)
            if found:
                observed.append(float(found.group(1)))
            time.sleep(0.05)

    def one(i: int) -> tuple[float, float]:
        stream = via_front.completions.create(model="proxy", prompt=f"Request {i}", max_tokens=40, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
        times = [time.monotonic() for chunk in stream if chunk.choices and chunk.choices[0].text]
        return times[0], times[-1]

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(3) as pool:
            spans = sorted(pool.map(one, range(3)))
    finally:
        is_done.set()
        watcher.join()
    # Each span is what one client thread saw, and a thread can be a few milliseconds late to read its last
    # chunk while another reads a burst of its own (CI once saw the next call start 5 ms before the last
    # chunk of the one before was read). Calls running at once would overlap by most of a span (40 tokens
    # take hundreds of milliseconds), so a skew of up to SKEW_S is the clients' and not the upstream's.
    for (_, end), (next_start, _) in itertools.pairwise(spans):
        assert next_start >= end - SKEW_S, f"two upstream calls overlapped: {spans}"
    assert observed and max(observed) <= 1
    exported = httpx.get(f"{front.url}/metrics").text  # the front reports the upstream's load as an engine does
    assert 'vllm:num_requests_running{model_name="proxy"}' in exported
    assert 'vllm:num_requests_waiting{model_name="proxy"}' in exported


def _upstream_cancellations(upstream: ServerProcess, *also: str) -> float:
    """Requests the upstream sluice saw withdrawn by its client (the front) before they finished,
    and those that ended with one of the outcomes in `also`."""
    return sum(metric_total(upstream, "sluice_requests_total", model=UPSTREAM_MODEL, outcome=outcome)
               for outcome in ("cancelled", *also))


def _running(server: ServerProcess, model: str) -> float:
    return metric_total(server, "vllm:num_requests_running", model_name=model)


def _wait_until_idle(server: ServerProcess, model: str) -> None:
    deadline = time.monotonic() + 15
    while _running(server, model) != 0:
        assert time.monotonic() < deadline, f"{model} on {server.url} still has calls running"
        time.sleep(0.05)


def _wait_for_upstream_cancellation(upstream: ServerProcess, before: float, what: str, *also: str) -> None:
    """The upstream counts one more cancelled request (or one more of the outcomes in `also`; a
    generation that ran to its end would count as ok instead), and its engine has nothing left
    running."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if _upstream_cancellations(upstream, *also) >= before + 1 and _running(upstream, UPSTREAM_MODEL) == 0:
            return
        time.sleep(0.25)
    pytest.fail(f"the upstream kept generating {what}")


def test_a_client_that_disconnects_closes_the_upstream_stream(via_front, upstream):
    before = _upstream_cancellations(upstream)
    stream = via_front.completions.create(model="proxy", prompt="Keep going", max_tokens=800, temperature=0.8,
                                          stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()
    _wait_for_upstream_cancellation(upstream, before, "for a client that left")


def test_an_upstream_that_is_down_is_503_with_retry_after(front):
    response = httpx.post(f"{front.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "down", "prompt": "hello", "max_tokens": 4}, timeout=30)
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) >= 1
    assert "connection" in response.json()["error"]["message"]


def test_tenancy_applies_in_front_of_an_upstream_that_needs_no_key(front):
    with (openai.OpenAI(base_url=f"{front.url}/v1", api_key="sk-wrong", max_retries=0) as sdk,
          pytest.raises(openai.AuthenticationError)):
        sdk.completions.create(model="proxy", prompt="hello", max_tokens=4)


def test_a_deadline_that_passes_mid_generation_is_504_and_stops_the_upstream(front, upstream):
    # the proxy has one slot: a call an earlier test left winding down would hold it past this
    # request's deadline, which then never reaches the upstream at all
    _wait_until_idle(front, "proxy")
    _wait_until_idle(upstream, UPSTREAM_MODEL)
    # The front passes its remaining time on (X-Request-Timeout-Ms), so the upstream reaches the
    # same deadline: whichever side notices first ends the generation there, as "cancelled" (the
    # front closed the stream) or "expired" (the upstream's own deadline).
    before = _upstream_cancellations(upstream, "expired")
    response = httpx.post(f"{front.url}/v1/completions",
                          headers={"Authorization": f"Bearer {KEY}", "X-Request-Timeout-Ms": "1000"},
                          json={"model": "proxy", "prompt": "Go on", "max_tokens": 900, "ignore_eos": True},
                          timeout=30)
    assert response.status_code == 504, response.text
    _wait_for_upstream_cancellation(upstream, before, "past the request's deadline", "expired")
