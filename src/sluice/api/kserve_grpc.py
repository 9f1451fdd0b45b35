"""KServe / Open Inference Protocol v2 over gRPC (`inference.GRPCInferenceService`), beside HTTP.

    ServerLive | ServerReady                      no key needed (health probes)
    ServerMetadata                                a key, as `GET /v2` (none without a tenants file)
    ModelReady | ModelMetadata                    `version` "" : the model as a whole; an unknown,
                                                  unloaded or refused model is `ready: false`
    ModelConfig | ModelStatistics                 Triton's extensions (`api.triton`); statistics
                                                  with `name` "": every model; under `[metrics]
                                                  access = "keys"` a metrics or admin key's only
    RepositoryIndex                               the model versions and their state
    RepositoryModelLoad | RepositoryModelUnload   (admin) `api.triton.load_model_of`, as over HTTP
    ModelInfer                                    one request; outputs in `raw_output_contents`
    ModelStreamInfer                              Triton's: many requests on one stream, each
                                                  answered (by `id`) as soon as it is done; a
                                                  generation with `stream` true, as Triton's
                                                  decoupled LLM backends, chunk by chunk; a failed
                                                  request's message starts with its `id`

What `tritonclient.grpc` and KServe's client send works unchanged: inputs in `raw_input_contents`
(tritonclient's default) or in typed `contents`; outputs always go back raw, which is where
tritonclient reads them. A request takes the same path as an HTTP one: the tenant's key, limits
and class, the model's traffic split, the result cache, overload refusal, the deadline, metrics.

- Keys: `authorization: Bearer <key>` or `api-key` metadata, as the HTTP headers.
- Deadline: the call's own gRPC deadline, and the request's `timeout` parameter (microseconds,
  what tritonclient's `timeout=` sends); the earlier counts, capped at the gateway's longest.
- Class: the `priority` parameter (Triton's level, or a class name) and `x-sluice-priority`
  metadata, lowest wins. `x-sluice-route-key`, `cache-control`, `traceparent` and `tracestate` metadata act as
  the HTTP headers.
- Errors: the status the HTTP API would send, as a gRPC code (`GRPC_CODES`), with `retry-after`,
  `retry-after-ms` and the rate-limit headers as trailing metadata. Every call's trailing
  metadata carries its `x-request-id` (the client's if it sent a sane one).

The messages come from `proto/grpc_predict_v2.proto`, compiled to a descriptor set
(`scripts/gen-proto`) and loaded into a private descriptor pool: no generated code tied to one
protobuf release, and no clash with a client library in the same process that registers the
same message names.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import Message

from sluice import __version__, wire
from sluice.api.access_log import CANCELLED_STATUS, AccessLog
from sluice.api.app import request_id_for
from sluice.api.auth import check_admin, inference_tenant, key_among, listing_reader, statistics_reader
from sluice.api.classification import PARAMETER as CLASSIFICATION
from sluice.api.classification import class_counts
from sluice.api.common import CALLING_KINDS, PRIORITY_HEADER, ROUTE_KEY_HEADER
from sluice.api.errors import LIMIT_HEADER, error_headers, status_of
from sluice.api.kserve import (
    SERVED_EXTENSIONS,
    check_outputs,
    infer_terms,
    model_metadata_of,
    model_ready_of,
    outputs_of,
    request_terms,
)
from sluice.api.kserve_generate import GENERATIVE_KINDS, generate_text, stream_text, text_output, text_request
from sluice.api.tensors import (
    InputTensor,
    Tensor,
    check_no_shared_memory,
    raw_bytes,
    tensor_from_raw,
    tensor_from_values,
)
from sluice.api.tls import TlsConfig
from sluice.api.triton import (
    UNSUPPORTED,
    UNSUPPORTED_GRPC_METHODS,
    load_model_of,
    model_config_of,
    repository_index_of,
    statistics_of,
)
from sluice.errors import ConfigError, DeadlineExceeded, InvalidInput, NotFound, NotSupported, SluiceError, Unavailable
from sluice.gateway import Caller, Gateway
from sluice.gateway.admission import num_batches
from sluice.gateway.cache import cache_policy
from sluice.priority import Priority

log = logging.getLogger("sluice.api.grpc")
T = TypeVar("T")

SERVICE = "inference.GRPCInferenceService"
STREAM_WINDOW = 1024
"""Requests of one `ModelStreamInfer` stream running or answered but not yet sent; the stream is
not read further until one of their answers is sent (the client's sends then wait: flow control,
not memory, holds the excess)."""
FINAL_RESPONSE, EMPTY_FINAL_RESPONSE = "triton_final_response", "triton_enable_empty_final_response"
"""A streamed generation's answers say whether each is the last; its client may ask for an empty
last answer (`enable_empty_final_response` in tritonclient), as Triton sends for decoupled models."""

GRPC_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
"""The HTTP status an error has (`api.errors`) as a gRPC code; anything else is INTERNAL."""

_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
"""Where `InferTensorContents` holds each datatype's elements (FP16 and BF16 have no field: raw only, as in Triton)."""

def _load_messages() -> dict[str, type[Message]]:
    files = descriptor_pb2.FileDescriptorSet.FromString(
        (Path(__file__).parent / "proto" / "grpc_predict_v2.binpb").read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    service = pool.FindServiceByName(SERVICE)
    names = {m.input_type.full_name for m in service.methods} | {m.output_type.full_name for m in service.methods}
    return {name.rpartition(".")[2]: message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
            for name in names}


MESSAGES = _load_messages()
"""The service's request and response classes by name (`ModelInferRequest`, ...)."""
_InferRequest = MESSAGES["ModelInferRequest"]
_InferResponse = MESSAGES["ModelInferResponse"]
_StreamResponse = MESSAGES["ModelStreamInferResponse"]


class _Call:
    """One request's metadata, read once: who, which class, its route key, cache policy, id; and
    for the access log, the tenant and model version it was found to be for. A name given twice
    counts once, its first value, except `tracestate`, whose entries are joined with commas as
    the HTTP path joins its headers (`common`): W3C lets one list be split over several."""

    tenant: str | None = None
    info: wire.ModelInfo | None = None

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.metadata: dict[str, str] = {}
        entries = [(name, value) for name, value in context.invocation_metadata() or ()
                   if isinstance(value, str)]  # binary (-bin) entries are not ours
        for name, value in entries:
            if name == "tracestate" and name in self.metadata:  # one list over several entries (W3C)
                self.metadata[name] += f",{value}"
            else:
                self.metadata.setdefault(name, value)
        self._key: str | None = None
        self._key_error: InvalidInput | None = None
        try:
            self._key = key_among(entries)
        except InvalidInput as exc:  # raised where the key is asked for, within the call's error handling
            self._key_error = exc
        self.request_id = request_id_for(self.metadata.get("x-request-id"))

    def one(self) -> _Call:
        """A copy for one request of a stream: the same metadata, its own tenant and model."""
        copy = object.__new__(_Call)
        copy.metadata, copy.request_id = self.metadata, self.request_id
        copy._key, copy._key_error = self._key, self._key_error
        return copy

    @property
    def key(self) -> str | None:
        """The API key the call presents (`auth.key_among`); raises its `InvalidInput` if ambiguous."""
        if self._key_error is not None:
            raise self._key_error
        return self._key


Answer = Callable[[Any, _Call], Awaitable[Any]]
"""An RPC's answer to its request, given the call's metadata (`KServeGrpc._answered` ends the call with its error)."""


class KServeGrpc:
    """The servicer: each RPC of `inference.GRPCInferenceService` over the gateway."""

    def __init__(self, gateway: Gateway, access_log: AccessLog | None = None) -> None:
        self._gateway = gateway
        self._access_log = access_log

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(rpc: str, method: Answer) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                self._answered(rpc, method), request_deserializer=MESSAGES[f"{rpc}Request"].FromString,
                response_serializer=MESSAGES[f"{rpc}Response"].SerializeToString)

        return grpc.method_handlers_generic_handler(SERVICE, {
            "ServerLive": unary("ServerLive", self.server_live),
            "ServerReady": unary("ServerReady", self.server_ready),
            "ServerMetadata": unary("ServerMetadata", self.server_metadata),
            "ModelReady": unary("ModelReady", self.model_ready),
            "ModelMetadata": unary("ModelMetadata", self.model_metadata),
            "ModelInfer": grpc.unary_unary_rpc_method_handler(
                self.model_infer, request_deserializer=_InferRequest.FromString,
                response_serializer=_InferResponse.SerializeToString),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                self.model_stream_infer, request_deserializer=_InferRequest.FromString,
                response_serializer=_StreamResponse.SerializeToString),
            "ModelConfig": unary("ModelConfig", self.model_config),
            "ModelStatistics": unary("ModelStatistics", self.model_statistics),
            "RepositoryIndex": unary("RepositoryIndex", self.repository_index),
            "RepositoryModelLoad": unary("RepositoryModelLoad", self.repository_model_load),
            "RepositoryModelUnload": unary("RepositoryModelUnload", self.repository_model_unload),
            **{method: grpc.unary_unary_rpc_method_handler(self._answered(method, _refuse(extension)))
               for method, extension in UNSUPPORTED_GRPC_METHODS.items()},  # (bytes in, nothing out)
        })

    def _answered(self, rpc: str, method: Answer) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        """An RPC but inference's: its `SluiceError` ends the call with its code (`_abort`), its
        answer carries the call's `x-request-id`, and either way the call leaves its access-log line."""
        async def answer(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = self._gateway.now()
            call = _Call(context)
            try:
                response = await method(request, call)
            except SluiceError as exc:
                self._log(rpc, call, request, started, exc)
                await _abort(context, exc, call.request_id)
            except asyncio.CancelledError:  # the client cancelled the call, or went away
                self._log(rpc, call, request, started, outcome="cancelled")
                raise
            except Exception as exc:  # a bug of ours: the client learns no more than that
                log.exception("gRPC %s %s failed", rpc, call.request_id)
                self._log(rpc, call, request, started, exc)
                await context.abort(grpc.StatusCode.INTERNAL, "internal server error",
                                    (("x-request-id", call.request_id),))
            context.set_trailing_metadata((("x-request-id", call.request_id),))
            self._log(rpc, call, request, started)
            return response

        return answer

    # -- health and metadata -------------------------------------------------------------------

    async def server_live(self, request: Message, call: _Call) -> Message:
        return MESSAGES["ServerLiveResponse"](live=True)

    async def server_ready(self, request: Message, call: _Call) -> Message:
        return MESSAGES["ServerReadyResponse"](ready=self._gateway.is_ready())

    async def server_metadata(self, request: Message, call: _Call) -> Message:
        """For a caller `GET /v2` would answer: a tenant's key under a tenants file."""
        self._as_tenant(call, lambda tenant: tenant)
        return MESSAGES["ServerMetadataResponse"](name="sluice", version=__version__,
                                                  extensions=list(SERVED_EXTENSIONS))

    async def model_ready(self, request: Any, call: _Call) -> Message:
        def lookup(gateway: Gateway, tenant: str, name: str, version: str | None) -> wire.ModelInfo | None:
            try:
                return model_ready_of(gateway, tenant, name, version)
            except NotFound:  # Triton answers `ready: false` here (the key's 401/403 still end the call)
                return None

        info = self._about_model(request, call, lookup)
        return MESSAGES["ModelReadyResponse"](ready=info is not None)

    async def model_metadata(self, request: Any, call: _Call) -> Message:
        found = self._about_model(request, call, model_metadata_of)
        tensor = MESSAGES["ModelMetadataResponse"].TensorMetadata  # type: ignore[attr-defined]
        return MESSAGES["ModelMetadataResponse"](
            name=found["name"], versions=found["versions"], platform=found["platform"],
            inputs=[tensor(**spec) for spec in found["inputs"]], outputs=[tensor(**spec) for spec in found["outputs"]])

    async def model_config(self, request: Any, call: _Call) -> Message:
        config = self._about_model(request, call, model_config_of)
        return json_format.ParseDict({"config": config}, MESSAGES["ModelConfigResponse"]())

    async def model_statistics(self, request: Any, call: _Call) -> Message:
        # under `[metrics] access = "keys"`, a metrics or admin key's (`statistics_reader`)
        reader = call.tenant = statistics_reader(call.key, self._gateway.tenancy)
        statistics = statistics_of(self._gateway, reader, request.name or None, request.version or None)
        return json_format.ParseDict(statistics, MESSAGES["ModelStatisticsResponse"]())

    async def repository_index(self, request: Any, call: _Call) -> Message:
        reader = call.tenant = listing_reader(call.key, self._gateway.tenancy)  # an admin key's sees every model
        index = repository_index_of(self._gateway, reader, request.ready)
        return json_format.ParseDict({"models": index}, MESSAGES["RepositoryIndexResponse"]())

    async def repository_model_load(self, request: Any, call: _Call) -> Message:
        return await self._load(request, call, "RepositoryModelLoadResponse")

    async def repository_model_unload(self, request: Any, call: _Call) -> Message:
        return await self._load(request, call, "RepositoryModelUnloadResponse", unload=True)

    async def _load(self, request: Any, call: _Call, response: str, *, unload: bool = False) -> Message:
        """`api.triton.load_model_of`, for the admin."""
        check_admin(call.key, self._gateway.tenancy)
        await load_model_of(self._gateway, request.model_name, unload=unload,
                            parameters={name: True for name in request.parameters})
        return MESSAGES[response]()

    def _about_model(self, request: Any, call: _Call, lookup: Callable[[Gateway, str, str, str | None], T]) -> T:
        """`lookup` (`kserve.model_ready_of`, `model_metadata_of`, ...) for the calling tenant."""
        return self._as_tenant(
            call, lambda tenant: lookup(self._gateway, tenant, request.name, request.version or None))

    def _as_tenant(self, call: _Call, answer: Callable[[str], T]) -> T:
        """`answer` for the calling tenant (found by its key, which may be refused: a `SluiceError`)."""
        tenant = call.tenant = inference_tenant(call.key, self._gateway.tenancy)
        return answer(tenant)

    # -- inference ------------------------------------------------------------------------------

    async def model_infer(self, request: Any, context: grpc.aio.ServicerContext) -> Message:
        arrived_at = self._gateway.now()
        call = _Call(context)
        try:
            response, headers = await self._infer(request, call, arrived_at, context.time_remaining())
            assert response is not None  # only a streamed generation ends without one
        except SluiceError as exc:
            self._log("ModelInfer", call, request, arrived_at, exc)
            await _abort(context, exc, call.request_id)
        except asyncio.CancelledError:  # the client cancelled the call, or went away
            self._log("ModelInfer", call, request, arrived_at, outcome="cancelled")
            raise
        except Exception as exc:  # a bug of ours: the client learns no more than that
            log.exception("gRPC ModelInfer %s failed", call.request_id)
            self._log("ModelInfer", call, request, arrived_at, exc)
            await context.abort(grpc.StatusCode.INTERNAL, "internal server error",
                                (("x-request-id", call.request_id),))
        context.set_trailing_metadata(_metadata({**headers, "x-request-id": call.request_id}))
        self._log("ModelInfer", call, request, arrived_at)
        return response

    def _log(self, rpc: str, call: _Call, request: Any, arrived_at: float, error: Exception | None = None,
             outcome: str | None = None) -> None:
        """The access-log line of one call, or of one request of a stream (`api.access_log`): answered,
        or `error`; its model the version it was routed to, else the one the request names."""
        if self._access_log is None:
            return
        if outcome == "cancelled":
            status, code = CANCELLED_STATUS, grpc.StatusCode.CANCELLED
        elif error is None:
            status, code = 200, grpc.StatusCode.OK
        else:
            status = status_of(error).http
            code = _grpc_code(status)
        info = call.info
        model, version = (info.name, info.version) if info is not None else _model_named(request)
        self._access_log.grpc(
            rpc, status, code.name, request_id=call.request_id, tenant=call.tenant, model=model,
            version=version, started=arrived_at,
            limit=error_headers(error).get(LIMIT_HEADER) if isinstance(error, Unavailable) else None, outcome=outcome)

    async def model_stream_infer(self, requests: AsyncIterator[Any],
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        """Reads requests while earlier ones run and answers each when it ends; a failed request's
        answer carries its message and its `id`. At most `STREAM_WINDOW` requests are running or
        waiting for their answer to be sent. The stream ends once the client has closed its side
        and every request is answered."""
        call = _Call(context)
        # each request's answers (a streamed generation's: one per chunk), and whether it is done
        answers: asyncio.Queue[tuple[Message | None, bool] | None] = asyncio.Queue()
        window = asyncio.Semaphore(STREAM_WINDOW)
        running: set[asyncio.Task[None]] = set()

        async def answer(request: Any, arrived_at: float) -> None:
            one = call.one()  # its own tenant and model, for its access-log line

            def chunk(response: Message) -> None:
                answers.put_nowait((_StreamResponse(infer_response=response), False))

            try:
                response, _ = await self._infer(request, one, arrived_at, context.time_remaining(), chunk)
                answers.put_nowait((None if response is None else _StreamResponse(infer_response=response), True))
                self._log("ModelStreamInfer", one, request, arrived_at)
            except asyncio.CancelledError:
                self._log("ModelStreamInfer", one, request, arrived_at, outcome="cancelled")
                raise
            except Exception as exc:  # every request is answered, a failed one with its reason
                self._log("ModelStreamInfer", one, request, arrived_at, exc)
                if not isinstance(exc, SluiceError):
                    log.exception("gRPC ModelStreamInfer request %r failed", request.id)
                answers.put_nowait((_stream_error(request, one.info, exc), True))

        async def read() -> None:
            try:
                unread = aiter(requests)
                while True:
                    await window.acquire()  # before reading: a request waits in the stream, not here
                    try:
                        request = await anext(unread)
                    except StopAsyncIteration:
                        break
                    task = asyncio.create_task(answer(request, self._gateway.now()))
                    running.add(task)
                    task.add_done_callback(running.discard)
                if running:
                    await asyncio.wait(set(running))
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await answers.get()) is not None:
                response, is_done = item
                if response is not None:
                    yield response
                if is_done:
                    window.release()  # once sent: a client that does not read its answers is not read either
            await reader  # raises what ended the reading, if it failed
        finally:
            reader.cancel()
            for task in running:
                task.cancel()

    async def _infer(self, request: Any, call: _Call, arrived_at: float, time_remaining_s: float | None,
                     chunk: Callable[[Message], None] | None = None) -> tuple[Message | None, dict[str, str]]:
        """The answer to `request` and its trailing metadata. `chunk`, on a stream, takes a
        streamed generation's answers as they come; its last answer is then returned (None when
        the last chunk, sent to `chunk`, was that final answer)."""
        gateway = self._gateway
        tenant = call.tenant = inference_tenant(call.key, gateway.tenancy)
        info = call.info = gateway.resolve(request.model_name, request.model_version or None,
                                           call.metadata.get(ROUTE_KEY_HEADER), tenant=tenant)
        if info.kind in GENERATIVE_KINDS:  # text in, text out (`kserve_generate`)
            return await self._generate(request, call, info, tenant, arrived_at, time_remaining_s, chunk)
        with gateway.reading(info, tenant, arrived_at,
                             _trace_context(call) if gateway.is_tracing else None):
            terms = infer_terms(info, _tensors(request), _parameters(request.parameters),
                                call.metadata.get(PRIORITY_HEADER), gateway.max_timeout_s)
            check_outputs(info, [o.name for o in request.outputs])  # whatever they ask, they come back raw
            classes = class_counts(info, _classifications(request))
        timeout_s = _deadline_s(terms.timeout_s, time_remaining_s, gateway.max_timeout_s)
        who = self._caller(call, tenant, terms.priority, terms.tokens, terms.likely_tokens,
                           is_traced=info.kind in CALLING_KINDS)
        key = gateway.cache_key(info, terms.payload, who)
        gateway.shed_if_overloaded(info, timeout_s, arrived_at, who, key, num_batches(info, terms.payload))
        result = await gateway.infer(info, terms.payload, timeout_s, arrived_at=arrived_at, caller=who, key=key,
                                     routed=not request.model_version)
        names = [o.name for o in request.outputs] or None
        return _response(info, request.id, result.payload, names, classes), result.headers or {}

    async def _generate(self, request: Any, call: _Call, info: wire.ModelInfo, tenant: str, arrived_at: float,
                        time_remaining_s: float | None, chunk: Callable[[Message], None] | None
                        ) -> tuple[Message | None, dict[str, str]]:
        gateway = self._gateway
        with gateway.reading(info, tenant, arrived_at,
                             _trace_context(call) if gateway.is_tracing else None):
            parameters = _parameters(request.parameters)
            timeout_s, priority = request_terms(parameters, call.metadata.get(PRIORITY_HEADER), gateway.max_timeout_s)
            text = text_request(info, _tensors(request), parameters,
                                stream_route=None if chunk is not None else "gRPC ModelStreamInfer")
            names = [o.name for o in request.outputs] or None
            check_outputs(info, names or [])
            classes = class_counts(info, _classifications(request))
        # untraced too, as /v1/completions: an upstream call carries the client's trace on
        who = self._caller(call, tenant, priority, is_traced=True)
        deadline_s = _deadline_s(timeout_s, time_remaining_s, gateway.max_timeout_s)
        if not text.is_stream:
            texts, headers = await generate_text(gateway, who, info, text, deadline_s, arrived_at)
            return _response(info, request.id, text_output(texts), names, classes), headers or {}
        assert chunk is not None
        # As Triton's LLM backends: the last chunk is the final answer, text and all; with an empty
        # final answer asked for, that comes after the text instead. A stream whose last chunk was
        # not known as such (an upstream server's) ends with the empty final answer either way.
        wants_empty_final = parameters.get(EMPTY_FINAL_RESPONSE) is True
        is_ended = False
        async with aclosing(stream_text(gateway, who, info, text, deadline_s, arrived_at)) as pieces:
            async for piece in pieces:
                is_ended = piece.is_last and not wants_empty_final
                if piece.text or is_ended:
                    chunk(_response(info, request.id, text_output([piece.text]), names, classes,
                                    is_final=is_ended))
        if is_ended:
            return None, {}
        final = _InferResponse(model_name=info.name, model_version=info.version, id=request.id)
        final.parameters[FINAL_RESPONSE].bool_param = True  # type: ignore[attr-defined]
        return final, {}

    def _caller(self, call: _Call, tenant: str, priority: Priority | None, tokens: float = 0.0,
                likely_tokens: float | None = None, *, is_traced: bool = False) -> Caller:
        """`is_traced`: the caller's trace context is read even when this server does not trace."""
        trace = _trace_context(call) if is_traced or self._gateway.is_tracing else None
        return Caller(tenant, priority, tokens, trace, cache_policy(call.metadata.get("cache-control")),
                      likely_tokens=likely_tokens)


def _trace_context(call: _Call) -> wire.TraceContext | None:
    """The caller's W3C trace context: its `traceparent` metadata and the `tracestate` with it."""
    traceparent = call.metadata.get("traceparent")
    if traceparent is None:
        return None
    return wire.TraceContext(traceparent, call.metadata.get("tracestate", ""))


def _refuse(extension: str) -> Answer:
    """A method of an extension sluice does not offer (`triton.UNSUPPORTED`): UNIMPLEMENTED, saying why."""
    async def refused(request: bytes, call: _Call) -> NoReturn:
        raise NotSupported(UNSUPPORTED[extension])

    return refused


def _model_named(request: Any) -> tuple[str | None, str | None]:
    """The model and version a request message names (`model_name`/`model_version`, or
    `name`/`version`), if its RPC has them."""
    fields = request.DESCRIPTOR.fields_by_name if isinstance(request, Message) else {}
    for name, version in (("model_name", "model_version"), ("name", "version")):
        if name in fields:
            return getattr(request, name) or None, (getattr(request, version) or None) if version in fields else None
    return None, None


def _parameters(parameters: Any) -> dict[str, Any]:
    """A parameter map's values as Python values (an unset `InferParameter` is None)."""
    values = {}
    for name, parameter in parameters.items():
        which = parameter.WhichOneof("parameter_choice")
        values[name] = None if which is None else getattr(parameter, which)
    return values


def _deadline_s(timeout_s: float | None, time_remaining_s: float | None, max_timeout_s: float) -> float | None:
    """The request's timeout: its `timeout` parameter or the call's gRPC deadline, the earlier. A
    gRPC deadline further off than the gateway allows is cut to its limit (it is the client's
    patience, not a demand for a longer queue)."""
    if time_remaining_s is None:
        return timeout_s
    if time_remaining_s <= 0:
        raise DeadlineExceeded("the call's deadline passed before the request was read")
    remaining = min(time_remaining_s, max_timeout_s)
    return remaining if timeout_s is None else min(timeout_s, remaining)


def _tensors(request: Any) -> list[Tensor]:
    if not request.inputs:
        raise InvalidInput("inference request has no inputs", param="inputs")
    raw: Sequence[bytes] = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(f"raw_input_contents holds {len(raw)} entries for {len(request.inputs)} inputs: "
                           "give one per input, or none")
    tensors = []
    for output in request.outputs:
        check_no_shared_memory(f"output {output.name!r}", output.parameters)
    for i, tensor in enumerate(request.inputs):
        check_no_shared_memory(f"input {tensor.name!r}", tensor.parameters)
        spec = InputTensor(name=tensor.name, shape=list(tensor.shape), datatype=tensor.datatype)
        typed = [field.name for field, _ in tensor.contents.ListFields()]  # the typed fields that hold elements
        if raw:
            if typed:  # which one is meant? (Triton refuses it too)
                raise InvalidInput(f"input {tensor.name!r} has elements both in raw_input_contents and in "
                                   f"contents.{typed[0]}: give them in one place", param=tensor.name)
            tensors.append(tensor_from_raw(spec, raw[i]))
            continue
        field = _CONTENTS_FIELD.get(tensor.datatype)
        if field is None:
            raise InvalidInput(f"input {tensor.name!r}: {tensor.datatype} data must be sent in raw_input_contents")
        if typed and typed != [field]:
            raise InvalidInput(f"input {tensor.name!r}: {tensor.datatype} elements go in contents.{field}, got "
                               f"contents.{typed[0]}", param=tensor.name)
        tensors.append(tensor_from_values(spec, list(getattr(tensor.contents, field))))
    return tensors


def _classifications(request: Any) -> list[tuple[str, Any]]:
    """Each requested output's name and its `classification` parameter (None if it has none)."""
    return [(o.name, _parameters(o.parameters).get(CLASSIFICATION)) for o in request.outputs]


def _response(info: wire.ModelInfo, request_id: str, payload: wire.Payload, names: list[str] | None,
              classes: dict[str, int], *, is_final: bool | None = None) -> Message:
    """The answer with its outputs (those asked for, else all; `classes`: as their top classes)
    raw (`raw_output_contents`), where tritonclient reads them. `is_final`: a streamed
    generation's answer says whether it is the request's last (Triton's `triton_final_response`)."""
    outputs = outputs_of(info, payload, names, classes)
    response = _InferResponse(
        model_name=info.name, model_version=info.version, id=request_id,
        outputs=[_InferResponse.InferOutputTensor(  # type: ignore[attr-defined]
            name=output.name, datatype=output.datatype, shape=output.shape) for output in outputs],
        raw_output_contents=[raw_bytes(output) for output in outputs])
    if is_final is not None:
        response.parameters[FINAL_RESPONSE].bool_param = is_final  # type: ignore[attr-defined]
    return response


def _stream_error(request: Any, info: wire.ModelInfo | None, error: Exception) -> Message:
    """A stream's answer to a request that failed: its message (naming the request's `id`, which
    tritonclient hands its callback the message alone of), its `id`, and `triton_final_response`
    true, since nothing more comes for it (a streamed generation may have sent chunks before). It
    names the version chosen (`info`) once one was, as a success does."""
    message = error.message if isinstance(error, SluiceError) else "internal server error"
    name, version = (info.name, info.version) if info is not None else (request.model_name, request.model_version)
    response = _InferResponse(model_name=name, model_version=version, id=request.id)
    response.parameters[FINAL_RESPONSE].bool_param = True  # type: ignore[attr-defined]
    return _StreamResponse(error_message=f"request {request.id!r}: {message}" if request.id else message,
                           infer_response=response)


def _metadata(headers: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((name.lower(), value) for name, value in headers.items())


def _grpc_code(http_status: int) -> grpc.StatusCode:
    code = GRPC_CODES.get(http_status)
    if code is None:
        code = grpc.StatusCode.INVALID_ARGUMENT if 400 <= http_status < 500 else grpc.StatusCode.INTERNAL
    return code


async def _abort(context: grpc.aio.ServicerContext, error: SluiceError, request_id: str) -> NoReturn:
    """Ends the call with the error's code, message and retry metadata (never returns)."""
    code = _grpc_code(status_of(error).http)
    await context.abort(code, error.message, _metadata({**error_headers(error), "x-request-id": request_id}))
    raise AssertionError("context.abort returned")  # it raises


async def start_server(gateway: Gateway, host: str, port: int, max_message_bytes: int,
                       tls: TlsConfig | None = None, *, access_log: bool = True) -> tuple[grpc.aio.Server, int]:
    """Serve the gRPC API on `host:port` (0: any free port), over TLS if `tls` is given; returns
    the server and its port. Messages over `max_message_bytes` (the HTTP body limit) are refused
    by gRPC itself (RESOURCE_EXHAUSTED), a compressed one (tritonclient's `compression_algorithm`,
    gzip or deflate, which grpcio's server takes with no option) by the size it inflates to.
    `access_log`: a line per call, and per request of a stream (`api.access_log`)."""
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),  # a port another server holds is an error, not shared
    ])
    server.add_generic_rpc_handlers((KServeGrpc(gateway, AccessLog(gateway.now) if access_log else None).handler(),))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, tls.grpc_credentials())
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen for gRPC on {address}: {exc}") from exc
    await server.start()
    return server, bound
