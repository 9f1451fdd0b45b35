"""The `openai-upstream` runner alone, against a scripted OpenAI SSE server on loopback
(tests/upstream_server.py): configuration, the request it sends, relaying, retries before the
first byte only, the upstream's refusals, and the circuit breaker."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sluice import wire
from sluice.engines.openai_upstream import (
    CallEnd,
    CallEvent,
    CallFailure,
    OpenAIUpstreamRunner,
    TextDelta,
    parse_config,
    request_for,
)
from sluice.errors import ConfigError
from sluice.repository import BatchingConfig, ModelVersion
from tests.upstream_server import SsePlan, UpstreamServer


@pytest.fixture
def upstream() -> Iterator[UpstreamServer]:
    with UpstreamServer() as server:
        yield server


def _version(url: str, **settings: object) -> ModelVersion:
    return ModelVersion(
        name="proxy", version="1", kind="openai-upstream", platform="sluice_openai-upstream",
        batching=BatchingConfig(), slo_s=10.0, weights_dir=Path("."), manifest_path=Path("SHA256SUMS"),
        upstream={"url": url, "backoff_ms": 1, **settings},
    )


@pytest.fixture
async def make_runner() -> AsyncIterator:
    runners: list[OpenAIUpstreamRunner] = []

    async def make(url: str, **settings: object) -> OpenAIUpstreamRunner:
        runner = OpenAIUpstreamRunner(_version(url, **settings), "cpu")
        await runner.start()
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        await runner.aclose()


async def _events(runner: OpenAIUpstreamRunner, payload: wire.GeneratePayload | None = None) -> list[CallEvent]:
    return [event async for event in runner.generate(payload or wire.GeneratePayload(prompt="hi"), 10.0)]


def _base(upstream: UpstreamServer) -> str:
    return f"http://127.0.0.1:{upstream.port}/v1"


def test_configuration_reads_the_key_from_the_environment_only(monkeypatch):
    assert parse_config(_version("http://h:1/v1/")).model == "proxy"
    assert parse_config(_version("http://h:1/v1/")).base_url == "http://h:1/v1"
    with pytest.raises(ConfigError, match="api_key_env"):
        parse_config(_version("http://h:1/v1", api_key="sk-in-the-file"))
    with pytest.raises(ConfigError, match="UPSTREAM_TEST_KEY"):
        parse_config(_version("http://h:1/v1", api_key_env="UPSTREAM_TEST_KEY"))
    monkeypatch.setenv("UPSTREAM_TEST_KEY", "sk-secret")
    assert parse_config(_version("http://h:1/v1", api_key_env="UPSTREAM_TEST_KEY")).api_key == "sk-secret"
    with pytest.raises(ConfigError):
        parse_config(_version("ftp://h:1/v1"))
    for bad in ({"max_concurrency": 0}, {"timeout_s": 0}, {"max_attempts": 0}, {"max_concurrency": "many"}):
        with pytest.raises(ConfigError):
            parse_config(_version("http://h:1/v1", **bad))


def test_the_request_forwards_sampling_and_sends_extensions_only_when_set():
    config = parse_config(_version("http://h:1/v1", model="their-name"))
    url, body = request_for(config, wire.GeneratePayload(prompt="hi", max_tokens=7, temperature=0.0, stop=["x"]))
    assert url == "http://h:1/v1/completions"
    assert body == {"model": "their-name", "stream": True, "stream_options": {"include_usage": True},
                    "max_tokens": 7, "temperature": 0.0, "top_p": 1.0, "stop": ["x"], "prompt": "hi"}
    chat = wire.GeneratePayload(messages=[wire.ChatMessage("user", "hey")], top_k=5, seed=3, ignore_eos=True)
    url, body = request_for(config, chat)
    assert url == "http://h:1/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "hey"}]
    assert (body["top_k"], body["seed"], body["ignore_eos"]) == (5, 3, True)
    assert "prompt" not in body and "min_tokens" not in body
    _, body = request_for(config, wire.GeneratePayload(prompt="hi", skip_special_tokens=False,
                                                       include_stop_str_in_output=True, min_p=0.1))
    assert (body["skip_special_tokens"], body["include_stop_str_in_output"], body["min_p"]) == (False, True, 0.1)
    _, body = request_for(config, wire.GeneratePayload(messages=[wire.ChatMessage("assistant", "Once")],
                                                       template=wire.ChatTemplateOptions(False, True, {"x": 1})))
    assert (body["add_generation_prompt"], body["continue_final_message"], body["chat_template_kwargs"]) == (
        False, True, {"x": 1})
    assert "continue_final_message" not in request_for(config, chat)[1]  # unset: not sent
    assert "reasoning_effort" not in request_for(config, chat)[1]
    effortful = wire.GeneratePayload(messages=[wire.ChatMessage("user", "hey")], reasoning_effort="low")
    assert request_for(config, effortful)[1]["reasoning_effort"] == "low"  # the upstream decides what it means
    named = wire.GeneratePayload(messages=[wire.ChatMessage("user", "hey", name="alice")])
    assert request_for(config, named)[1]["messages"] == [{"role": "user", "content": "hey", "name": "alice"}]
    assert "cache_salt" not in request_for(config, named)[1]
    assert request_for(config, wire.GeneratePayload(prompt="hi", cache_salt="s"))[1]["cache_salt"] == "s"


def test_the_request_asks_for_log_probabilities_in_each_endpoints_own_words():
    config = parse_config(_version("http://h:1/v1"))
    _, body = request_for(config, wire.GeneratePayload(prompt="hi", logprobs=3))
    assert body["logprobs"] == 3 and "top_logprobs" not in body
    _, body = request_for(config, wire.GeneratePayload(messages=[wire.ChatMessage("user", "hey")], logprobs=2))
    assert (body["logprobs"], body["top_logprobs"]) == (True, 2)
    _, body = request_for(config, wire.GeneratePayload(prompt="hi", frequency_penalty=0.5, logit_bias={7: -5.0}))
    assert (body["frequency_penalty"], body["logit_bias"]) == (0.5, {"7": -5.0}) and "logprobs" not in body


def test_upstream_log_probabilities_are_read_in_both_shapes_and_malformed_ones_are_dropped():
    from sluice.engines.openai_upstream import _logprobs

    completion = _logprobs({"tokens": [" a"], "token_logprobs": [-0.5], "top_logprobs": [{" b": -1.0, " a": -0.5}]})
    assert completion == (wire.TokenLogprob(" a", -1, -0.5, [wire.TopLogprob(" a", -1, -0.5),
                                                               wire.TopLogprob(" b", -1, -1.0)]),)
    chat = _logprobs({"content": [{"token": "x", "logprob": -0.1, "bytes": [120],
                                   "top_logprobs": [{"token": "x", "logprob": -0.1}]}]})
    assert chat == (wire.TokenLogprob("x", -1, -0.1, [wire.TopLogprob("x", -1, -0.1)]),)
    part = _logprobs({"content": [{"token": "\ufffd", "logprob": -0.2, "bytes": [0xE4],  # part of a character
                                   "top_logprobs": [{"token": "\ufffd", "logprob": -0.2, "bytes": [0xE4]},
                                                    {"token": "\ufffd", "logprob": -0.3, "bytes": 5}]}]})
    assert part == (wire.TokenLogprob("\ufffd", -1, -0.2, [wire.TopLogprob("\ufffd", -1, -0.2, b"\xe4"),
                                                            wire.TopLogprob("\ufffd", -1, -0.3)], b"\xe4"),)
    for malformed in (None, "x", {"tokens": ["a"], "token_logprobs": ["nan?"]}, {"content": [{"token": "x"}]},
                      {"tokens": ["a", "b"], "token_logprobs": [-1.0]}):
        assert _logprobs(malformed) == ()


async def test_deltas_are_relayed_then_the_end_with_usage_and_the_key_is_sent(upstream, make_runner, monkeypatch):
    monkeypatch.setenv("UPSTREAM_TEST_KEY", "sk-secret")
    runner = await make_runner(_base(upstream), api_key_env="UPSTREAM_TEST_KEY")
    events = await _events(runner)
    assert events == [TextDelta("Hello"), TextDelta(" world"), CallEnd(("stop",), 5, 3, 2)]
    assert upstream.last_headers["Authorization"] == "Bearer sk-secret"
    assert upstream.last_body["stream_options"] == {"include_usage": True}


async def test_the_prompt_tokens_the_upstream_wrote_to_its_cache_are_carried_when_it_says(upstream, make_runner):
    runner = await make_runner(_base(upstream))
    upstream.sse_plans.append(SsePlan(usage={"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {
        "cached_tokens": 1, "cache_write_tokens": 4}}))
    assert (await _events(runner))[-1] == CallEnd(("stop",), 5, 1, 2, num_cache_write_tokens=4)
    assert (await _events(runner))[-1].num_cache_write_tokens is None  # not said: not taken as none written


def test_auto_tool_choice_is_asked_of_the_upstream_as_auto():
    config = parse_config(_version("http://h:1/v1"))
    weather = wire.ToolSpec("get_weather", "", '{"type": "object"}')
    chat = wire.GeneratePayload(messages=[wire.ChatMessage("user", "hey")], tools=[weather], tools_auto=True)
    assert request_for(config, chat)[1]["tool_choice"] == "auto"
    shown = wire.GeneratePayload(messages=[wire.ChatMessage("user", "hey")], tools=[weather])
    assert request_for(config, shown)[1]["tool_choice"] == "none"


async def test_streamed_upstream_tool_calls_come_back_as_calls_the_gateway_reads(upstream, make_runner):
    """The calls stream as vLLM streams them (a call's name, then its arguments in pieces); the
    relayed text holds them as Hermes blocks, which the runner names as its models' format."""
    from sluice.api.tool_calls import ToolPlan

    def call(index: int, **function: str) -> dict[str, object]:
        return {"tool_calls": [{"index": index, "function": function}]}

    upstream.sse_plans.append(SsePlan(deltas=[
        "Checking.", call(0, name="get_weather", arguments=""), call(0, arguments='{"city": '),
        call(0, arguments='"Oslo"}'), call(1, name="get_time")], finish_reason="tool_calls"))
    runner = await make_runner(_base(upstream))
    assert runner.info.tool_call_parser == "hermes"
    events = await _events(runner, wire.GeneratePayload(messages=[wire.ChatMessage("user", "hey")]))
    *deltas, end = events
    assert isinstance(end, CallEnd) and end.finish_reasons == ("stop",)
    text = "".join(d.text for d in deltas if isinstance(d, TextDelta))
    content, calls = ToolPlan(None, "hermes", frozenset({"get_weather", "get_time"})).split(text)
    assert content == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]


async def test_streamed_upstream_thoughts_come_back_as_a_think_block_the_gateway_reads(upstream, make_runner):
    """Thoughts stream apart (`reasoning_content`, or vLLM's newer `reasoning`); the relayed text
    holds them as a `<think>` block ahead of the answer and its calls, which the runner names as
    its models' reasoning format; an answer with no thoughts has no block."""
    from sluice.api.tool_calls import ToolPlan
    from sluice.reasoning import split_reasoning

    upstream.sse_plans += [
        SsePlan(deltas=[{"reasoning_content": "Oslo, "}, {"reasoning": "then."}, "Checking.",
                        {"tool_calls": [{"index": 0, "function": {"name": "get_weather", "arguments": "{}"}}]}],
                finish_reason="tool_calls", usage={"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
                                                   "completion_tokens_details": {"reasoning_tokens": 4}}),
        SsePlan(deltas=[{"reasoning_content": "cut while thinking"}], finish_reason="length"),
        SsePlan(deltas=["Just ", "this."])]
    runner = await make_runner(_base(upstream))
    assert runner.info.reasoning_parser == "qwen3"
    chat = wire.GeneratePayload(messages=[wire.ChatMessage("user", "hey")])
    texts, ends = [], []
    for _ in range(3):
        *deltas, end = await _events(runner, chat)
        assert isinstance(end, CallEnd)
        texts.append("".join(d.text for d in deltas if isinstance(d, TextDelta)))
        ends.append(end)
    assert [end.num_reasoning_tokens for end in ends] == [4, 0, 0]  # as the upstream counted them, where it did
    thought, answer = split_reasoning(runner.info.reasoning_parser, texts[0])
    assert thought == "Oslo, then."
    content, calls = ToolPlan(None, "hermes", frozenset({"get_weather"})).split(answer)
    assert content == "Checking." and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert split_reasoning(runner.info.reasoning_parser, texts[1]) == ("cut while thinking", "")
    assert split_reasoning(runner.info.reasoning_parser, texts[2]) == (None, "Just this.")


async def test_an_undecodable_event_is_a_retryable_failure_not_an_error():
    from sluice.engines.openai_upstream import _relay

    class Response:  # what `_relay` reads of an aiohttp response: its lines
        def __init__(self, line: bytes) -> None:
            async def lines() -> AsyncIterator[bytes]:
                yield line

            self.content = lines()

    for data in (b"{not json", b"[" * 5000):  # the second nests deeper than json decodes
        events = [event async for event in _relay(Response(b"data: " + data + b"\n"))]  # type: ignore[arg-type]
        assert len(events) == 1 and isinstance(events[0], CallFailure) and events[0].is_retryable
        assert "undecodable" in events[0].message


async def test_a_5xx_before_the_first_byte_is_retried(upstream, make_runner):
    upstream.sse_plans = [SsePlan(status=503), SsePlan(status=502)]
    runner = await make_runner(_base(upstream), max_attempts=3)
    events = await _events(runner)
    assert events[-1] == CallEnd(("stop",), 5, 3, 2) and upstream.num_requests == 3


async def test_retries_spent_is_a_retryable_failure_without_a_client_status(upstream, make_runner):
    upstream.sse_plans = [SsePlan(status=500)] * 2
    runner = await make_runner(_base(upstream), max_attempts=2)
    (failure,) = await _events(runner)
    assert isinstance(failure, CallFailure) and failure.status == 0 and "2 attempts" in failure.message


async def test_a_client_error_is_final_and_keeps_its_status(upstream, make_runner):
    upstream.sse_plans = [SsePlan(status=422, error_param="max_tokens")]
    runner = await make_runner(_base(upstream))
    assert await _events(runner) == [CallFailure("injected 422", status=422, param="max_tokens")]
    assert upstream.num_requests == 1


async def test_refused_credentials_are_not_the_clients_error(upstream, make_runner):
    upstream.sse_plans = [SsePlan(status=401)]
    (failure,) = await _events(await make_runner(_base(upstream)))
    assert isinstance(failure, CallFailure) and failure.status == 0 and "credentials" in failure.message


async def test_a_stream_that_breaks_after_text_is_not_retried(upstream, make_runner):
    upstream.sse_plans = [SsePlan(deltas=["Hel"], is_broken=True)]
    events = await _events(await make_runner(_base(upstream)))
    assert events[0] == TextDelta("Hel") and isinstance(events[1], CallFailure) and len(events) == 2
    assert upstream.num_requests == 1


async def test_repeated_failures_open_the_circuit(make_runner):
    runner = await make_runner("http://127.0.0.1:9/v1", max_attempts=1, failure_threshold=2, open_s=30)
    for _ in range(2):
        (failure,) = await _events(runner)
        assert "connection error" in failure.message
    (failure,) = await _events(runner)
    assert "circuit open" in failure.message and failure.retry_after_s is not None


async def test_a_call_cut_short_by_the_requests_deadline_is_the_deadline_not_an_upstream_failure(
        upstream, make_runner):
    """The worker answers 504 for it, as for any missed deadline; a call that outlives the
    upstream's own `timeout_s` within the deadline stays a (retryable) upstream failure: 503."""
    upstream.delay_s = 1.0
    runner = await make_runner(_base(upstream), max_attempts=1, timeout_s=10)
    (failure,) = [event async for event in runner.generate(wire.GeneratePayload(prompt="hi"), 0.2)]
    assert isinstance(failure, CallFailure) and failure.is_deadline
    slow = await make_runner(_base(upstream), max_attempts=1, timeout_s=0.2)
    (failure,) = [event async for event in slow.generate(wire.GeneratePayload(prompt="hi"), 10.0)]
    assert isinstance(failure, CallFailure) and not failure.is_deadline and "no complete answer" in failure.message
