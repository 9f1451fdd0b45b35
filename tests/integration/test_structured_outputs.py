"""Structured outputs through the real `openai` SDK against a random-weight model: whatever the
weights, the answer is JSON that fits the schema (the SDK's own `parse()` reads it into a pydantic
model), a regular expression's match, or one of the choices; unary and streamed, n choices; and
formats that cannot be used are 400s naming the field."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99},
                   "ok": {"type": "boolean"}},
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe the thing."}]


class Thing(BaseModel):
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)
    ok: bool
    label: str = Field(max_length=6)


def _fits(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"color", "count", "ok"} and value["color"] in ("red", "green", "blue")
            and type(value["count"]) is int and 0 <= value["count"] <= 99 and isinstance(value["ok"], bool))


def test_the_sdks_parse_reads_a_pydantic_model_from_the_answer(tiny_lm_client):
    for seed in range(3):
        completion = tiny_lm_client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Thing,
                                                           max_tokens=200, seed=seed)
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Thing), message.content
        assert Thing.model_validate_json(message.content) == message.parsed


def test_json_schema_unary_streamed_and_n_choices(tiny_lm_client):
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    unary = tiny_lm_client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=response_format,
                                                   max_tokens=100, seed=1, n=3)
    texts = [choice.message.content for choice in unary.choices]
    assert len(texts) == 3 and all(_fits(text) for text in texts), texts
    chunks = tiny_lm_client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=response_format,
                                                    max_tokens=100, seed=2, stream=True)
    assert _fits("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    anything = tiny_lm_client.completions.create(model="tiny", prompt="JSON:", max_tokens=100, seed=3,
                                                 extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                                     "name": "thing", "schema": SCHEMA}}})
    assert _fits(anything.choices[0].text)


def test_vllms_guided_fields_regex_and_choice(tiny_lm_client):
    regex = tiny_lm_client.completions.create(model="tiny", prompt="Code:", max_tokens=30, seed=4,
                                              extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", regex.choices[0].text) and regex.choices[0].finish_reason == "stop"
    for body in ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        answer = tiny_lm_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, seed=5,
                                                        extra_body=body)
        assert answer.choices[0].message.content in ("yes", "no")
    guided = tiny_lm_client.completions.create(model="tiny", prompt="x", max_tokens=100, seed=6,
                                               extra_body={"guided_json": SCHEMA})
    assert _fits(guided.choices[0].text)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "strng"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_regex": "[a-z"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ({"guided_regex": "a{1000000}"}, "guided_regex"),  # compiles; too complex to follow once it runs
])
def test_unusable_formats_are_400_naming_the_field(tiny_lm_client, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_lm_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, extra_body=body)
    assert caught.value.body["param"] == param, caught.value.body


def test_a_format_too_complex_to_follow_mid_stream_is_an_error_event_naming_the_field(tiny_lm_client):
    """llguidance builds a regex's lexer lazily: `(ab )+a{1000000}` runs until the sampled text
    reaches the counted part. The client's format, not the device, is at fault: the stream ends
    with an error event naming the field, not a "try again" server error."""
    stream = tiny_lm_client.completions.create(model="tiny", prompt="x", max_tokens=40, seed=1, stream=True,
                                               extra_body={"guided_regex": "(ab )+a{1000000}"})
    texts = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert "".join(texts).startswith("ab "), texts  # streamed before the format proved unusable
    assert caught.value.body["param"] == "guided_regex", caught.value.body
    assert caught.value.body["type"] == "invalid_request_error", caught.value.body
