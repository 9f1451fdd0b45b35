"""vLLM's tokenizer endpoints for generative models: `POST /tokenize`, `POST /detokenize`,
`GET /tokenizer_info`.

Clients that count or build tokens without the model's files use them: lm-evaluation-harness's
`local-completions` model, asked for no tokenizer of its own, probes `/tokenizer_info` and
`/tokenize` and then tokenizes through the server. The model's tokenizer lives on its workers, so
each call is a request to one of them (admitted for the tenant like any request, answered at once
there, on no device):

    POST /tokenize    {"model"?, "prompt": str | "messages": [...], "add_special_tokens"?, "add_generation_prompt"?}
                      -> {"count", "max_model_len", "tokens"}
    POST /detokenize  {"model"?, "tokens": [int]} -> {"prompt"}
    GET  /tokenizer_info?model=  -> {"eos_token", "bos_token", "chat_template", "model_max_length", ...}

`model` may be left out when the tenant sees exactly one generative model, as clients written
for a one-model server (vLLM) do.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sluice import wire
from sluice.api.common import caller, decode_json, read_body, request_tenant, resolve_openai, with_version
from sluice.api.completion_params import ChatMessageIn, messages_of, template_options
from sluice.errors import InvalidInput
from sluice.gateway import Gateway

__all__ = ["routes"]

MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


def routes(gateway: Gateway, body_limit_bytes: int) -> list[Route]:
    async def tokenize(request: Request) -> Response:
        parsed = decode_json(await read_body(request, body_limit_bytes), TokenizeRequest)
        if (parsed.prompt is None) == (parsed.messages is None):
            raise InvalidInput("send either 'prompt' or 'messages'", param="prompt")
        is_chat = parsed.messages is not None
        messages = messages_of(parsed.messages) if parsed.messages is not None else None
        payload = wire.TokenizePayload(
            prompt=parsed.prompt, messages=messages,
            # a chat template writes its own special tokens, as vLLM's default for messages assumes
            add_special_tokens=parsed.add_special_tokens if parsed.add_special_tokens is not None else not is_chat,
            template=None if messages is None else template_options(
                parsed.add_generation_prompt, parsed.continue_final_message, parsed.chat_template_kwargs, messages))
        info, result = await _ask(gateway, request, parsed.model, payload)
        return _json({"count": len(result.token_ids), "max_model_len": result.tokenizer.max_model_len,
                      "tokens": result.token_ids}, info)

    async def detokenize(request: Request) -> Response:
        parsed = decode_json(await read_body(request, body_limit_bytes), DetokenizeRequest)
        if len(parsed.tokens) > MAX_DETOKENIZE_TOKENS:
            raise InvalidInput(f"'tokens' holds more than {MAX_DETOKENIZE_TOKENS} ids", param="tokens")
        info, result = await _ask(gateway, request, parsed.model, wire.TokenizePayload(token_ids=parsed.tokens))
        return _json({"prompt": result.text}, info)

    async def tokenizer_info(request: Request) -> Response:
        info, result = await _ask(gateway, request, request.query_params.get("model"), wire.TokenizePayload(prompt=""))
        tokenizer = result.tokenizer
        return _json({"eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token, "pad_token": None,
                      "chat_template": tokenizer.chat_template, "model_max_length": tokenizer.max_model_len,
                      "tokenizer_class": "PreTrainedTokenizerFast"}, info)

    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    ]


async def _ask(gateway: Gateway, request: Request, model: str | None,
               payload: wire.TokenizePayload) -> tuple[wire.ModelInfo, wire.TokenizeResult]:
    info = resolve_openai(gateway, model, request, None) if model else _only_generative_model(gateway, request)
    if info.kind != "generative":
        raise InvalidInput(f"model {info.name!r} has no tokenizer sluice runs (tokenizer endpoints serve "
                           f"generative models)", param="model")
    result = await gateway.infer(info, payload, caller=caller(request, None))
    assert isinstance(result.payload, wire.TokenizeResult)
    return info, result.payload


def _only_generative_model(gateway: Gateway, request: Request) -> wire.ModelInfo:
    tenant = gateway.tenancy.tenant(request_tenant(request))
    generative = []
    for name in sorted(gateway.tenancy.visible(tenant, gateway.models())):
        info = gateway.resolve(name, None)
        if info.kind == "generative":
            generative.append(info)
    if len(generative) != 1:
        names = ", ".join(info.name for info in generative) or "none"
        raise InvalidInput(f"name the 'model' (generative models here: {names})", param="model")
    return generative[0]


def _json(content: dict[str, Any], info: wire.ModelInfo) -> Response:
    return Response(msgspec.json.encode(content), media_type="application/json",
                    headers=with_version(info, None))
