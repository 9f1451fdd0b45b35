"""Structured outputs: a random-weight model, sampling freely, still writes only what its grammar
allows (JSON that fits the schema, a regular expression's match, one of the choices), batched with
unconstrained requests that it leaves untouched, and through preemptions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sluice import wire
from sluice.engines.generative import EngineConfig, LLMEngine, SamplingParams
from sluice.engines.generative.tiny import make_tiny_lm
from tests.engines.generative.conftest import run_to_completion

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["color", "count", "ok", "name"],
    "additionalProperties": False,
}


def fits_schema(value: object) -> bool:
    return (isinstance(value, dict) and set(value) == {"color", "count", "ok", "name"}
            and value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
            and type(value["count"]) is int and 0 <= value["count"] <= 99
            and isinstance(value["name"], str) and len(value["name"]) <= 6)


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_lm(tmp_path_factory.mktemp("tiny-lm"))


def _engine(model_dir: Path, **config: int) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(block_size=8, **({"num_kv_blocks": 256} | config)))


def _text(engine: LLMEngine, tokens: list[int]) -> str:
    assert engine.tokenizer is not None
    return engine.tokenizer.decode(tokens)


def _format(kind: str, spec: object = "") -> wire.OutputFormat:
    return wire.OutputFormat(kind, spec if isinstance(spec, str) else json.dumps(spec))


def _sampled(max_tokens: int = 120, seed: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)


def test_sampled_json_fits_its_schema_beside_unconstrained_requests(tiny_lm):
    engine = _engine(tiny_lm)
    assert engine.tokenizer is not None and engine.grammars is not None
    prompt = engine.tokenizer.encode("Describe the thing as JSON:")
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("alone", prompt, plain)
    alone = run_to_completion(engine)["alone"]

    engine.add_request("plain", prompt, plain)
    for seed in range(6):
        engine.add_request(f"json{seed}", prompt, _sampled(seed=seed), matcher=engine.grammars.matcher(
            _format("json_schema", SCHEMA)))
    engine.add_request("object", prompt, _sampled(seed=9), matcher=engine.grammars.matcher(_format("json_object")))
    outputs = run_to_completion(engine)

    assert outputs["plain"] == alone  # its neighbours' grammars did not touch its logits
    values = [json.loads(_text(engine, outputs[f"json{seed}"])) for seed in range(6)]
    assert all(fits_schema(value) for value in values), values
    assert len({json.dumps(v, sort_keys=True) for v in values}) > 1  # sampled, not one forced answer
    assert _text(engine, outputs["object"]).startswith('{"')  # any object: random weights may not close it in time


def test_regex_and_choices_are_matched_whole_and_end_the_sequence(tiny_lm):
    engine = _engine(tiny_lm)
    assert engine.grammars is not None
    for seed in range(4):
        engine.add_request(f"regex{seed}", [5, 6, 7], _sampled(seed=seed),
                           matcher=engine.grammars.matcher(_format("regex", r"[a-z]{3}-[0-9]{2}")))
        engine.add_request(f"choice{seed}", [5, 6, 7], _sampled(seed=seed),
                           matcher=engine.grammars.matcher(_format("choice", ["yes", "no", "maybe later"])))
    tokens: dict[str, list[int]] = {}
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.is_finished:
                reasons[out.request_id] = out.finish_reason
    assert set(reasons.values()) == {"stop"} and len(reasons) == 8  # the grammar's end, not max_tokens
    for seed in range(4):
        assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", _text(engine, tokens[f"regex{seed}"]))
        assert _text(engine, tokens[f"choice{seed}"]) in ("yes", "no", "maybe later")


def test_grammar_state_survives_preemption(tiny_lm):
    """A cache of 24 blocks of 8 tokens cannot hold eight sequences of ~60 tokens: sequences are
    preempted and recomputed, and each still ends as JSON that fits the schema."""
    engine = _engine(tiny_lm, num_kv_blocks=24)
    assert engine.tokenizer is not None and engine.grammars is not None
    prompt = engine.tokenizer.encode("A record, please:")
    for seed in range(8):
        engine.add_request(f"json{seed}", prompt, _sampled(seed=seed),
                           matcher=engine.grammars.matcher(_format("json_schema", SCHEMA)))
    outputs = run_to_completion(engine)
    assert engine.stats().num_preemptions_total > 0
    assert all(fits_schema(json.loads(_text(engine, outputs[f"json{seed}"]))) for seed in range(8))


@pytest.mark.parametrize(("output_format", "words"), [
    (wire.OutputFormat("json_schema", '{"type": "strng"}'), "strng"),
    (wire.OutputFormat("json_schema", "not json"), "json schema"),
    (wire.OutputFormat("regex", "[a-z"), "regex"),
    (wire.OutputFormat("grammar", "start: (("), "grammar"),
])
def test_unusable_formats_are_refused_with_the_reason(tiny_lm, output_format, words):
    engine = _engine(tiny_lm)
    assert engine.grammars is not None
    with pytest.raises(ValueError, match=words):
        engine.grammars.matcher(output_format)


def test_min_tokens_cannot_hold_back_a_grammar_that_ends(tiny_lm):
    engine = _engine(tiny_lm)
    assert engine.grammars is not None
    with pytest.raises(ValueError, match="min_tokens"):
        engine.add_request("r", [5, 6], SamplingParams(max_tokens=20, min_tokens=5),
                           matcher=engine.grammars.matcher(_format("json_object")))


def test_object_schemas_that_say_nothing_of_other_keys_are_closed(tiny_lm):
    """As OpenAI's strict mode and vLLM do: `{"properties": {"a": ...}}` admits no other key
    (JSON Schema would admit any, and a sampling model writes some); `additionalProperties: true`
    opens it again. Nested objects too, wherever a schema can stand."""
    engine = _engine(tiny_lm)
    assert engine.grammars is not None and engine.tokenizer is not None

    def accepts(schema: dict, text: str) -> bool:
        ids = engine.tokenizer.encode(text)
        return engine.grammars.matcher(_format("json_schema", schema)).validate_tokens(ids) == len(ids)

    point = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert accepts(point, '{"a": 1}') and not accepts(point, '{"a": 1, "b": 2}')
    assert accepts({**point, "additionalProperties": True}, '{"a": 1, "b": 2}')
    nested = {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/p"}]}, "$defs": {"p": point}}
    assert accepts(nested, '[{"a": 1}]') and not accepts(nested, '[{"a": 1, "z": 0}]')
    named = {"type": "object", "properties": {"properties": point}}  # a property called "properties"
    assert accepts(named, '{"properties": {"a": 3}}') and not accepts(named, '{"properties": {"a": 3}, "x": 1}')


@pytest.mark.parametrize("reasoning", ["deepseek_r1", "qwen3"])
def test_a_reasoning_model_may_think_before_a_json_answer_held_to_its_format(tiny_lm, reasoning):
    """Thoughts are free text up to `</think>` (a deepseek_r1 model starts in them, a qwen3 model
    opens them or answers at once); the answer after them is held to the schema. A regular
    expression holds the whole output, as the client wrote it."""
    engine = _engine(tiny_lm)
    assert engine.tokenizer is not None and engine.grammars is not None

    def accepts(output_format: wire.OutputFormat, text: str) -> bool:
        matcher = engine.grammars.matcher(output_format, reasoning)  # type: ignore[union-attr]
        tokens = engine.tokenizer.encode(text, add_special_tokens=False)  # type: ignore[union-attr]
        return all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting()

    schema = _format("json_schema", SCHEMA)
    answer = json.dumps({"color": "red", "count": 3, "ok": True, "name": "x"})
    assert accepts(schema, f"<think>Red? {{maybe}} </thin</think>{answer}")
    assert accepts(schema, f"weighing it</think>{answer}") == (reasoning == "deepseek_r1")
    assert accepts(schema, answer) == (reasoning == "qwen3")
    assert not accepts(schema, '<think>hmm</think>{"color": "pink"')
    assert not accepts(schema, f"<think>hmm</think>\n\n{answer}")  # the answer is the format's alone
    assert accepts(_format("json_object"), '<think>hmm</think>{"a": 1}')
    assert accepts(_format("regex", "<think>[a-z]+</think>(Yes|No)"), "<think>hmm</think>No")
    assert not accepts(_format("regex", "Yes|No"), "<think>hmm</think>No")
