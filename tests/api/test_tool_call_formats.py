"""`tool_choice: "auto"`: the calls each model family writes in its text, read back as OpenAI's
`tool_calls` (the rest as content), whole and streamed in small pieces alike."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice import wire
from sluice.api.completion_shapes import ResponseShape
from sluice.api.tool_calls import CALL_FORMATS, ToolPlan
from sluice.engines.generative.runner import TOOL_CALL_PARSERS

NAMES = frozenset({"get_weather", "get_time"})
OSLO = ("get_weather", {"city": "Oslo"})
TIME = ("get_time", {})
W = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
T = '{"name": "get_time", "arguments": {}}'
LLAMA_W = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'

CASES = [
    ("hermes", f"Let me look.\n<tool_call>\n{W}\n</tool_call>", "Let me look.", [OSLO]),
    ("hermes", f"<tool_call>{W}</tool_call>\n<tool_call>{T}</tool_call>", "", [OSLO, TIME]),
    ("hermes", f"<tool_call>{W.replace('get_weather', 'launch')}</tool_call>", None, []),
    ("hermes", "a <table> of <tool_c", None, []),
    ("llama3_json", LLAMA_W, "", [OSLO]),
    ("llama3_json", f"<|python_tag|>{LLAMA_W}; {T}", "", [OSLO, TIME]),
    ("llama3_json", '{"name": "get_weather", "parameters": "{\\"city\\": \\"Oslo\\"}"}', "", [OSLO]),
    ("llama3_json", f"It is sunny. {LLAMA_W}", None, []),  # calls come first or not at all
    ("llama3_json", f"{LLAMA_W} and then some", None, []),
    ("llama3_json", '{"name": "launch", "parameters": {}}', None, []),
    ("llama3_json", "<|pyth", None, []),
    ("mistral", f"[TOOL_CALLS] [{W}]", "", [OSLO]),
    ("mistral", f"Sure. [TOOL_CALLS][{W}, {T}]", "Sure.", [OSLO, TIME]),
    ("mistral", f" [{W}]", "", [OSLO]),  # the marker left out of the text
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}', "", [OSLO, TIME]),
    ("mistral", "[1, 2, 3] are numbers", None, []),
    ("mistral", f"[TOOL_CALLS] [{W.replace('get_weather', 'launch')}]", None, []),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]" + "{\"a\": " * 5000, None, []),  # deeper than json decodes
    ("llama3_json", '{"name": "get_weather", "parameters": ' + "[" * 5000, None, []),
    ("hermes", "<tool_call>" + "[" * 5000 + "</tool_call>", None, []),
    ("pythonic", '[get_weather(city="Oslo")]', "", [OSLO]),
    ("pythonic", '  [get_weather(city="Oslo"), get_time()]', "", [OSLO, TIME]),
    ("pythonic", "It is sunny.", None, []),
    ("pythonic", '[get_weather("Oslo")]', None, []),  # positional arguments name nothing
    ("pythonic", "[launch()]", None, []),
    ("pythonic", '[get_weather(city=__import__("os").getcwd())]', None, []),  # not a literal: read, never run
    ("pythonic", "[1, 2, 3] are numbers", None, []),
    ("pythonic", "[" * 5000, None, []),
]


def _calls(tool_calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def test_every_parser_a_model_may_name_is_one_the_api_reads():
    assert set(CALL_FORMATS) == set(TOOL_CALL_PARSERS) - {""}


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_a_whole_answer(parser, text, content, calls):
    shape = ResponseShape(True, "m", tools=ToolPlan(None, parser, NAMES))
    result = wire.GenerationResult(text=text, finish_reason="stop", num_prompt_tokens=2, num_cached_tokens=0,
                                   num_output_tokens=9)
    (choice,) = shape.whole([result])["choices"]
    message = choice["message"]
    assert _calls(message.get("tool_calls") or []) == calls
    assert message["content"] == (text if content is None else content or None)
    assert choice["finish_reason"] == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_a_streamed_answer_reads_the_same_and_sends_plain_text_as_it_comes(parser, text, content, calls, piece):
    shape = ResponseShape(True, "m", tools=ToolPlan(None, parser, NAMES))
    streamed = []
    for at in range(0, len(text), piece):
        chunk = shape.delta(text[at:at + piece], None)
        streamed.append(chunk["choices"][0]["delta"].get("content", "") if chunk else "")
    end = wire.GenerationResult(text="", finish_reason="stop", num_prompt_tokens=2, num_cached_tokens=0,
                                num_output_tokens=9)
    deltas = [c["choices"][0]["delta"] for c in shape.finish_chunks(0, end)]
    sent = "".join(streamed) + "".join(d.get("content", "") for d in deltas)
    assert sent.strip() == (text if content is None else content).strip()
    assert _calls([c for d in deltas for c in d.get("tool_calls", [])]) == calls
    if content is None and not any(c in text[:piece] for c in "<[{"):  # text that cannot start a call flows at once
        assert streamed[0] == text[:piece]


FRAGMENTS = [W, T, LLAMA_W, "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}", "[",
             "]", " ", "\n", "a", ";", '"', ":", "get_weather", '{"city": "Oslo"}', "<tool", "[TOOL",
             f"[{W}]", f"[{W}, {T}]", f"<tool_call>{W}</tool_call>", f"{LLAMA_W}; ", 'get_weather(city="Oslo")',
             "get_time()", ", ", '[get_weather(city="Oslo")]']


@settings(max_examples=500, deadline=None)
@given(parser=st.sampled_from(sorted(CALL_FORMATS)), parts=st.lists(st.sampled_from(FRAGMENTS), max_size=8),
       piece=st.integers(1, 9))
def test_any_text_reads_the_same_whole_or_streamed(parser, parts, piece):
    """Whatever a model writes, reading it never fails, and a stream answers the same calls and,
    but for blanks, the same content as the whole answer."""
    text = "".join(parts)
    end = wire.GenerationResult(text=text, finish_reason="stop", num_prompt_tokens=2, num_cached_tokens=0,
                                num_output_tokens=9)
    (choice,) = ResponseShape(True, "m", tools=ToolPlan(None, parser, NAMES)).whole([end])["choices"]
    shape = ResponseShape(True, "m", tools=ToolPlan(None, parser, NAMES))
    chunks = [shape.delta(text[at:at + piece], None) for at in range(0, len(text), piece)]
    chunks += shape.finish_chunks(0, msgspec.structs.replace(end, text=""))
    deltas = [c["choices"][0]["delta"] for c in chunks if c is not None]
    assert _calls([c for d in deltas for c in d.get("tool_calls", [])]) == _calls(
        choice["message"].get("tool_calls") or [])
    streamed = "".join(d.get("content", "") for d in deltas)
    assert "".join(streamed.split()) == "".join((choice["message"]["content"] or "").split())
