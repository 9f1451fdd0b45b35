"""Structured outputs: the tokens a sequence may sample next are those its grammar allows.

    wire.OutputFormat ──grammar_of()──▶ llguidance grammar ──Grammars.matcher()──▶ LLMatcher per sequence
    each step: matcher ──masks()──▶ allowed-token bitmask ──Sampler──▶ -inf for every other token
               sampled token ──matcher.consume_token()──▶ next state; finished when the grammar is

The grammars (JSON schemas, regular expressions, choices, Lark grammars) are compiled and
matched by `llguidance` (the library vLLM and SGLang use for the same), against this model's own
tokenizer: every token's bytes are checked against the grammar, so a constrained sequence can
only produce text the grammar accepts. A JSON schema is compiled without free whitespace (items
separated by ", ", keys by ": "): a weak model cannot then spend its tokens on blank space.

A reasoning model (its `reasoning_parser`, `sluice.reasoning`) may think before a JSON answer (a
JSON schema or object, tool calls asked for): its grammar then frees the text up to `</think>`
(which a deepseek_r1 model's output starts in, and a qwen3 model's opens with `<think>` if it
thinks at all), and holds what follows it to the format. A regular expression, choice or grammar
holds the whole output, thoughts included, as the client wrote it.

An object schema that lists its `properties` but says nothing of `additionalProperties` is read
as closed (no other keys), as OpenAI's strict structured outputs require and vLLM's backends do
by default: JSON Schema would allow any other key, and a sampling model then writes some. Say
`"additionalProperties": true` to allow them.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy as llnumpy
import numpy as np

from sluice import wire

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["Grammars", "grammar_of", "masks"]

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How JSON is laid out: compact but readable, as Python's `json.dumps` does."""


def grammar_of(output_format: wire.OutputFormat, reasoning: str = "") -> str:
    """The llguidance grammar for a requested format (after a reasoning model's thoughts, for a
    JSON answer: `with_thoughts`); ValueError if the format is unusable."""
    grammar = _grammar_of(output_format)
    return with_thoughts(grammar, reasoning) if reasoning and output_format.is_json else grammar


def with_thoughts(grammar: str, reasoning: str) -> str:
    """`grammar` after thoughts as a `reasoning` model writes them: free text up to `</think>`
    (llguidance's lazy lexeme with a stop string), then at once the grammar (the answer is the
    format's alone, with no blank lines before it)."""
    inner = json.loads(grammar)["grammars"]
    inner[0]["name"] = "answer"
    start = "thoughts @answer" if reasoning == "deepseek_r1" else '@answer | "<think>" thoughts @answer'
    lark = f'start: {start}\nthoughts[stop="</think>"]: /(?s:.*)/\n'
    return json.dumps({"grammars": [{"lark_grammar": lark}, *inner]})


def _grammar_of(output_format: wire.OutputFormat) -> str:
    kind, spec = output_format.kind, output_format.spec
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(closed(json.loads(spec)), defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", spec)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ValueError(f"unusable {kind.replace('_', ' ')}: {exc}") from exc
    raise ValueError(f"unknown structured output kind {kind!r}")


_SUBSCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "unevaluatedItems",
              "unevaluatedProperties", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """`schema` with every object schema that has `properties` (or `patternProperties`) and no
    `additionalProperties` closed to other keys. Only schema positions are visited, so a property
    that happens to be named "properties" is left alone."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if isinstance(out.get("items"), list):  # the older tuple form
        out["items"] = [closed(item) for item in out["items"]]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(item) for item in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class Grammars:
    """Compiles grammars against one model's tokenizer (built once, on first use; thread-safe)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def matcher(self, output_format: wire.OutputFormat, reasoning: str = "") -> llguidance.LLMatcher:
        """A fresh matcher for one sequence (of a model with this `reasoning_parser`: `grammar_of`);
        ValueError naming what is wrong with the format."""
        grammar = grammar_of(output_format, reasoning)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"unusable {output_format.kind.replace('_', ' ')}: {matcher.get_error()}")
        return matcher

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                eos = self._eos_token_ids or None
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self._vocab_size, eos_token=eos)
            return self._tokenizer


def masks(matchers: list[llguidance.LLMatcher], vocab_size: int) -> np.ndarray:
    """Each matcher's allowed next tokens as bits: int32 [len(matchers), ceil(vocab_size / 32)],
    token t allowed when bit t % 32 of word t // 32 is set (a thirty-second of a bool array's
    size to send to the device, where the sampler unpacks it)."""
    packed = llnumpy.allocate_token_bitmask(len(matchers), vocab_size)
    for i, matcher in enumerate(matchers):
        llnumpy.fill_next_token_bitmask(matcher, packed, i)
    return packed
