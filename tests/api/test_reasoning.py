"""A reasoning model's thoughts read apart from its answer (`sluice.reasoning`), whole and streamed."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice import wire
from sluice.api.completion_params import messages_of
from sluice.api.completion_shapes import ResponseShape
from sluice.api.responses import ResponsesRequest, ResponsesShape, chat_request_of
from sluice.errors import InvalidInput
from sluice.reasoning import PARSERS, ReasoningSplitter, ThoughtTokens, request_parser, split_reasoning


@pytest.mark.parametrize(("parser", "text", "expected"), [
    ("qwen3", "<think>\nweigh it\n</think>\n\nYes.", ("\nweigh it\n", "\n\nYes.")),
    ("qwen3", "Yes, at once.", (None, "Yes, at once.")),  # enable_thinking: false
    ("qwen3", "<think>cut while thinki", ("cut while thinki", "")),
    ("qwen3", "<thin", (None, "<thin")),  # a tag's start, never finished: the answer's text
    ("qwen3", "2 < 3 </think> is not a tag here", (None, "2 < 3 </think> is not a tag here")),
    ("deepseek_r1", "weigh it</think>Yes.", ("weigh it", "Yes.")),  # the template opened the thoughts
    ("deepseek_r1", "<think>weigh it</think>Yes.", ("weigh it", "Yes.")),
    ("deepseek_r1", "cut while thinking </thi", ("cut while thinking </thi", "")),
    ("deepseek_r1", "</think>Yes.", (None, "Yes.")),
    ("deepseek_r1", "", (None, "")),
])
def test_whole_outputs(parser: str, text: str, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(parser, text) == expected


@given(parser=st.sampled_from(PARSERS),
       pieces=st.lists(st.sampled_from(["<", "<think>", "</think>", "</", "think", ">", "a", " ", "\n", "é", "<t",
                                        "k>", "</th"]), max_size=12),
       cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=6))
def test_a_stream_cut_anywhere_joins_into_the_whole_answer(parser: str, pieces: list[str], cuts: list[int]) -> None:
    """However the output arrives (a tag split over chunks, several tags in one), the thoughts and
    answer streamed join into exactly the whole output's, and together they lose nothing but the tags."""
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    splitter = ReasoningSplitter(parser)
    thoughts, answers = [], []
    for start, end in itertools.pairwise(bounds):
        thought, answer = splitter.feed(text[start:end])
        thoughts.append(thought)
        answers.append(answer)
    thought, answer = splitter.finish()
    whole = split_reasoning(parser, text)
    assert ("".join([*thoughts, thought]) or None, "".join([*answers, answer])) == whole
    assert len((whole[0] or "") + whole[1]) >= len(text) - len("<think>") - len("</think>")


@pytest.mark.parametrize(("parser", "tokens", "thought"), [
    ("qwen3", ["<think>", "hm", "m", "</think>", "\n\n", "Yes"], 2),  # tags of their own are not thought
    ("qwen3", ["<", "think", ">", "hm", "m", "</", "think", ">", "\n\n", "Yes"], 8),  # spelt out: counted
    ("qwen3", ["<think>hmm</think>Yes", "!"], 1),  # one token that opens and closes them
    ("qwen3", ["<", "Yes"], 0),  # "<" might have opened them: it did not
    ("qwen3", ["Yes", "<think>"], 0),
    ("deepseek_r1", ["hm", "m", "</think>", "Yes"], 2),
    ("deepseek_r1", ["<", "th"], 2),  # cut by max_tokens while thinking
    ("deepseek_r1", ["</think>", "Yes"], 0),
])
def test_the_tokens_a_model_thought_with_are_counted(parser: str, tokens: list[str], thought: int) -> None:
    counter = ThoughtTokens(parser)
    for token in tokens:
        counter.add(token, 1)
    assert counter.finish() == thought


def test_a_json_answer_follows_thoughts_and_any_other_format_is_thought_only_where_tagged() -> None:
    json_answer = wire.OutputFormat("json_schema", '{"type": "object"}')
    def chat(output_format: wire.OutputFormat | None = None) -> wire.GeneratePayload:
        return wire.GeneratePayload(messages=[wire.ChatMessage("user", "hi")], output_format=output_format)

    regex = wire.OutputFormat("regex", "Yes|No")
    assert request_parser("deepseek_r1", chat()) == request_parser("deepseek_r1", chat(json_answer)) == "deepseek_r1"
    assert request_parser("deepseek_r1", chat(regex)) == "qwen3"
    assert split_reasoning(request_parser("deepseek_r1", chat(regex)), "No") == (None, "No")
    assert request_parser("", chat(json_answer)) == ""
    assert request_parser("o7", chat()) == ""  # one a newer worker knows: all answer, never an error
    assert request_parser("deepseek_r1", wire.GeneratePayload(prompt="hi", output_format=json_answer)) == ""


def test_chat_chunks_carry_thoughts_then_content_and_the_whole_message_both() -> None:
    pieces = ["<th", "ink>hm", "m</thi", "nk>\n\nYe", "s", "!"]
    shape = ResponseShape(True, "m", reasoning="qwen3")
    deltas = [shape.delta(p, None) for p in pieces]
    deltas += shape.finish_chunks(0, wire.GenerationResult("", "stop", 3, 0, 6))  # a stream's result has no text
    sent = [chunk["choices"][0]["delta"] for chunk in deltas if chunk is not None]
    assert "".join(d.get("reasoning_content", "") for d in sent) == "hmm"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in sent)
    assert "".join(d.get("content", "") for d in sent) == "\n\nYes!"
    assert deltas[0] is None  # "<th" may be a tag: held back, nothing sent
    whole = ResponseShape(True, "m", reasoning="qwen3").whole([wire.GenerationResult("".join(pieces), "stop", 3, 0, 6)])
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["reasoning"], message["content"]) == ("hmm", "hmm", "\n\nYes!")
    plain = ResponseShape(True, "m").whole([wire.GenerationResult("<think>hmm</think>", "stop", 3, 0, 6)])
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "<think>hmm</think>"}


@pytest.mark.parametrize(("parser", "tokens", "answered"), [
    ("qwen3", ["<", "b", ">", "hi"], ["<", "b", ">", "hi"]),  # held back as a possible tag, then answer
    ("qwen3", ["<think>", "</think>", "x", "y"], ["x", "y"]),  # empty thoughts: their tags are not the answer's
    ("deepseek_r1", ["</think>", "x"], ["x"]),
    ("qwen3", ["<think>", "h", "</think>", "<", "i", ">"], ["<", "i", ">"]),
])
def test_a_responses_message_carries_its_answers_log_probabilities_streamed_or_not(
        parser: str, tokens: list[str], answered: list[str]) -> None:
    request = msgspec.convert({"model": "m", "input": "hi", "include": ["message.output_text.logprobs"]},
                              ResponsesRequest)
    payload = wire.GeneratePayload(messages=[wire.ChatMessage("user", "hi")], logprobs=0)
    logprobs = [wire.TokenLogprob(token, i, -0.5, []) for i, token in enumerate(tokens)]
    result = wire.GenerationResult("".join(tokens), "stop", 1, 0, len(tokens), logprobs)
    whole = ResponsesShape(request, "m", payload, None, reasoning=parser).whole(result)
    streaming = ResponsesShape(request, "m", payload, None, reasoning=parser)
    streaming.start()
    for entry in logprobs:
        streaming.chunk(streaming.chat.delta(entry.token, None, [entry]))
    _, streamed = streaming.finish(wire.GenerationResult("", "stop", 1, 0, len(tokens)))
    for response in (whole, streamed):
        (message,) = [item for item in response["output"] if item["type"] == "message"]
        assert [entry["token"] for entry in message["content"][0]["logprobs"]] == answered


def test_thoughts_passed_back_to_responses_are_the_next_assistant_turns() -> None:
    """A Responses tool loop passes an earlier response's output back (reasoning, function call,
    its output): the thoughts go to the assistant turn after them, as a chat message's `reasoning`
    would, for a template that shows them (Qwen3's, after the last user message)."""
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "Oslo? Ask the tool."}]}
    items = [{"role": "user", "content": "Weather in Oslo?"}, thought,
             {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "12 C"},
             {**thought, "content": [{"type": "reasoning_text", "text": "Rain."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "12 C."}]},
             {"role": "user", "content": "Thanks"}]
    request = msgspec.convert({"model": "m", "input": "x"}, ResponsesRequest)
    messages = messages_of(chat_request_of(request, items).messages)
    assert [(m.role, m.reasoning) for m in messages] == [
        ("user", None), ("assistant", "Oslo? Ask the tool."), ("tool", None), ("assistant", "Rain."), ("user", None)]
    assert messages[1].tool_calls[0].name == "weather" and messages[3].content == "12 C."
    for bad in ({**thought, "content": "Oslo?"}, {**thought, "content": [{"type": "reasoning_text"}]}):
        with pytest.raises(InvalidInput) as refused:
            chat_request_of(request, [bad, {"role": "user", "content": "Hi"}])
        assert refused.value.param == "input"
