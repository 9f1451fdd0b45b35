"""Chat tool calls through the real `openai` SDK against a random-weight model: with `tool_choice`
"required" or a named function, the answer is `tool_calls` whose arguments fit the tools' schemas
(the SDK's `parse()` reads them into pydantic models), unary and streamed; a conversation may carry
earlier calls and their results; what cannot be served is a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.conftest import start_server, write_tiny_lm_model

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _weather_args(arguments: str) -> bool:
    value = json.loads(arguments)
    return set(value) == {"city", "unit"} and value["city"] in ("Paris", "Oslo", "Lima") and value["unit"] in "CF"


def _time_args(arguments: str) -> bool:
    return json.loads(arguments) in ({"zone": "UTC"}, {"zone": "CET"})


def test_a_named_function_is_called_with_arguments_that_fit_its_schema(tiny_lm_client):
    answer = tiny_lm_client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=100, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert _weather_args(call.function.arguments), call.function.arguments


def test_required_calls_pick_among_the_tools_and_parallel_calls_can_be_refused(tiny_lm_client):
    for seed in range(3):
        answer = tiny_lm_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME],
                                                        tool_choice="required", max_tokens=200, seed=seed, n=2)
        for choice in answer.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
            for call in choice.message.tool_calls:
                check = _weather_args if call.function.name == "get_weather" else _time_args
                assert call.function.name in ("get_weather", "get_time") and check(call.function.arguments)
    single = tiny_lm_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME],
                                                    tool_choice="required", parallel_tool_calls=False,
                                                    max_tokens=200, seed=7)
    assert len(single.choices[0].message.tool_calls) == 1


def test_streamed_tool_calls_add_up_to_the_calls(tiny_lm_client):
    named = list(tiny_lm_client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=100, seed=2, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in named if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:]) and len(deltas) > 1  # arguments as they come
    assert _weather_args("".join(d.function.arguments or "" for d in deltas))
    assert named[-1].choices[0].finish_reason == "tool_calls"
    required = list(tiny_lm_client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200, seed=3,
        stream=True))
    calls = [d for c in required if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert calls and all(d.id.startswith("call_") for d in calls)  # each call whole, in one chunk
    assert [d.index for d in calls] == list(range(len(calls)))
    assert required[-1].choices[0].finish_reason == "tool_calls"


class GetWeather(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    unit: Literal["C", "F"]


def test_the_sdks_parse_reads_the_arguments_into_a_pydantic_model(tiny_lm_client):
    answer = tiny_lm_client.chat.completions.parse(
        model="tiny", messages=MESSAGES, tools=[openai.pydantic_function_tool(GetWeather)], max_tokens=100, seed=4,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    (call,) = answer.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_a_conversation_carries_earlier_calls_and_their_results(tiny_lm_client):
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 and snowing"}]
    answer = tiny_lm_client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                                    tool_choice="none", max_tokens=5, temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
    usage_with_history = answer.usage.prompt_tokens
    short = tiny_lm_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0)
    assert usage_with_history > short.usage.prompt_tokens  # the call and its result are in the prompt


@pytest.fixture(scope="module")
def auto_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """Tiny models whose model.toml say how each writes tool calls: one per call format."""
    repo = tmp_path_factory.mktemp("repo")
    for name, parser in FORMATS.items():
        write_tiny_lm_model(repo, name)
        toml = repo / name / "model.toml"
        toml.write_text(toml.read_text() + f'tool_call_parser = "{parser}"\n')
    server = start_server(repo, tmp_path_factory.mktemp("log"))
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60) as sdk:
        yield sdk
    server.stop()


FORMATS = {"qwenish": "hermes", "llamaish": "llama3_json", "mistralish": "mistral", "pythonish": "pythonic"}
ARGS = r'\{"city": "(Oslo|Lima)", "unit": "C"\}'
WRITTEN = {  # what a model of each family writes when it calls get_weather (forced by a regular expression)
    "qwenish": (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": ' + ARGS + r'\}\n</tool_call>',
                "Checking."),
    "llamaish": (r'\{"name": "get_weather", "parameters": ' + ARGS + r'\}', None),
    "mistralish": (r'\[\{"name": "get_weather", "arguments": ' + ARGS + r'\}\]', None),
    "pythonish": (r'\[get_weather\(city="(Oslo|Lima)", unit="C"\)\]', None),
}


@pytest.mark.parametrize("model", list(FORMATS))
def test_auto_reads_the_calls_a_model_writes_in_its_format(auto_client, model):
    """The model decides: here a regular expression makes it write a call in its family's format,
    and `auto` answers that as a tool call, any text before it as content; unforced, it writes text."""
    regex, content = WRITTEN[model]
    forced = dict(model=model, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=300, seed=1,
                  extra_body={"guided_regex": regex})
    choice = auto_client.chat.completions.create(**forced).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and _weather_args(call.function.arguments)
    chunks = list(auto_client.chat.completions.create(**forced, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (content or "")
    (streamed,) = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert streamed.function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    free = auto_client.chat.completions.create(model=model, messages=MESSAGES, tools=[WEATHER], max_tokens=8,
                                               temperature=0)
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [WEATHER]}, "tool_choice"),  # "auto"
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "logprobs": True}, "logprobs"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
])
def test_what_cannot_be_served_is_400_naming_the_field(tiny_lm_client, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_lm_client.chat.completions.create(model="tiny", max_tokens=10, **{"messages": MESSAGES, **body})
    assert caught.value.body["param"] == param, caught.value.body


WEATHER_FUNCTION = WEATHER["function"]


def test_legacy_functions_are_called_and_answered_as_function_call(tiny_lm_client):
    """Old code's `functions` and `function_call` (the SDK still sends them): served as tools,
    answered in their own shape, `message.function_call` and `finish_reason: "function_call"`."""
    legacy = dict(model="tiny", messages=MESSAGES, functions=[WEATHER_FUNCTION, TIME["function"]], max_tokens=100,
                  seed=1, function_call={"name": "get_weather"})
    choice = tiny_lm_client.chat.completions.create(**legacy).choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "get_weather" and _weather_args(choice.message.function_call.arguments)
    chunks = list(tiny_lm_client.chat.completions.create(stream=True, **legacy))
    pieces = [c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call]
    assert pieces[0].name == "get_weather" and all(p.name is None for p in pieces[1:])
    assert "".join(p.arguments or "" for p in pieces) == choice.message.function_call.arguments  # seeded: the same
    assert chunks[-1].choices[0].finish_reason == "function_call"
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


def test_a_legacy_conversation_carries_earlier_function_calls_and_their_results(tiny_lm_client):
    messages = [*MESSAGES, {"role": "assistant", "content": None, "function_call": {
                    "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}},
                {"role": "function", "name": "get_weather", "content": "-3 and snowing"}]
    answer = tiny_lm_client.chat.completions.create(model="tiny", messages=messages, functions=[WEATHER_FUNCTION],
                                                    function_call="none", max_tokens=5, temperature=0)
    assert answer.choices[0].message.function_call is None and answer.choices[0].finish_reason in ("stop", "length")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Oslo", "unit": "C"}'}}
    with_tools = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "-3 and snowing"}]
    same = tiny_lm_client.chat.completions.create(model="tiny", messages=with_tools, tools=[WEATHER],
                                                  tool_choice="none", max_tokens=5, temperature=0)
    assert answer.usage.prompt_tokens == same.usage.prompt_tokens  # the same conversation, the legacy way


@pytest.mark.parametrize(("body", "param"), [
    ({"functions": [WEATHER_FUNCTION], "tools": [WEATHER]}, "functions"),
    ({"function_call": {"name": "get_weather"}}, "function_call"),
    ({"functions": [WEATHER_FUNCTION], "function_call": {"name": "nope"}}, "function_call"),
    ({"functions": [WEATHER_FUNCTION]}, "function_call"),  # "auto", and this model names no tool_call_parser
    ({"functions": [WEATHER_FUNCTION, WEATHER_FUNCTION], "function_call": {"name": "get_weather"}}, "functions"),
    ({"messages": [*MESSAGES, {"role": "function", "name": "get_weather", "content": "12 C"}]}, "messages"),
])
def test_legacy_function_calling_that_cannot_be_served_is_400_naming_its_field(tiny_lm_client, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_lm_client.chat.completions.create(model="tiny", max_tokens=10, **{"messages": MESSAGES, **body})
    assert caught.value.body["param"] == param, caught.value.body
    message = caught.value.body["message"]
    assert param == "messages" or (param in message and "tool names" not in message and "'required'" not in message)


def test_auto_legacy_functions_and_one_call_without_parallel_tool_calls(auto_client):
    """`functions` with `function_call` "auto" (its default) reads the call the model writes, as
    tools with "auto" do, answered as `function_call`; `parallel_tool_calls: false` with "auto"
    answers the first of the calls written, not all of them."""
    regex, content = WRITTEN["qwenish"]
    forced = dict(model="qwenish", messages=MESSAGES, max_tokens=300, seed=1, extra_body={"guided_regex": regex})
    choice = auto_client.chat.completions.create(functions=[WEATHER_FUNCTION, TIME["function"]], **forced).choices[0]
    assert choice.finish_reason == "function_call" and choice.message.content == content
    assert choice.message.function_call.name == "get_weather" and _weather_args(choice.message.function_call.arguments)
    chunks = list(auto_client.chat.completions.create(functions=[WEATHER_FUNCTION], stream=True, **forced))
    (streamed,) = [c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call]
    assert streamed.name == "get_weather" and chunks[-1].choices[0].finish_reason == "function_call"
    two = (r'<tool_call>\n\{"name": "get_weather", "arguments": ' + ARGS + r'\}\n</tool_call>\n'
           r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>')
    both = dict(model="qwenish", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=300, seed=1,
                extra_body={"guided_regex": two})
    assert len(auto_client.chat.completions.create(**both).choices[0].message.tool_calls) == 2
    (first,) = auto_client.chat.completions.create(parallel_tool_calls=False, **both).choices[0].message.tool_calls
    assert first.function.name == "get_weather"
