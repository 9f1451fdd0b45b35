"""OpenAI-compatible endpoints: `/v1/models` and `/v1/embeddings`.

Embeddings accept a string or a list of strings, or, for a model that says it takes them
(`ModelInfo.accepts_token_ids`: the embedding runner), a list of token ids or a list of such
lists, ids of the model's own vocabulary; and `encoding_format` `float` or `base64`
(little-endian float32, what the `openai` SDK asks for by default and decodes itself).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sluice import wire
from sluice.api.common import (
    MAX_TEXT_ITEMS,
    HotRoute,
    arrival,
    caller,
    check_texts,
    decode_json,
    header_timeout_s,
    is_traced,
    json_response,
    likely_text_tokens,
    request_tenant,
    requested_priority,
    resolve_openai,
    texts_or_token_ids,
    trace_context,
    with_version,
)
from sluice.api.completion_params import TOKEN_ID_LIMIT
from sluice.api.kserve_generate import GENERATIVE_KINDS
from sluice.errors import InvalidInput, ModelNotReady
from sluice.gateway import Caller, Gateway
from sluice.gateway.admission import estimate_text_tokens, num_batches

MAX_DIMENSIONS = 65_536
_STARTED = int(time.time())


class EmbeddingsRequest(msgspec.Struct):
    model: str
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] | None = "float"  # null: the default
    dimensions: int | None = None
    user: str | None = None
    service_tier: str | None = None
    priority: str | None = None


def routes(gateway: Gateway, body_limit_bytes: int) -> list[Route]:
    async def list_models(request: Request) -> Response:
        tenant = gateway.tenancy.tenant(request_tenant(request))
        models: dict[str, Mapping[str, wire.ModelInfo]] = {name: {} for name, _ in gateway.dormant_versions()}
        models.update(gateway.models())  # and those loaded on demand by their first request
        data = [_model_card(name, models[name]) for name in sorted(gateway.tenancy.visible(tenant, models))]
        return json_response({"object": "list", "data": data})

    async def get_model(request: Request) -> Response:
        name = request.path_params["model"]
        # permission first, as every other route: a 404 for an unknown model against a 403 for
        # one it may not use would tell a tenant which models the server has
        models = gateway.models()
        base, _, version = name.rpartition(":")
        if name not in models and base in models and version in models[base]:  # "m:2", as requests name it
            gateway.tenancy.authorize(gateway.tenancy.tenant(request_tenant(request)), base)
            return json_response(_model_card(name, {version: models[base][version]}))
        gateway.tenancy.authorize(gateway.tenancy.tenant(request_tenant(request)), name)
        if name not in models:
            if any(model == name for model, _ in gateway.dormant_versions()):  # listed too: loaded by a request
                return json_response(_model_card(name, {}))
            _not_ready(gateway, name)
        return json_response(_model_card(name, models[name]))

    def screen(request: Request, body: bytes, first: _Screened | None = None) -> _Screened:
        """Everything before the request is sent on. The overload check is made again on `first`
        (this request's checks, run earlier by the HTTP protocol): the handler sends it right after."""
        if first is None:
            arrived_at = arrival(request, gateway.now())
            parsed = decode_json(body, EmbeddingsRequest)
            info = resolve_openai(gateway, parsed.model, request, parsed.user)
            with gateway.reading(info, request_tenant(request), arrived_at,
                                 trace_context(request) if gateway.is_tracing else None):
                timeout_s = header_timeout_s(request, gateway.max_timeout_s)
                if info.kind in GENERATIVE_KINDS:
                    raise InvalidInput(f"model {parsed.model!r} generates text and makes no embeddings; use "
                                       "/v1/completions or /v1/chat/completions", param="model")
                if not info.accepts_text:
                    raise InvalidInput(f"model {parsed.model!r} does not take text; "
                                       f"use /v2/models/{parsed.model}/infer", param="model")
                payload, num_tokens, likely_tokens = _inputs(parsed.input, info)
                _check_dimensions(info, parsed.dimensions, None)
                priority = requested_priority(request, ("service_tier", parsed.service_tier),
                                              ("priority", parsed.priority))
            who = caller(request, priority, num_tokens, is_traced=is_traced(gateway, info),
                         likely_tokens=likely_tokens)
            first = _Screened(arrived_at, timeout_s, parsed, info, who, payload, gateway.cache_key(info, payload, who))
        gateway.shed_if_overloaded(first.info, first.timeout_s, first.arrived_at, first.who, first.key,
                                   num_batches(first.info, first.payload))
        return first

    async def embeddings(request: Request, body: bytes, first: _Screened | None) -> Response:
        screened = screen(request, body, first)
        info, parsed = screened.info, screened.parsed
        result = await gateway.infer(info, screened.payload, screened.timeout_s, arrived_at=screened.arrived_at,
                                     caller=screened.who, key=screened.key, routed=parsed.model == info.name)
        vectors_payload = result.payload
        assert isinstance(vectors_payload, wire.TensorPayload)
        vectors = np.frombuffer(vectors_payload.data, dtype=vectors_payload.dtype).reshape(vectors_payload.shape)
        _check_dimensions(info, parsed.dimensions, vectors.shape[-1])
        data = [
            {"object": "embedding", "index": i, "embedding": _encode_vector(row, parsed.encoding_format)}
            for i, row in enumerate(vectors)
        ]
        usage = {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens}
        return json_response({"object": "list", "data": data, "model": info.name, "usage": usage},
                     headers=with_version(info, result.headers))

    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        HotRoute("/v1/embeddings", screen, embeddings, body_limit_bytes),
    ]


@dataclass(slots=True)
class _Screened:
    arrived_at: float
    timeout_s: float | None
    parsed: EmbeddingsRequest
    info: wire.ModelInfo
    who: Caller
    payload: wire.TextPayload | wire.TokensPayload
    key: bytes | None
    """The result-cache key (`Gateway.cache_key`); None: not cached."""


def _check_dimensions(info: wire.ModelInfo, dimensions: int | None, produced: int | None) -> None:
    """Refuse a `dimensions` the model cannot give: before inference when its width is declared
    (or the number is absurd), otherwise once the vectors are back."""
    if dimensions is None:
        return
    if not 1 <= dimensions <= MAX_DIMENSIONS:
        raise InvalidInput(f"'dimensions' must be in [1, {MAX_DIMENSIONS}], got {dimensions}",
                           param="dimensions")
    if produced is None:
        shape = info.outputs[0].shape if info.outputs else ()
        produced = shape[-1] if len(shape) == 2 and shape[-1] > 0 else None
    if produced is not None and dimensions != produced:
        raise InvalidInput(f"model {info.name!r} produces {produced} dimensions and cannot be shortened to "
                           f"{dimensions}", param="dimensions")


def _inputs(raw: str | list[Any],
            info: wire.ModelInfo) -> tuple[wire.TextPayload | wire.TokensPayload, float, float | None]:
    """The request's inputs, a bound on their tokens and a guess at them (`Caller`: for token
    ids, their count and None)."""
    if isinstance(raw, str) or all(isinstance(one, str) for one in raw[:MAX_TEXT_ITEMS + 1]):
        texts = check_texts([raw] if isinstance(raw, str) else raw, "'input'", param="input")
        return (wire.TextPayload(texts), estimate_text_tokens(texts, info.max_model_len),
                likely_text_tokens(texts, info.max_model_len))
    inputs = texts_or_token_ids(raw, "input", info.vocab_size or TOKEN_ID_LIMIT, MAX_TEXT_ITEMS, "inputs")
    if not info.accepts_token_ids:
        raise InvalidInput(f"model {info.name!r} takes 'input' as strings only, not token ids", param="input")
    ids = [one for one in inputs if isinstance(one, list)]  # all of them: strings were taken above
    longest = max(len(one) for one in ids)
    if info.max_model_len and longest > info.max_model_len:
        raise InvalidInput(f"an input has {longest} token ids; model {info.name!r} takes at most "
                           f"{info.max_model_len}", param="input")
    return wire.TokensPayload(ids), float(sum(len(one) for one in ids)), None


def _encode_vector(row: np.ndarray, encoding: str | None) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(row.astype("<f4").tobytes()).decode()
    values: list[float] = row.tolist()
    return values


def _not_ready(gateway: Gateway, name: str) -> NoReturn:
    """Why `GET /v1/models/{name}` has no card for a model no ready worker serves, as the KServe
    metadata answers: 503 with `Retry-After` while it loads (or has no worker yet), 404 with the
    reason for one refused at load, 404 for one the server does not have. `name` may be
    `model:version`, as requests name a version."""
    base, _, version = name.rpartition(":")
    if base and version.isdigit() and name not in gateway.models(include_recovering=True) \
            and name not in gateway.expected_models:
        gateway.resolve(base, version, by_split=False, on_demand=False)
    else:
        gateway.resolve(name, None, by_split=False, on_demand=False)
    # its workers are known to serve it, and are being restarted
    raise ModelNotReady(f"model {name!r} has no ready worker now: its worker is being restarted", retry_after_s=1.0)


def _model_card(name: str, versions: Mapping[str, wire.ModelInfo]) -> dict[str, Any]:
    """OpenAI's model object; a generative model's also says its context (`max_model_len`, as vLLM's
    does, the smallest of its ready versions': what every request to it may use), an embedding
    model's the tokens it keeps of an input."""
    card: dict[str, Any] = {"id": name, "object": "model", "created": _STARTED, "owned_by": "sluice"}
    contexts = [info.max_model_len for info in versions.values() if info.max_model_len]
    if contexts:
        card["max_model_len"] = min(contexts)
    return card

