"""OpenAI's completion and chat objects built from wire values: n choices, log-probabilities in
each endpoint's shape, an echoed prompt's tokens before the generated ones."""

from __future__ import annotations

import pytest

from sluice import wire
from sluice.api.completion_shapes import ResponseShape
from sluice.api.tool_calls import ToolPlan


def _lp(token: str, value: float, *top: tuple[str, float]) -> wire.TokenLogprob:
    return wire.TokenLogprob(token, 0, value, [wire.TopLogprob(t, 0, v) for t, v in top])


def _result(**fields: object) -> wire.GenerationResult:
    defaults: dict[str, object] = dict(text=" b", finish_reason="length", num_prompt_tokens=2, num_cached_tokens=0,
                                       num_output_tokens=1)
    return wire.GenerationResult(**{**defaults, **fields})  # type: ignore[arg-type]


def test_an_echoed_prompt_comes_first_with_null_for_its_first_token_and_offsets_run_on():
    prompt = wire.EchoedPrompt("Hi a", "Hi", [_lp(" a", -1.0, (" x", -0.5))])
    body = ResponseShape(False, "m", logprobs=1, prompt_texts=["Hi a"]).whole(
        [_result(logprobs=[_lp(" b", -0.2, (" b", -0.2))], prompt=prompt)])
    (choice,) = body["choices"]
    assert choice["text"] == "Hi a b"
    assert choice["logprobs"] == {"tokens": ["Hi", " a", " b"], "token_logprobs": [None, -1.0, -0.2],
                                  "top_logprobs": [None, {" x": -0.5, " a": -1.0}, {" b": -0.2}],
                                  "text_offset": [0, 2, 4]}
    assert body["usage"]["completion_tokens"] == 1


def test_n_chat_choices_each_have_their_index_and_top_logprobs():
    choices = [wire.GeneratedChoice(" c", "stop", [_lp(" c", -0.3, (" c", -0.3), (" d", -2.0))])]
    body = ResponseShape(True, "m", logprobs=2, n=2).whole(
        [_result(logprobs=[_lp(" b", -0.2, (" b", -0.2), (" e", -1.5))], choices=choices)])
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == [" b", " c"]
    second = body["choices"][1]["logprobs"]["content"][0]
    assert second == {"token": " c", "logprob": -0.3, "bytes": [32, 99],
                      "top_logprobs": [{"token": " c", "logprob": -0.3, "bytes": [32, 99]},
                                       {"token": " d", "logprob": -2.0, "bytes": [32, 100]}]}


def test_streamed_offsets_are_kept_per_choice_and_nothing_is_reported_unless_asked():
    shape = ResponseShape(False, "m", logprobs=0, n=2)
    assert shape.delta("ab", None, [_lp("ab", -1.0)], index=1)["choices"][0]["logprobs"]["text_offset"] == [0]
    assert shape.delta("c", None, [_lp("c", -1.0)], index=0)["choices"][0]["logprobs"]["text_offset"] == [0]
    assert shape.delta("d", None, [_lp("d", -1.0)], index=1)["choices"][0]["logprobs"]["text_offset"] == [2]
    plain = ResponseShape(False, "m").delta("x", None, [_lp("x", -1.0)])
    assert plain["choices"][0]["logprobs"] is None


def test_the_tokens_of_a_character_split_over_several_all_start_at_it_echoed_or_streamed():
    """`text_offset` indexes the text: 中's three byte tokens (U+FFFD each, alone) start at 中,
    and what follows at the character after it, not three characters on."""
    def part(byte: int) -> wire.TokenLogprob:
        return wire.TokenLogprob("\ufffd", 0, -1.0, [], bytes([byte]))

    prompt = wire.EchoedPrompt("中a", "\ufffd", [part(0xB8), part(0xAD), _lp("a", -1.0)], bytes([0xE4]))
    body = ResponseShape(False, "m", logprobs=0, prompt_texts=["中a"]).whole(
        [_result(text="文b", logprobs=[part(0xE6), part(0x96), part(0x87), _lp("b", -1.0)], prompt=prompt)])
    (choice,) = body["choices"]
    assert choice["logprobs"]["text_offset"] == [0, 0, 0, 1, 2, 2, 2, 3]
    assert [choice["text"][i] for i in choice["logprobs"]["text_offset"]] == list("中中中a文文文b")
    shape = ResponseShape(False, "m", logprobs=0)
    offsets = [shape.delta(text, None, [lp])["choices"][0]["logprobs"]["text_offset"][0]
               for text, lp in (("", part(0xE6)), ("", part(0x96)), ("文", part(0x87)), ("b", _lp("b", -1.0)))]
    assert offsets == [0, 0, 0, 1]


def test_a_batch_of_prompts_numbers_choices_prompt_by_prompt_and_sums_usage():
    shape = ResponseShape(False, "m", prompt_texts=["a", None], n=2)
    first, second = wire.EchoedPrompt("a", "a"), wire.EchoedPrompt("decoded b", "b")
    body = shape.whole([_result(text="1", choices=[wire.GeneratedChoice("2", "stop")], prompt=first),
                        _result(text="3", choices=[wire.GeneratedChoice("4", "length")], prompt=second,
                                num_prompt_tokens=5, num_output_tokens=2)])
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "a1"), (1, "a2"), (2, "decoded b3"),
                                                                  (3, "decoded b4")]
    assert body["usage"]["prompt_tokens"] == 7 and body["usage"]["completion_tokens"] == 3


def test_the_prompt_tokens_written_to_the_cache_are_summed_and_left_out_where_unknown():
    shape = ResponseShape(False, "m", prompt_texts=[None, None])
    known = shape.whole([_result(num_cache_write_tokens=16), _result(num_cache_write_tokens=32, num_cached_tokens=8)])
    assert known["usage"]["prompt_tokens_details"] == {"cached_tokens": 8, "cache_write_tokens": 48}
    unknown = shape.whole([_result(num_cache_write_tokens=16), _result()])  # an upstream server that did not say
    assert unknown["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


AUTO = ToolPlan(None, "hermes", frozenset({"get_weather"}))
CALLED = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_auto_tool_calls_are_read_from_hermes_blocks_and_the_rest_is_content():
    (choice,) = ResponseShape(True, "m", tools=AUTO).whole([_result(text=CALLED, finish_reason="stop")])["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    unknown = CALLED.replace("get_weather", "launch_rockets")  # not one of the tools: it stays text
    (plain,) = ResponseShape(True, "m", tools=AUTO).whole([_result(text=unknown, finish_reason="stop")])["choices"]
    assert plain["message"] == {"role": "assistant", "content": unknown} and plain["finish_reason"] == "stop"


def test_a_streamed_auto_answer_sends_content_until_a_call_begins_then_the_calls_whole():
    shape = ResponseShape(True, "m", tools=AUTO)
    pieces = ["Let me", " look.\n<to", 'ol_call>\n{"name": "get_', 'weather", "arguments": {"city": "Oslo"}}',
              "\n</tool_call>"]
    chunks = [c for piece in pieces if (c := shape.delta(piece, None)) is not None]
    chunks += shape.finish_chunks(0, _result(text="", finish_reason="stop"))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "Let me look."  # "\n<to" was held back, not sent
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    text_only = ResponseShape(True, "m", tools=AUTO)
    sent = [c for piece in ["a <t", "able>"] if (c := text_only.delta(piece, None)) is not None]
    sent += text_only.finish_chunks(0, _result(text="", finish_reason="stop"))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in sent) == "a <table>"


@pytest.mark.parametrize("pieces", [
    ["Sure. ", "<tool_call>", CALLED[len("Let me look.\n<tool_call>"):]],  # the space alone before the call
    ["Sure. <tool_call>", CALLED[len("Let me look.\n<tool_call>"):]],
    ["\n", " Sure", ". \n", "<tool_c", CALLED[len("Let me look.\n<tool_c"):], "\nDone ", "."],
    ["  ", "<tool_call>", CALLED[len("Let me look.\n<tool_call>"):], "\n"],
    ["Just ", "text, ", "no ", "call. "],
])
def test_a_streamed_auto_answers_content_is_the_unary_answers_exactly(pieces):
    """What streams before a call is the content the unstreamed answer has: the whitespace before
    the call (a space, a newline) is not sent, as the unary answer drops it."""
    (unary,) = ResponseShape(True, "m", tools=AUTO).whole([_result(text="".join(pieces), finish_reason="stop")])[
        "choices"]
    shape = ResponseShape(True, "m", tools=AUTO)
    chunks = [c for piece in pieces if (c := shape.delta(piece, None)) is not None]
    chunks += shape.finish_chunks(0, _result(text="", finish_reason="stop"))
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == (unary["message"]["content"] or "")
    assert chunks[-1]["choices"][0]["finish_reason"] == unary["finish_reason"]


REQUIRED = ToolPlan(None)
CUT = ('[{"name": "get_time", "arguments": {}}, {"name": "get_day", "arguments": {"x": false}}, '
       '{"name": "get_time", "argum')


def test_required_calls_cut_by_max_tokens_keep_those_written_whole_and_never_become_content():
    (choice,) = ResponseShape(True, "m", tools=REQUIRED).whole([_result(text=CUT, finish_reason="length")])["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_time", "arguments": "{}"}, {"name": "get_day", "arguments": '{"x": false}'}]
    (nothing,) = ResponseShape(True, "m", tools=REQUIRED).whole([_result(text='[{"na', finish_reason="length")])[
        "choices"]
    assert nothing["message"] == {"role": "assistant", "content": None}
    streamed = ResponseShape(True, "m", tools=REQUIRED)
    chunks = [c for piece in [CUT[:30], CUT[30:]] if (c := streamed.delta(piece, None)) is not None]
    chunks += streamed.finish_chunks(0, _result(text="", finish_reason="length"))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas)
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_day"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_streamed_token_ids_held_back_with_their_text_go_with_the_choices_next_chunk():
    """`return_token_ids` with required tool calls: the text waits for the end, so do its ids; none is lost."""
    shape = ResponseShape(True, "m", tools=REQUIRED, return_token_ids=True)
    shape.note_prompt_token_ids(0, [7, 8])
    role = shape.role_chunk(0)
    assert role["prompt_token_ids"] == [7, 8] and "token_ids" not in role["choices"][0]
    chunks = []
    for piece, ids in [(CUT[:30], [1, 2]), (CUT[30:], [3])]:
        event = wire.TokenChunk(0, piece, ids)
        shape.add_token_ids(0, event)
        if (chunk := shape.delta(piece, None)) is not None:
            chunks.append(chunk)
    chunks += shape.finish_chunks(0, _result(text="", finish_reason="length"))
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == [1, 2, 3]
    assert not any("prompt_token_ids" in c for c in chunks)  # the role chunk carried them
