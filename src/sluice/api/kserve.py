"""KServe / Open Inference Protocol v2 endpoints, JSON and binary tensors.

    GET  /v2                                   server metadata
    GET  /v2/health/live | /v2/health/ready    {"live": true} | {"ready": bool}
    GET  /health                               as /v2/health/ready: where vLLM, TGI and SGLang answer it
    GET  /v2/models/{m}[/versions/{v}]         model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready   {"name", "ready"}
    POST /v2/models/{m}[/versions/{v}]/infer   inference

The request-level `timeout` parameter is in microseconds, as in Triton and `tritonclient`; it
takes precedence over an `X-Request-Timeout-Ms` header (which is still checked). The request's
shape, inputs and requested outputs are checked here, before any worker time is spent on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sluice import __version__, wire
from sluice.api.classification import PARAMETER as CLASSIFICATION
from sluice.api.classification import class_counts, top_classes
from sluice.api.common import (
    PRIORITY_HEADER,
    HotRoute,
    arrival,
    caller,
    check_texts,
    header_timeout_s,
    is_traced,
    json_response,
    likely_text_tokens,
    note_model,
    parse_count,
    priority_of,
    request_tenant,
    requested_priority,
    route_key,
    trace_context,
)
from sluice.api.kserve_generate import GENERATIVE_KINDS, generate_text, text_output, text_request
from sluice.api.tensors import (
    NUMPY_NAMES,
    NUMPY_TO_KSERVE,
    InferRequestBody,
    Tensor,
    check_input,
    check_no_shared_memory,
    decode_bytes_elements,
    encode_bytes_elements,
    parse_request,
    render_outputs,
    texts_of,
)
from sluice.errors import InvalidInput, ModelNotReady
from sluice.gateway import Caller, Gateway
from sluice.gateway.admission import TEXT_SPECIAL_TOKENS, batches_for, estimate_text_tokens, num_batches
from sluice.gateway.cache import cache_policy
from sluice.priority import Priority

HEADER_LENGTH = "inference-header-content-length"
SERVED_EXTENSIONS = ("binary_tensor_data", "classification", "model_configuration", "model_repository",
                     "schedule_policy", "statistics")
"""The protocol extensions `GET /v2` and gRPC `ServerMetadata` list (`classification`: `api.classification`;
`schedule_policy`: a request's `priority` and `timeout` parameters, here; the other three: `api.triton`).
Not Triton's `model_repository(unload_dependents)`: sluice has no ensembles, so there are no
dependents to unload (the parameter is accepted and changes nothing)."""


def routes(gateway: Gateway, body_limit_bytes: int) -> list[Route]:
    async def server_metadata(request: Request) -> Response:
        return json_response({"name": "sluice", "version": __version__, "extensions": list(SERVED_EXTENSIONS)})

    async def live(request: Request) -> Response:
        return json_response({"live": True})

    async def ready(request: Request) -> Response:
        is_ready = gateway.is_ready()
        return json_response({"ready": is_ready}, status=200 if is_ready else 503)

    async def model_metadata(request: Request) -> Response:
        name, version = _path(request)
        return json_response({**model_metadata_of(gateway, request_tenant(request), name, version),
                      **_refused(gateway, name, version)})

    async def model_ready(request: Request) -> Response:
        name, version = _path(request)
        info = model_ready_of(gateway, request_tenant(request), name, version)
        if info is None:
            return json_response({"name": name, "ready": False}, status=503)
        return json_response({"name": info.name, "ready": True, **_refused(gateway, name, version)})

    def screen(request: Request, body: bytes, first: _Screened | None = None) -> _Screened:
        """What can be answered before the body is parsed (404, 400s on headers, 403, and 503/504
        under overload unless the answer is stored). The overload check is made again on `first`
        (this request's checks, run earlier by the HTTP protocol): the handler sends it right after."""
        if first is None:
            arrived_at = arrival(request, gateway.now())
            name, version = _path(request)
            info = note_model(request, gateway.resolve(name, version, route_key(request),
                                                       tenant=request_tenant(request)))
            with gateway.reading(info, request_tenant(request), arrived_at,
                                 trace_context(request) if gateway.is_tracing else None):
                header_timeout = header_timeout_s(request, gateway.max_timeout_s)
                header_length = _header_length(request)
            policy = cache_policy(request.headers.get("cache-control"))
            early = caller(request, requested_priority(request), is_traced=gateway.is_tracing, cache=policy)
            raw = body if header_length is None else b"%d\0%b" % (header_length, body)
            key = gateway.cache_key(info, raw, early)
            first = _Screened(arrived_at, info, header_timeout, header_length, early, key)
        if b'"timeout"' not in body:  # the deadline is known before parsing, or bounded by the body's size
            gateway.shed_if_overloaded(first.info, first.header_timeout, first.arrived_at, first.early, first.key,
                                       _most_batches(first.info, body, first.header_length))
        return first

    async def infer(request: Request, body: bytes, first: _Screened | None) -> Response:
        screened = screen(request, body, first)
        info, arrived_at = screened.info, screened.arrived_at
        if info.kind in GENERATIVE_KINDS:  # text in, text out (`kserve_generate`)
            return await _infer_text(request, body, screened)
        with gateway.reading(info, screened.early.tenant, arrived_at, screened.early.trace):
            parsed, tensors = parse_request(body, screened.header_length)
            terms = infer_terms(info, tensors, parsed.parameters, request.headers.get(PRIORITY_HEADER),
                                gateway.max_timeout_s)
            binary_outputs = _binary_outputs(info, parsed)
            classes = class_counts(info, _classifications(parsed))
        who = caller(request, terms.priority, terms.tokens, is_traced=is_traced(gateway, info),
                     cache=screened.early.cache, likely_tokens=terms.likely_tokens)
        timeout_s = screened.header_timeout if terms.timeout_s is None else terms.timeout_s
        if terms.timeout_s is not None or b'"timeout"' in body or (timeout_s is None and _most_batches(
                info, body, screened.header_length) > 1):  # the body's deadline, or its batches' default, known now
            gateway.shed_if_overloaded(info, timeout_s, arrived_at, who, screened.key, num_batches(info, terms.payload))
        result = await gateway.infer(info, terms.payload, timeout_s, arrived_at=arrived_at, caller=who,
                                     key=screened.key, routed=_path(request)[1] is None)
        return _render(info, parsed, result.payload, binary_outputs, classes, result.headers)

    async def _infer_text(request: Request, body: bytes, screened: _Screened) -> Response:
        info = screened.info
        with gateway.reading(info, screened.early.tenant, screened.arrived_at, screened.early.trace):
            parsed, tensors = parse_request(body, screened.header_length)
            timeout_s, priority = request_terms(parsed.parameters, request.headers.get(PRIORITY_HEADER),
                                                gateway.max_timeout_s)
            text = text_request(info, tensors, parsed.parameters,
                                stream_route=f"gRPC ModelStreamInfer, or POST /v2/models/{info.name}/generate_stream")
            binary_outputs = _binary_outputs(info, parsed)
            classes = class_counts(info, _classifications(parsed))
        # untraced too, as /v1/completions: an upstream call carries the client's trace on
        who = caller(request, priority, is_traced=True, cache=screened.early.cache)
        texts, headers = await generate_text(gateway, who, info, text,
                                             screened.header_timeout if timeout_s is None else timeout_s,
                                             screened.arrived_at)
        return _render(info, parsed, text_output(texts), binary_outputs, classes, headers)

    prefixes = ["/v2/models/{name}", "/v2/models/{name}/versions/{version}"]
    table = [
        Route("/v2", server_metadata, methods=["GET"]),
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/health", ready, methods=["GET"]),
    ]
    for prefix in prefixes:
        table += [
            Route(prefix, model_metadata, methods=["GET"]),
            Route(prefix + "/ready", model_ready, methods=["GET"]),
            HotRoute(prefix + "/infer", screen, infer, body_limit_bytes),
        ]
    return table


@dataclass(slots=True)
class _Screened:
    arrived_at: float
    info: wire.ModelInfo
    header_timeout: float | None
    header_length: int | None
    early: Caller
    """Who asks, as known before the body is parsed (its class from headers only)."""
    key: bytes | None
    """The result-cache key, from the body as sent (`cache.cache_key`); None: not cached."""


def _most_batches(info: wire.ModelInfo, body: bytes, header_length: int | None) -> int:
    """The most batches (`admission.num_batches`) a request of this body could need, for the overload
    check made before the body is parsed: its default deadline is the SLO for each batch it needs,
    so that check must not take a large request for one of a batch. Counted by bounds that need no
    parsing: every JSON element but an array's last is followed by a comma, a binary element takes
    a byte at least, and a text costs at most a token per byte and its special tokens."""
    if info.kind in GENERATIVE_KINDS:
        return 1  # its deadline is one generation's
    header = body if header_length is None else body[:header_length]
    num_elements = header.count(b",") + header.count(b"[") + (len(body) - len(header))
    return batches_for(info, num_elements, len(body) + TEXT_SPECIAL_TOKENS * num_elements)


@dataclass(frozen=True, slots=True)
class InferTerms:
    """What an infer request asks, read the same way from either transport (`infer_terms`)."""

    payload: wire.Payload
    timeout_s: float | None
    """From the `timeout` parameter (microseconds); None if it has none."""
    priority: Priority | None
    tokens: float
    """The bound reserved against the tenant's tokens-per-minute limit."""
    likely_tokens: float
    """A guess at them (`Caller.likely_tokens`)."""


def infer_terms(info: wire.ModelInfo, tensors: list[Tensor], parameters: dict[str, Any], priority_header: str | None,
                max_timeout_s: float) -> InferTerms:
    """An infer request's payload for `info`, its `timeout` and its class (the `priority`
    parameter with the `x-sluice-priority` header or metadata), checked alike for HTTP and gRPC."""
    payload = _to_payload(info, tensors)
    timeout_s, priority = request_terms(parameters, priority_header, max_timeout_s)
    texts = payload.texts if isinstance(payload, wire.TextPayload) else []
    tokens = estimate_text_tokens(texts, info.max_model_len)
    likely = likely_text_tokens(texts, info.max_model_len)
    return InferTerms(payload, timeout_s, priority, tokens, likely)


def request_terms(parameters: dict[str, Any], priority_header: str | None,
                  max_timeout_s: float) -> tuple[float | None, Priority | None]:
    """An infer request's deadline (its `timeout` parameter, None if none) and class."""
    timeout_s = _parse_timeout(parameters, max_timeout_s)
    return timeout_s, priority_of(priority_header, ("priority", _triton_priority(parameters.get("priority"))))


def check_outputs(info: wire.ModelInfo, names: list[str]) -> None:
    """Requested outputs must be the model's, checked before inference so no device time is spent
    on a request whose answer cannot be rendered."""
    known = [spec.name for spec in info.outputs]
    unknown = [name for name in names if name not in known]
    if unknown:
        has = ", ".join(repr(name) for name in known)
        raise InvalidInput(f"model {info.name} has no output named {unknown[0]!r} (it has {has})")
    if len(set(names)) != len(names):  # which entry's parameters would count? (Triton refuses it too)
        repeated = next(name for name in names if names.count(name) > 1)
        raise InvalidInput(f"output {repeated!r} is requested more than once", param=repeated)


def outputs_of(info: wire.ModelInfo, payload: wire.Payload, names: list[str] | None = None,
               classes: dict[str, int] | None = None) -> list[Tensor]:
    """A model's answer as its outputs: those named, in that order (`names`, checked by
    `check_outputs`), or all of them; those in `classes` as their top classes (`class_counts`)."""
    if isinstance(payload, wire.TensorsPayload):
        found = {t.name: t for t in payload.tensors}
        chosen = [found[name] for name in names or found if name in found]
        outputs = [Tensor(t.name, t.datatype, t.shape,
                          decode_bytes_elements(t.data) if t.datatype == "BYTES" else t.data) for t in chosen]
    elif isinstance(payload, wire.TensorPayload):
        spec = info.outputs[0]
        outputs = [Tensor(spec.name, NUMPY_TO_KSERVE.get(payload.dtype, spec.datatype), payload.shape, payload.data)]
    else:
        raise TypeError("models return tensors")
    if not classes:
        return outputs
    return [top_classes(t, classes[t.name], info.max_batch_size > 0) if t.name in classes else t for t in outputs]


def model_metadata_of(gateway: Gateway, tenant: str, name: str, version: str | None) -> dict[str, Any]:
    """A model's v2 metadata, for a tenant that may use it (else 403; an unknown model 404): all its
    versions when asked by name, else the one asked for. Shared by the HTTP and gRPC APIs."""
    info = gateway.resolve(name, version, by_split=False, tenant=tenant)  # the same answer each time
    versions = gateway.models(include_recovering=True).get(name, {})
    return {
        "name": info.name,
        "versions": sorted(versions) if version is None else [info.version],
        "platform": info.platform,
        "inputs": [_spec(s) for s in info.inputs],
        "outputs": [_spec(s) for s in info.outputs],
    }


def model_ready_of(gateway: Gateway, tenant: str, name: str, version: str | None) -> wire.ModelInfo | None:
    """The version that answers for `name` (and `version`) if a ready worker serves it, None if
    none does yet; 403 for a model the tenant may not use (first), 404 for an unknown one."""
    try:
        info = gateway.resolve(name, version, by_split=False, on_demand=False, tenant=tenant)  # a probe loads nothing
    except ModelNotReady:
        return None
    return info


def _refused(gateway: Gateway, name: str, version: str | None) -> dict[str, Any]:
    """For a model asked for as a whole: its versions refused at load and why (a sluice addition
    to the v2 answers; a refused version asked for by number answers 404 with the reason)."""
    if version is not None:
        return {}
    refused = [{"version": r.version, "reason": r.reason} for r in gateway.refused() if r.name == name]
    return {"refused": refused} if refused else {}


def _triton_priority(raw: Any) -> Any:
    """Triton's `priority` parameter is a level, 1 the highest and 0 the model's default (what
    `tritonclient`'s `priority=` sends); sluice also takes a class name there."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:  # (a float: gRPC's double_param, JSON's 1.5)
        raise InvalidInput(f"parameter 'priority' must be a non-negative level (an integer, 1 the highest) or a "
                           f"class name (interactive, standard or batch), got {raw!r}", param="priority")
    return None if raw == 0 else ("interactive", "standard")[raw - 1] if raw <= 2 else "batch"


def _path(request: Request) -> tuple[str, str | None]:
    return request.path_params["name"], request.path_params.get("version")


def _header_length(request: Request) -> int | None:
    raw = request.headers.get(HEADER_LENGTH)
    if raw is None:
        return None
    length = parse_count(raw)
    if length is None:
        raise InvalidInput(f"Inference-Header-Content-Length must be a non-negative integer, got {raw[:32]!r}")
    return length


def _parse_timeout(parameters: dict[str, Any], max_timeout_s: float) -> float | None:
    raw = parameters.get("timeout")
    if raw is None:
        return None
    if not isinstance(raw, int | float) or isinstance(raw, bool) or not 0 < raw <= max_timeout_s * 1e6:
        raise InvalidInput(f"parameter 'timeout' must be a number of microseconds in (0, {max_timeout_s * 1e6:.0f}]",
                           param="timeout")
    return float(raw) / 1e6


def _to_payload(info: wire.ModelInfo, tensors: list[Tensor]) -> wire.Payload:
    if info.named_io:
        return _to_tensors(info, tensors)
    expected = info.inputs[0]
    if len(tensors) != 1 or tensors[0].name != expected.name:
        names = [t.name for t in tensors]
        raise InvalidInput(f"model {info.name} takes one input named {expected.name!r}, got {names}")
    tensor = tensors[0]
    check_input(tensor, expected)
    if isinstance(tensor.data, list):  # BYTES
        return wire.TextPayload(check_texts(texts_of(tensor), f"input {tensor.name!r}", param=tensor.name))
    return wire.TensorPayload(NUMPY_NAMES[tensor.datatype], tensor.shape, tensor.data)


def _to_tensors(info: wire.ModelInfo, tensors: list[Tensor]) -> wire.TensorsPayload:
    """Every input the model declares, each once, of its datatype and shape, all with the same
    number of rows (the request's items)."""
    specs = {spec.name: spec for spec in info.inputs}
    given = {t.name: t for t in tensors}
    unknown = [t.name for t in tensors if t.name not in specs]
    if unknown:
        raise InvalidInput(f"model {info.name} has no input named {unknown[0]!r} (it has "
                           f"{', '.join(repr(name) for name in specs)})", param=unknown[0])
    if len(given) != len(tensors):
        repeated = next(t.name for t in tensors if sum(u.name == t.name for u in tensors) > 1)
        raise InvalidInput(f"input {repeated!r} is given more than once", param=repeated)
    missing = [name for name in specs if name not in given]
    if missing:
        raise InvalidInput(f"model {info.name} needs input {missing[0]!r} (it takes "
                           f"{', '.join(repr(name) for name in specs)})", param=missing[0])
    named = []
    for name, spec in specs.items():
        tensor = given[name]
        check_input(tensor, spec)
        data = encode_bytes_elements(tensor.data) if isinstance(tensor.data, list) else tensor.data
        named.append(wire.NamedTensor(name, tensor.datatype, tensor.shape, data))
    rows = {t.shape[0] for t in named}
    if len(rows) > 1:
        counts = ", ".join(f"{t.name!r} {t.shape[0]}" for t in named)
        raise InvalidInput(f"inputs must have the same first (batch) dimension, got {counts}")
    return wire.TensorsPayload(named)


def _binary_outputs(info: wire.ModelInfo, request: InferRequestBody) -> set[str]:
    """The outputs to send as binary (each one the model's: `check_outputs`): the request's
    `binary_data_output` applies to every output (what tritonclient sends when it lists none) but
    those listed with a `binary_data` of their own, which overrides it (the extension's rule)."""
    every = request.parameters.get("binary_data_output") is True
    if not request.outputs:
        return {spec.name for spec in info.outputs} if every else set()
    for output in request.outputs:
        check_no_shared_memory(f"output {output.name!r}", output.parameters)
    check_outputs(info, [o.name for o in request.outputs])
    return {o.name for o in request.outputs if o.parameters.get("binary_data", every) is True}


def _classifications(request: InferRequestBody) -> list[tuple[str, Any]]:
    return [(o.name, o.parameters.get(CLASSIFICATION)) for o in request.outputs or ()]


def _render(info: wire.ModelInfo, request: InferRequestBody, payload: wire.Payload, binary: set[str],
            classes: dict[str, int], headers: dict[str, str] | None) -> Response:
    names = [o.name for o in request.outputs] if request.outputs else None
    entries, raw = render_outputs(outputs_of(info, payload, names, classes), binary)
    body: dict[str, Any] = {"model_name": info.name, "model_version": info.version, "outputs": entries}
    if request.id is not None:
        body["id"] = request.id
    header = msgspec.json.encode(body)
    if not raw:
        return Response(header, media_type="application/json", headers=headers)
    return Response(header + raw, media_type="application/octet-stream",
                    headers={**(headers or {}), "inference-header-content-length": str(len(header))})


def _spec(spec: wire.TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}



