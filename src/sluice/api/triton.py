"""Triton's extensions to the v2 protocol that its clients call beside inference:

    GET  /v2/models/{m}[/versions/{v}]/config      model configuration (Triton's `ModelConfig` JSON)
    GET  /v2/models/stats                          statistics of every model version
    GET  /v2/models/{m}[/versions/{v}]/stats       statistics of one model (its versions) or version
    POST /v2/repository/index                      the repository's model versions and their state
    POST /v2/repository/models/{m}/load            (admin) bring the model in line with the repository
    POST /v2/repository/models/{m}/unload          (admin) take every version of the model off
    /v2/systemsharedmemory/... /v2/cudasharedmemory/... /v2/trace/setting /v2/models/{m}/trace/setting
    /v2/logging                                    refused: 501 (`UNSUPPORTED`)

`tritonclient`'s `get_model_config`, `get_inference_statistics`, `get_model_repository_index`,
`load_model` and `unload_model` call these (Triton's example clients read `max_batch_size` and
the inputs' `dims` from the configuration); the gRPC API answers the same content
(`api.kserve_grpc`). A tenant sees only the models it may use, as in the model metadata.

The configuration describes what sluice does, in Triton's terms: `dynamic_batching` with no
queue delay (a batch is formed when the device frees), three priority levels (interactive,
standard, batch; the calling tenant's class is the default), and the model's SLO as the default
queue timeout, after which a request is rejected. Statistics: `gateway.statistics`.

Loading is Triton's explicit model control over the folder the workers were started with
(`Gateway.sync_model`): `load` loads the versions added to the model's folder since (each checked
against its SHA256SUMS and warmed up, while every other version keeps serving), takes off the
versions removed from it (they answer what they hold first), and keeps the loaded ones as they
are; a model new to the repository is loaded whole. `unload` takes the model off until it is
loaded again. The call returns once every worker has done it. A configuration or files sent in
the call's `parameters` are refused: what a worker serves is always what its repository holds.

Triton's shared-memory, trace and logging extensions are not offered (nor listed in `GET /v2`):
their routes, and the gRPC methods of the same names, answer 501 (gRPC UNIMPLEMENTED, as Triton
answers a feature it lacks) saying what to do instead, rather than a bare 404 "no route".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sluice import wire
from sluice.api.common import MONITOR_SCOPE_KEY, decode_json, json_response, read_body, request_tenant
from sluice.api.kserve_generate import EXCLUDE_INPUT, GENERATIVE_KINDS, SAMPLING_INPUT, STREAM
from sluice.api.tensors import NO_SHARED_MEMORY
from sluice.errors import InvalidInput, ModelNotFound, NotSupported, Unavailable
from sluice.gateway import Gateway
from sluice.gateway.traffic import version_order

UNSUPPORTED = {
    "shared memory": NO_SHARED_MEMORY,
    "trace": "sluice does not support Triton's trace extension: it traces with OpenTelemetry, exported where "
             "OTEL_EXPORTER_OTLP_ENDPOINT says when it starts (a request's traceparent header joins its trace)",
    "logging": "sluice does not support Triton's logging extension: its log level is set when it starts "
               "(--log-level)",
}
"""The extensions refused, and what each refusal says."""
UNSUPPORTED_GRPC_METHODS = {
    **{f"{kind}SharedMemory{call}": "shared memory" for kind in ("System", "Cuda")
       for call in ("Status", "Register", "Unregister")},
    "TraceSetting": "trace", "LogSettings": "logging",
}
"""Triton's gRPC methods of those extensions (`api.kserve_grpc` answers them UNIMPLEMENTED)."""


def model_config_of(gateway: Gateway, tenant: str, name: str, version: str | None) -> dict[str, Any]:
    """A model version's configuration as Triton's `ModelConfig` (JSON field names), for a
    tenant that may use it; the newest version when none is named."""
    info = gateway.resolve(name, version, by_split=False, tenant=tenant)
    caller = gateway.tenancy.tenant(tenant)
    batched = info.max_batch_size > 0
    parameters = {"sluice_kind": info.kind, "sluice_version": info.version, "sluice_slo_ms": f"{info.slo_s * 1000:g}"}
    if info.max_model_len:
        parameters["max_model_len"] = str(info.max_model_len)
    return {
        "name": info.name,
        "platform": info.platform,
        "backend": info.kind,
        "max_batch_size": info.max_batch_size,
        "input": [_tensor_config(spec, batched) for spec in info.inputs] + _optional_inputs(info),
        "output": [_tensor_config(spec, batched) for spec in info.outputs],
        "instance_group": [{"name": info.name, "kind": "KIND_MODEL",
                            "count": gateway.num_replicas(info.name, info.version)}],
        "dynamic_batching": {
            "max_queue_delay_microseconds": 0,
            "preserve_ordering": False,
            "priority_levels": 3,
            "default_priority_level": int(caller.priority) + 1,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": round(info.slo_s * 1e6),
                "allow_timeout_override": True,
                "max_queue_size": 0,
            },
        },
        "parameters": {key: {"string_value": value} for key, value in parameters.items()},
        "response_cache": {"enable": bool(info.cache_revision) and gateway.cache is not None},
    }


def statistics_of(gateway: Gateway, tenant: str | None, name: str | None, version: str | None) -> dict[str, Any]:
    """Triton's `ModelStatisticsResponse`: every version of every model the tenant may use
    (`name` None), of one model, or one version (404 if the model or version is not served).
    `tenant` None: a metrics or admin key's reader (`auth.statistics_reader`), who sees every model."""
    caller = None if tenant is None else gateway.tenancy.tenant(tenant)
    served = gateway.models(include_recovering=True)
    if name is None:
        keys = {(model, v) for model in served if caller is None or caller.may_use(model) for v in served[model]}
        keys |= {key for key in gateway.statistics.versions() if caller is None or caller.may_use(key[0])}
    else:
        # monitoring loads nothing
        info = gateway.resolve(name, version, by_split=False, on_demand=False, tenant=tenant)
        keys = {(info.name, info.version)} if version is not None else {(name, v) for v in served.get(name, {})}
    ordered = sorted(keys, key=lambda key: (key[0], version_order(key[1])))
    return {"model_stats": [gateway.statistics.snapshot(model, v) for model, v in ordered]}


def repository_index_of(gateway: Gateway, tenant: str | None, ready_only: bool) -> list[dict[str, str]]:
    """Triton's repository index: each model version the tenant may use (`tenant` None: an admin
    key's reader, `auth.listing_reader`, who sees every model), `READY` when a ready worker serves
    it, `UNAVAILABLE` (with the reason) when it failed to load, was unloaded, or its workers are
    being restarted, `LOADING` while a worker loads it, or the repository's version has no worker
    yet."""
    caller = None if tenant is None else gateway.tenancy.tenant(tenant)
    ready = gateway.models()
    states: dict[tuple[str, str], tuple[str, str]] = {}
    for model, version in gateway.expected_versions:
        states[(model, version)] = ("LOADING", "")
    for model, versions in gateway.models(include_recovering=True).items():
        for version in versions:
            states[(model, version)] = ("READY", "") if version in ready.get(model, {}) \
                else ("UNAVAILABLE", "its worker is being restarted")
    for refused in gateway.refused():
        states[(refused.name, refused.version)] = ("UNAVAILABLE", refused.reason)
    for model, version in gateway.loading_versions():  # (loaded again after it was refused, perhaps)
        states[(model, version)] = ("LOADING", "")
    for model, had in gateway.unloaded.items():
        for version in had:
            states.setdefault((model, version), ("UNAVAILABLE", "unloaded"))
    for model, version in gateway.dormant_versions():
        states.setdefault((model, version), ("UNAVAILABLE", "loaded on demand, by its first inference request"))
    index = []
    for (model, version), (state, reason) in sorted(states.items(), key=lambda kv: (kv[0][0], version_order(kv[0][1]))):
        if (caller is None or caller.may_use(model)) and (state == "READY" or not ready_only):
            index.append({"name": model, "version": version, "state": state, "reason": reason})
    return index


async def load_model_of(gateway: Gateway, name: str, *, unload: bool = False,
                        parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load (or unload) a model on every worker (`Gateway.sync_model`): the versions served now,
    or the error of a version that could not be loaded (the others serve), of a model the
    repository does not have, or of workers that did not answer."""
    overrides = sorted(p for p in parameters or {} if p == "config" or p.startswith("file:"))
    if overrides:  # (`unload_dependents` is about ensembles, which sluice has none of)
        raise InvalidInput(f"sluice loads model {name!r} from its repository folder: a configuration or files in "
                           f"the request's parameters ({', '.join(overrides)}) are not supported",
                           param="parameters")
    known = gateway.models(include_recovering=True).keys() | gateway.expected_models | gateway.unloaded.keys()
    if unload and name not in known:
        raise ModelNotFound(f"model {name!r} is not served: there is nothing to unload")
    synced = await gateway.sync_model(name, unload=unload)
    served = f"; served now: version{'s' if len(synced.versions) > 1 else ''} {', '.join(synced.versions)}" \
        if synced.versions else ""
    if synced.unanswered:
        raise Unavailable(f"worker{'s' if len(synced.unanswered) > 1 else ''} {', '.join(synced.unanswered)} did "
                          f"not finish {'unloading' if unload else 'loading'} model {name!r}{served}")
    if synced.refused:
        reasons = "; ".join(f"version {version}: {reason}" for version, reason in synced.refused)
        raise InvalidInput(f"model {name!r} could not be loaded ({reasons}){served}")
    if not unload and not synced.versions:
        raise ModelNotFound(f"model {name!r} is not in the model repository (no version of it is served)")
    return {"name": name, "versions": synced.versions}


def routes(gateway: Gateway) -> list[Route]:
    async def config(request: Request) -> Response:
        name, version = request.path_params["name"], request.path_params.get("version")
        return json_response(model_config_of(gateway, request_tenant(request), name, version))

    async def stats(request: Request) -> Response:
        name, version = request.path_params.get("name"), request.path_params.get("version")
        reader = None if request.scope.get(MONITOR_SCOPE_KEY) else request_tenant(request)
        return json_response(statistics_of(gateway, reader, name, version))

    async def index(request: Request) -> Response:
        body = await read_body(request, 4096)
        options = decode_json(body, _IndexRequest) if body.strip() else _IndexRequest()
        reader = None if request.scope.get(MONITOR_SCOPE_KEY) else request_tenant(request)
        return json_response(repository_index_of(gateway, reader, options.ready))

    def loader(*, unload: bool) -> Callable[[Request], Awaitable[Response]]:
        async def load(request: Request) -> Response:
            body = await read_body(request, 64 * 1024)
            options = decode_json(body, _LoadRequest) if body.strip() else _LoadRequest()
            return json_response(await load_model_of(gateway, request.path_params["name"], unload=unload,
                                                     parameters=options.parameters))

        return load

    def refuse(extension: str) -> Callable[[Request], Awaitable[Response]]:
        async def refused(request: Request) -> Response:
            raise NotSupported(UNSUPPORTED[extension])

        return refused

    table = [
        Route("/v2/models/stats", stats, methods=["GET"]),  # before /v2/models/{name}
        Route("/v2/repository/index", index, methods=["POST"]),
        Route("/v2/repository/models/{name}/load", loader(unload=False), methods=["POST"]),
        Route("/v2/repository/models/{name}/unload", loader(unload=True), methods=["POST"]),
    ]
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        table += [Route(prefix + "/config", config, methods=["GET"]),
                  Route(prefix + "/stats", stats, methods=["GET"])]
    for kind in ("systemsharedmemory", "cudasharedmemory"):
        table += [Route(f"/v2/{kind}{region}/{call}", refuse("shared memory"), methods=[method])
                  for region in ("", "/region/{region}")
                  for call, method in (("status", "GET"), ("unregister", "POST"))]
        table.append(Route(f"/v2/{kind}/region/{{region}}/register", refuse("shared memory"), methods=["POST"]))
    table += [Route(path, refuse("trace"), methods=["GET", "POST"])
              for path in ("/v2/trace/setting", "/v2/models/{name}/trace/setting")]
    table.append(Route("/v2/logging", refuse("logging"), methods=["GET", "POST"]))
    return table


class _IndexRequest(msgspec.Struct):
    repository_name: str = ""
    ready: bool = False
    """Only the versions that are ready."""


def _optional_inputs(info: wire.ModelInfo) -> list[dict[str, Any]]:
    """A generative model's optional inputs (`api.kserve_generate`), declared as Triton's vLLM backend does."""
    if info.kind not in GENERATIVE_KINDS:
        return []
    return [{"name": name, "data_type": data_type, "dims": [1], "optional": True}
            for name, data_type in ((STREAM, "TYPE_BOOL"), (SAMPLING_INPUT, "TYPE_STRING"),
                                    (EXCLUDE_INPUT, "TYPE_BOOL"))]


def _tensor_config(spec: wire.TensorSpec, batched: bool) -> dict[str, Any]:
    dims = list(spec.shape[1:] if batched else spec.shape)
    return {"name": spec.name, "data_type": "TYPE_STRING" if spec.datatype == "BYTES" else f"TYPE_{spec.datatype}",
            "dims": dims}


class _LoadRequest(msgspec.Struct):
    parameters: dict[str, Any] | None = None
    """Triton's: a configuration or files to load instead of the repository's (refused)."""
