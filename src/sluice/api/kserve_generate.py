"""KServe v2 infer on a generative model, in the shape Triton's vLLM and TensorRT-LLM backends
serve it: a BYTES `text_input` (one prompt per element) in, a BYTES `text_output` (each prompt's
generated text) out, as the model's metadata (`GET /v2/models/{name}`) declares.

    {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": ["Hi", "Hello"]}],
     "parameters": {"max_tokens": 16, "temperature": 0}}

Sampling comes from the request's `parameters` (KServe's place for them) and, as the vLLM
backend takes it, from an optional BYTES `sampling_parameters` input holding a JSON object; the
names are the completions API's (`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop`,
...), checked the same way. Each prompt is one generation, run like a `/v1/completions` request
of several prompts (one request to the tenant's limits). The answer is whole: a stream needs
`/v1/completions` with `stream: true`. The same over gRPC (`ModelInfer`, `ModelStreamInfer`),
where each request's answer is whole too."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from sluice import wire
from sluice.api.completion_params import CompletionRequest, to_payloads
from sluice.api.completions import generations, whole_generations
from sluice.api.tensors import Tensor, texts_of
from sluice.errors import InvalidInput
from sluice.gateway import Caller, Gateway

GENERATIVE_KINDS = frozenset({"generative", "openai-upstream"})
TEXT_INPUT, SAMPLING_INPUT, TEXT_OUTPUT = "text_input", "sampling_parameters", "text_output"
SAMPLING_NAMES = frozenset({"max_tokens", "temperature", "top_p", "min_p", "top_k", "min_tokens", "seed", "stop",
                            "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                            "repetition_penalty", "presence_penalty", "frequency_penalty"})
"""The completions API's fields an infer request may set; the other parameters (`timeout`,
`priority`, ...) are KServe's own."""


def text_payloads(info: wire.ModelInfo, tensors: list[Tensor],
                  parameters: dict[str, Any]) -> list[wire.GeneratePayload]:
    """An infer request's generations on generative model `info`, one per prompt, checked."""
    return to_payloads(_completion_request(info, tensors, parameters), info)


async def generate_text(gateway: Gateway, who: Caller, info: wire.ModelInfo,
                        payloads: list[wire.GeneratePayload], timeout_s: float | None,
                        arrived_at: float) -> tuple[wire.TensorsPayload, dict[str, str] | None]:
    """The answer to `text_payloads`, over HTTP or gRPC: its `text_output`, and the headers (or
    trailing metadata) of the answer."""
    results = await whole_generations(generations(gateway, who, info, payloads, timeout_s, arrived_at))
    texts = [r.payload.text.encode() for r in results if isinstance(r.payload, wire.GenerationResult)]
    output = wire.NamedTensor(TEXT_OUTPUT, "BYTES", (len(texts),), wire.encode_bytes_elements(texts))
    return wire.TensorsPayload([output]), results[0].headers


def _completion_request(info: wire.ModelInfo, tensors: list[Tensor], parameters: dict[str, Any]) -> CompletionRequest:
    by_name = {tensor.name: tensor for tensor in tensors}
    unknown = sorted(set(by_name) - {TEXT_INPUT, SAMPLING_INPUT})
    if TEXT_INPUT not in by_name or unknown or len(by_name) != len(tensors):
        raise InvalidInput(f"model {info.name} takes a BYTES input named {TEXT_INPUT!r} (and optionally "
                           f"{SAMPLING_INPUT!r}), got {[t.name for t in tensors]}")
    prompts = texts_of(by_name[TEXT_INPUT])
    if not prompts:
        raise InvalidInput(f"input {TEXT_INPUT!r} holds no prompt")
    fields = {name: value for name, value in parameters.items() if name in SAMPLING_NAMES}
    if SAMPLING_INPUT in by_name:
        given = texts_of(by_name[SAMPLING_INPUT])
        try:
            sampling = json.loads(given[0]) if len(given) == 1 else None
        except ValueError:
            sampling = None
        if not isinstance(sampling, dict):
            raise InvalidInput(f"input {SAMPLING_INPUT!r} must hold one JSON object")
        fields.update(sampling)
    try:
        return msgspec.convert({**fields, "model": info.name, "prompt": prompts}, CompletionRequest)
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"sampling parameters: {exc}") from exc
