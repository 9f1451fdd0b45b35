"""A reasoning model's thoughts answered apart from its answer (`reasoning_parser`), through the
real `openai` SDK against a real server: chat unary and streamed, with tool calls after the
thoughts, a JSON answer's grammar leaving the thoughts free, and the Responses API. The
random-weight model is made to think by a regular expression (vLLM's `guided_regex`), which holds
the whole output: its thoughts are what it tags."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.conftest import ServerProcess, start_server, write_tiny_lm_model

pytestmark = pytest.mark.slow

THINKING = r"<think>\nweigh(ing)? it\n</think>\n\nYes\."
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Two names for one tiny model (the same generated weights): `qwen` reads its thoughts as
    Qwen3 writes them, `r1` as DeepSeek-R1 does (it starts in them)."""
    repo = tmp_path_factory.mktemp("repo")
    for name, parser in (("qwen", "qwen3"), ("r1", "deepseek_r1")):
        write_tiny_lm_model(repo, name)
        toml = repo / name / "model.toml"
        toml.write_text(toml.read_text() + f'reasoning_parser = "{parser}"\ntool_call_parser = "hermes"\n')
    started = start_server(repo, tmp_path_factory.mktemp("log"))
    yield started
    started.stop()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as sdk:
        yield sdk


def _ask(**fields: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "Is it?"}], "max_tokens": 60, "seed": 1, **fields}


def test_thoughts_come_apart_from_the_answer_unary_and_streamed(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model="qwen", **_ask(extra_body={"guided_regex": THINKING}))
    message = answer.choices[0].message
    assert message.content == "\n\nYes." and answer.choices[0].finish_reason == "stop"
    assert 0 < answer.usage.completion_tokens_details.reasoning_tokens < answer.usage.completion_tokens
    thought = message.model_extra["reasoning_content"]
    assert thought in ("\nweigh it\n", "\nweighing it\n") and message.model_extra["reasoning"] == thought
    chunks = list(client.chat.completions.create(model="qwen", stream=True, stream_options={"include_usage": True},
                                                 **_ask(extra_body={"guided_regex": THINKING})))
    assert chunks[-1].usage == answer.usage  # the same seed: the same tokens
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == "\n\nYes."
    assert not any("<think>" in (d.content or "") or "think>" in ((d.model_extra or {}).get("reasoning_content") or "")
                   for d in deltas)


def test_a_model_that_starts_in_its_thoughts_and_one_that_does_not(client: openai.OpenAI) -> None:
    """Untagged, unconstrained text: all thought for DeepSeek-R1's reading (its template opened
    them, and max_tokens cut them), all answer for Qwen3's (it was asked not to think)."""
    r1_answer = client.chat.completions.create(model="r1", **_ask(max_tokens=12))
    qwen_answer = client.chat.completions.create(model="qwen", **_ask(
        max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    r1, qwen = r1_answer.choices[0].message, qwen_answer.choices[0].message
    assert r1_answer.usage.completion_tokens_details.reasoning_tokens == r1_answer.usage.completion_tokens == 12
    assert qwen_answer.usage.completion_tokens_details.reasoning_tokens == 0
    assert qwen.content and qwen.model_extra["reasoning_content"] is None
    assert r1.model_extra["reasoning_content"] == qwen.content and r1.content is None


def test_tool_calls_are_read_from_the_answer_after_the_thoughts(client: openai.OpenAI) -> None:
    calling = (r'<think>\nOslo\?\n</think>\n\n<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "Oslo"\}\}\n</tool_call>')
    ask = _ask(tools=[WEATHER], tool_choice="auto", max_tokens=200, extra_body={"guided_regex": calling})
    choice = client.chat.completions.create(model="qwen", **ask).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"] == "\nOslo?\n"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    chunks = list(client.chat.completions.create(model="qwen", stream=True, **ask))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "\nOslo?\n"
    (streamed,) = [call for d in deltas for call in d.tool_calls or []]
    assert streamed.function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(d.content or "" for d in deltas).strip()


def test_a_json_answer_may_come_after_free_thoughts(client: openai.OpenAI) -> None:
    """A structured output's grammar leaves a reasoning model's thoughts free: DeepSeek-R1's
    reading starts in them, and this model, cut by max_tokens before any `</think>`, is still
    thinking, in text no JSON schema would allow."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    answer = client.chat.completions.create(model="r1", **_ask(max_tokens=16, response_format={
        "type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}))
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "length" and message.content is None
    thought = message.model_extra["reasoning_content"]
    assert thought and not thought.lstrip().startswith("{")
    completion = client.completions.create(model="r1", prompt="Is it?", max_tokens=16, seed=1,
                                           extra_body={"response_format": {"type": "json_object"}})
    assert completion.choices[0].text.startswith("{")  # a completion is answered whole: no thoughts first


def test_responses_answer_thoughts_as_a_reasoning_item(client: openai.OpenAI) -> None:
    """DeepSeek-R1's reading of untagged text cut by max_output_tokens: all of it a reasoning
    item, then an empty message, unary and streamed; Qwen3's: all of it the message."""
    ask = {"input": "Is it?", "max_output_tokens": 12, "temperature": 0, "include": ["message.output_text.logprobs"]}
    plain = client.responses.create(model="qwen", **ask)
    assert [item.type for item in plain.output] == ["message"] and plain.output_text
    response = client.responses.create(model="r1", **ask)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.status == "incomplete"
    assert message.content[0].logprobs == []  # its tokens were all thought
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text == plain.output_text
    assert message.type == "message" and response.output_text == "" and response.status == "incomplete"
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 12
    assert plain.usage.output_tokens_details.reasoning_tokens == 0
    events = list(client.responses.create(model="r1", stream=True, **ask))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert thought == done.text == plain.output_text
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].status == "incomplete" and final.output[1].content[0].logprobs == []
    assert final.output[0].content[0].text == plain.output_text

