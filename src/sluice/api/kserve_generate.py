"""KServe v2 infer on a generative model, in the shape Triton's vLLM and TensorRT-LLM backends
serve it: a BYTES `text_input` (one prompt per element) in, a BYTES `text_output` (each prompt's
generated text) out, as the model's metadata (`GET /v2/models/{name}`) declares.

    {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": ["Hi", "Hello"]}],
     "parameters": {"max_tokens": 16, "temperature": 0}}

Sampling comes from the request's `parameters` (KServe's place for them) and, as the vLLM
backend takes it, from an optional BYTES `sampling_parameters` input holding a JSON object; the
names are the completions API's (`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop`,
...), checked the same way, a number given as a string (as the vLLM backend's own client sends
them) read as the number. The backends' optional BOOL inputs are taken too, or the parameters of
the same names: `exclude_input_in_output` (as those backends answer, a whole answer's
`text_output` starts with the prompt unless it is true) and `stream`. Each prompt is one
generation, run like a `/v1/completions` request of several prompts (one request to the tenant's
limits). `stream: true` asks for the text as it is made, one response per chunk, which a stream
can carry: gRPC `ModelStreamInfer` (`api.kserve_grpc`) and Triton's generate extension
(`api.triton_generate`); HTTP infer and gRPC `ModelInfer` answer once, and refuse it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import msgspec

from sluice import wire
from sluice.api.completion_params import CompletionRequest, to_payloads
from sluice.api.completions import generations, whole_generations
from sluice.api.tensors import Tensor, check_input, texts_of
from sluice.errors import InvalidInput
from sluice.gateway import Caller, Gateway, InferResult

GENERATIVE_KINDS = frozenset({"generative", "openai-upstream"})
TEXT_INPUT, SAMPLING_INPUT, TEXT_OUTPUT = "text_input", "sampling_parameters", "text_output"
STREAM, EXCLUDE_INPUT = "stream", "exclude_input_in_output"
SAMPLING_NAMES = frozenset({"max_tokens", "temperature", "top_p", "min_p", "top_k", "min_tokens", "seed", "stop",
                            "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                            "repetition_penalty", "presence_penalty", "frequency_penalty"})
"""The completions API's fields an infer request may set; the other parameters (`timeout`,
`priority`, ...) are KServe's own."""


@dataclass(frozen=True, slots=True)
class TextRequest:
    """An infer (or generate) request's generations on a generative model, checked."""

    payloads: list[wire.GeneratePayload]
    prompts: list[str]
    is_stream: bool
    """The text as it is made, one answer per chunk (one prompt only)."""
    with_prompt: bool
    """A whole answer's text starts with its prompt (the backends' `exclude_input_in_output: false`)."""


def text_request(info: wire.ModelInfo, tensors: list[Tensor], parameters: dict[str, Any], *,
                 stream_route: str | None) -> TextRequest:
    """An infer request's generations on generative model `info`, one per prompt, checked.
    `stream_route`: None where answers can be streamed; else where to go for a stream (the 400's hint)."""
    by_name = {tensor.name: tensor for tensor in tensors}
    unknown = sorted(set(by_name) - {TEXT_INPUT, SAMPLING_INPUT, STREAM, EXCLUDE_INPUT})
    if TEXT_INPUT not in by_name or unknown or len(by_name) != len(tensors):
        raise InvalidInput(f"model {info.name} takes a BYTES input named {TEXT_INPUT!r} (and optionally "
                           f"{SAMPLING_INPUT!r}, {STREAM!r} and {EXCLUDE_INPUT!r}), got {[t.name for t in tensors]}")
    declared = next((spec for spec in info.inputs if spec.name == TEXT_INPUT), None)
    if declared is not None:  # one prompt per element, as the metadata says: [n] (or [n, 1]), not [2, 2]
        check_input(by_name[TEXT_INPUT], declared)
    fields = {name: value for name, value in parameters.items() if name in SAMPLING_NAMES}
    if SAMPLING_INPUT in by_name:
        given = texts_of(by_name[SAMPLING_INPUT])
        fields.update(sampling_object(given[0] if len(given) == 1 else None))
    flags = {name: _bool_input(by_name[name]) if name in by_name else flag(parameters, name)
             for name in (STREAM, EXCLUDE_INPUT)}
    return build_text_request(info, texts_of(by_name[TEXT_INPUT]), fields, is_stream=flags[STREAM] or False,
                              exclude_input=flags[EXCLUDE_INPUT] or False, stream_route=stream_route)


def sampling_object(raw: Any) -> dict[str, Any]:
    """The `sampling_parameters` input's JSON object (`raw`: its one element's text)."""
    try:
        sampling = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        sampling = None
    if isinstance(raw, dict):  # the generate extension's JSON invites it; Triton's input is BYTES
        raise InvalidInput(f"{SAMPLING_INPUT!r} must be one JSON object as a string (the backends' BYTES input: "
                           f"\"sampling_parameters\": \"{{\\\"max_tokens\\\": 16}}\"), not an object; or give "
                           "its fields in 'parameters'", param=SAMPLING_INPUT)
    if not isinstance(sampling, dict):
        raise InvalidInput(f"input {SAMPLING_INPUT!r} must hold one JSON object", param=SAMPLING_INPUT)
    return sampling


def build_text_request(info: wire.ModelInfo, prompts: list[str], fields: dict[str, Any], *, is_stream: bool,
                       exclude_input: bool, stream_route: str | None) -> TextRequest:
    """The generations of `prompts` with sampling `fields` (the completions API's names)."""
    if not prompts:
        raise InvalidInput(f"input {TEXT_INPUT!r} holds no prompt")
    if "" in prompts:  # named as the client knows it (the completions API would say 'prompt')
        raise InvalidInput(f"{TEXT_INPUT!r} must not be empty", param=TEXT_INPUT)
    if is_stream and stream_route is not None:
        raise InvalidInput(f"'stream': true needs a stream of answers: {stream_route}", param=STREAM)
    if is_stream and len(prompts) != 1:
        raise InvalidInput(f"a streamed generation takes one prompt, got {len(prompts)}", param=TEXT_INPUT)
    try:  # not strict: the vLLM backend's own client sends numbers as strings
        request = msgspec.convert({**fields, "model": info.name, "prompt": prompts, "stream": is_stream},
                                  CompletionRequest, strict=False)
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"sampling parameters: {exc}") from exc
    return TextRequest(to_payloads(request, info), prompts, is_stream, with_prompt=not is_stream and not exclude_input)


async def generate_text(gateway: Gateway, who: Caller, info: wire.ModelInfo, request: TextRequest,
                        timeout_s: float | None, arrived_at: float) -> tuple[list[str], dict[str, str] | None]:
    """The whole answer to `request`, over HTTP or gRPC: each prompt's text (`text_output`
    makes it a tensor), and the headers (or trailing metadata) of the answer."""
    results = await whole_generations(generations(gateway, who, info, request.payloads, timeout_s, arrived_at))
    texts = [(prompt if request.with_prompt else "") + result.payload.text
             for prompt, result in zip(request.prompts, results, strict=True)
             if isinstance(result.payload, wire.GenerationResult)]
    return texts, results[0].headers


@dataclass(frozen=True, slots=True)
class TextChunk:
    """A streamed generation's new text."""

    text: str
    is_last: bool
    """The generation's last chunk (its text may be empty): Triton marks that answer final. False
    throughout where the worker cannot tell (an upstream server's stream): the stream's end says it."""


async def stream_text(gateway: Gateway, who: Caller, info: wire.ModelInfo, request: TextRequest,
                      timeout_s: float | None, arrived_at: float,
                      limit_headers: dict[str, str] | None = None) -> AsyncGenerator[TextChunk, None]:
    """A streamed request's new text, chunk by chunk; closing it early withdraws the generation.
    `limit_headers`, if given, receives the tenant's `x-ratelimit-*` headers once admitted."""
    (events,) = generations(gateway, who, info, request.payloads, timeout_s, arrived_at, limit_headers)
    try:
        async for event in events:
            if isinstance(event, InferResult):
                return
            if event.text or event.is_last:
                yield TextChunk(event.text, event.is_last)
        raise RuntimeError("a generation ended without a result")
    finally:
        await events.aclose()


def text_output(texts: list[str]) -> wire.TensorsPayload:
    """Answers as the `text_output` tensor."""
    encoded = [text.encode() for text in texts]
    return wire.TensorsPayload([wire.NamedTensor(TEXT_OUTPUT, "BYTES", (len(encoded),),
                                                 wire.encode_bytes_elements(encoded))])


def _bool_input(tensor: Tensor) -> bool:
    values = tensor.values
    if tensor.datatype != "BOOL" or isinstance(values, list) or values.size != 1:
        raise InvalidInput(f"input {tensor.name!r} must be one BOOL, got {tensor.datatype} of shape "
                           f"{list(tensor.shape)}", param=tensor.name)
    return bool(values.flat[0])


def flag(given: dict[str, Any], name: str) -> bool | None:
    """A boolean field of `given` (None if absent); a 400 naming it if it is not true or false."""
    value = given.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidInput(f"{name!r} must be true or false", param=name)
    return value
