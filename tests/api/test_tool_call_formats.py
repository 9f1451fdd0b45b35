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

NAMES = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                        "detail": {"type": "object"}}},
         "get_time": {"type": "object"}}
OSLO = ("get_weather", {"city": "Oslo"})
TIME = ("get_time", {})
W = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
T = '{"name": "get_time", "arguments": {}}'
LLAMA_W = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'


def _ds(words: str) -> str:
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


DS_CALLS, DS_CALL, DS_SEP, DS_END, DS_CALLS_END = (_ds("tool calls begin"), _ds("tool call begin"), _ds("tool sep"),
                                                   _ds("tool call end"), _ds("tool calls end"))
DS_V3_W = f'{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Oslo"}}\n```{DS_END}'
DS_V31_T = f"{DS_CALL}get_time{DS_SEP}{{}}{DS_END}"
KIMI_W = '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
QWEN_W = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
GLM_W = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>"
KIMI_T = "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"

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
    ("deepseek_v3", f"Let me look.{DS_CALLS}{DS_V3_W}{DS_CALLS_END}", "Let me look.", [OSLO]),
    ("deepseek_v3", f"{DS_CALLS}{DS_V3_W}\n{DS_V31_T}{DS_CALLS_END}", "", [OSLO, TIME]),  # V3's and V3.1's
    ("deepseek_v31", f'{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Oslo"}}{DS_END}{DS_CALLS_END}', "", [OSLO]),
    ("deepseek_v31", f"{DS_V31_T}", "", [TIME]),  # the section's marker missing
    ("deepseek_v3", f"{DS_CALLS}{DS_CALL}launch{DS_SEP}{{}}{DS_END}{DS_CALLS_END}", None, []),
    ("deepseek_v3", f"{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{not json{DS_END}{DS_CALLS_END}", None, []),
    ("deepseek_v3", "a <\uff5ctool", None, []),
    ("kimi_k2", f"Sure.<|tool_calls_section_begin|>{KIMI_W}{KIMI_T}<|tool_calls_section_end|>", "Sure.",
     [OSLO, TIME]),
    ("kimi_k2", f"<|tool_calls_section_begin|>{KIMI_W.replace('get_weather', 'launch')}<|tool_calls_section_end|>",
     None, []),
    ("kimi_k2", "<|tool_calls_sec", None, []),
    ("granite", f"<|tool_call|>[{W}, {T}]", "", [OSLO, TIME]),
    ("granite", f"I will check. <|tool_call|>[{W}]", "I will check.", [OSLO]),
    ("granite", "<|tool_call|>[1, 2]", None, []),
    ("internlm", f'Checking.<|action_start|><|plugin|>\n{LLAMA_W}<|action_end|>', "Checking.", [OSLO]),
    ("internlm", "<|action_start|><|plugin|>{}<|action_end|>", None, []),
    ("phi4_mini_json", f"functools[{W}, {T}]", "", [OSLO, TIME]),
    ("phi4_mini_json", "import functools is how you start", None, []),
    ("qwen3_coder", f"Let me check.\n{QWEN_W}", "Let me check.", [OSLO]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n"
                    "</parameter>\n<parameter=detail>\n{'wind': True}\n</parameter>\n</function>\n</tool_call>", "",
     [("get_weather", {"city": "42", "days": 3, "detail": {"wind": True}})]),  # typed by the tool's schema
    ("qwen3_coder", "<tool_call><function=get_time></function></tool_call>", "", [TIME]),
    ("qwen3_coder", QWEN_W.replace("get_weather", "launch"), None, []),
    ("qwen3_coder", "<tool_call>just text</tool_call>", None, []),
    ("glm45", f"{GLM_W}", "", [OSLO]),
    ("glm45", "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>detail</arg_key>"
              '\n<arg_value>{"wind": true}</arg_value>\n</tool_call>', "",
     [("get_weather", {"days": 2, "detail": {"wind": True}})]),
    ("glm45", "<tool_call>launch\n</tool_call>", None, []),
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
    assert sent == (text if content is None else content)  # exactly the unstreamed answer's content
    assert _calls([c for d in deltas for c in d.get("tool_calls", [])]) == calls
    if content is None and not any(c in text[:piece] for c in "<[{"):  # text that cannot start a call flows at once
        assert streamed[0] == text[:piece].rstrip()  # but for whitespace, which waits for what follows it


FRAGMENTS = [W, T, LLAMA_W, "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}", "[",
             "]", " ", "\n", "a", ";", '"', ":", "get_weather", '{"city": "Oslo"}', "<tool", "[TOOL",
             f"[{W}]", f"[{W}, {T}]", f"<tool_call>{W}</tool_call>", f"{LLAMA_W}; ", 'get_weather(city="Oslo")',
             "get_time()", ", ", '[get_weather(city="Oslo")]', DS_CALLS, DS_CALL, DS_SEP, DS_END, DS_CALLS_END,
             DS_V3_W, DS_V31_T, "function", "```json", "```", KIMI_W, KIMI_T, "<|tool_calls_section_begin|>",
             "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call|>", "<|action_start|><|plugin|>",
             "<|action_end|>", "functools", "<|", QWEN_W, GLM_W, "<function=get_weather>", "<parameter=city>",
             "</parameter>", "</function>", "<arg_key>city</arg_key>", "<arg_value>Oslo</arg_value>", "Oslo"]


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


@pytest.mark.parametrize(("parser", "reads"), [("hermes", False), ("deepseek_v3", True), ("kimi_k2", True),
                                               ("granite", True), ("phi4_mini_json", False)])
def test_formats_whose_markers_are_special_tokens_keep_them_in_the_text(parser, reads):
    from sluice.api.completion_params import ChatRequest, to_payloads

    info = wire.ModelInfo("m", "1", "generative", "p", (), (), 32, 60.0, True, False, max_model_len=512,
                          tool_call_parser=parser)
    request = msgspec.json.decode(msgspec.json.encode({
        "model": "m", "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}),
        type=ChatRequest)
    [payload] = to_payloads(request, info)
    assert payload.skip_special_tokens is not reads
