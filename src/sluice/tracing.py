"""OpenTelemetry traces: one span per inference request at the gateway, its queue wait and its
device execution as child spans.

    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT set
        ─▶ OTLP/HTTP exporter, spans batched and sent from a background thread
    neither set (or OTEL_SDK_DISABLED=true, or OTEL_TRACES_EXPORTER=none)
        ─▶ tracing off: `Tracing.is_enabled` is False and nothing is done per request

A request's spans are written when it ends, with their real start and end times: the gateway
knows when it admitted the request, and the worker's answer says how long it queued and how long
its batch ran (`wire.Result.queue_s`, `exec_s`), so worker processes need no tracing SDK and the
device path pays nothing for it. An incoming W3C `traceparent` header (HTTP, or gRPC metadata)
makes the request's span a child of the caller's trace, and the `tracestate` that came with it is
the span's too (OpenTelemetry's propagator reads both). Attributes follow OpenTelemetry's GenAI
semantic conventions where they apply (`gen_ai_attributes`: the operation, the model, the
sampling asked for, the tokens used, why generation stopped), beside sluice's own.

A request whose worker calls another server (`openai-upstream`, `http-single`) has its span
started when it is sent (`begin`), so that the call's own `traceparent` names it (`outgoing`),
with the caller's `tracestate`: the upstream's spans join the same trace. With tracing off, the
caller's trace context is passed on unchanged if well formed (`passed_on`), as W3C Trace Context
asks of a server that does not trace. Span attributes name the model, tenant, class, outcome and
batch; never the input or prompt text.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.propagate import get_global_textmap
from opentelemetry.trace import NonRecordingSpan, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sluice import wire
from sluice.clock import Clock, MonotonicClock
from sluice.metrics import tenant_label

log = logging.getLogger("sluice.tracing")

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_NOT_ERRORS = frozenset({"ok", "invalid", "rate_limited", "cancelled"})
"""Outcomes whose span keeps an unset status: the client's bad input (400) and its tenant's limits
(429) are 4xx, which OpenTelemetry's HTTP conventions leave unset on a server span; and a client
that went away (`cancelled`) is no failure of the server's: its span has a `sluice.cancelled` event."""


class Tracing:
    """Writes finished requests as spans; a no-op without a tracer provider."""

    def __init__(self, provider: Any | None = None, clock: Clock | None = None) -> None:
        self._provider = provider
        self._clock = clock or MonotonicClock()
        self._tracer: Any = None
        if provider is not None:
            self._tracer = provider.get_tracer("sluice")
            self._propagator = get_global_textmap()

    @property
    def is_enabled(self) -> bool:
        return self._tracer is not None

    def begin(self, *, trace_context: wire.TraceContext | None, started: float) -> Any:
        """The span of a request that reached the gateway at `started` (the gateway's clock),
        started now and ended by `request(span=...)`; None with tracing off. `trace_context`: the
        caller's, whose trace (and `tracestate`) the span joins."""
        if self._tracer is None:
            return None
        start_ns = time.time_ns() - int(max(self._clock.now() - started, 0.0) * 1e9)
        parent = self._propagator.extract(trace_context.headers()) if trace_context is not None else None
        return self._tracer.start_span("sluice.request", context=parent, kind=SpanKind.SERVER, start_time=start_ns)

    def outgoing(self, span: Any) -> wire.TraceContext | None:
        """The trace context that makes a call's spans children of `span` (from `begin`): its
        `traceparent`, and the `tracestate` it carries from the caller."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        if "traceparent" not in carrier:
            return None
        return wire.TraceContext(carrier["traceparent"], carrier.get("tracestate", ""))

    def request(
        self, *, model: str, version: str, tenant: str, priority: str, trace_context: wire.TraceContext | None,
        started: float,
        outcome: str, attributes: Mapping[str, str | int | float | list[str]] = {}, queue_s: float | None = None,
        exec_s: float | None = None, span: Any = None,
    ) -> None:
        """A request that reached the gateway at `started` (the gateway's clock) and ended now;
        `span`: its span if `begin` started it already.

        With the worker's `queue_s` and `exec_s`, its last `exec_s` seconds are an execution
        span and the `queue_s` before them a queue span."""
        if self._tracer is None:
            return
        if span is None:
            span = self.begin(trace_context=trace_context, started=started)
        now_ns = time.time_ns()
        start_ns = getattr(span, "start_time", None) or now_ns - int(max(self._clock.now() - started, 0.0) * 1e9)
        span.set_attributes({"gen_ai.request.model": model, "sluice.model": model, "sluice.model_version": version,
                             "sluice.tenant": tenant_label(tenant), "sluice.priority": priority,
                             "sluice.outcome": outcome, **attributes})
        if outcome not in _NOT_ERRORS:
            span.set_status(Status(StatusCode.ERROR, outcome))
        elif outcome == "cancelled":
            span.add_event("sluice.cancelled", {"reason": "the client went away before its answer"}, timestamp=now_ns)
        if exec_s is not None and queue_s is not None:
            inside = trace.set_span_in_context(span)
            exec_start_ns = max(now_ns - int(exec_s * 1e9), start_ns)
            queue_start_ns = max(exec_start_ns - int(queue_s * 1e9), start_ns)
            self._tracer.start_span("sluice.queue", context=inside, start_time=queue_start_ns).end(exec_start_ns)
            self._tracer.start_span("sluice.execute", context=inside, start_time=exec_start_ns).end(now_ns)
        span.end(now_ns)

    def shutdown(self) -> None:
        """Send what is still buffered (at most a few seconds' wait) and stop the exporter."""
        if self._provider is not None:
            self._provider.shutdown()


_W3C = TraceContextTextMapPropagator()


def passed_on(given: wire.TraceContext | None) -> wire.TraceContext | None:
    """What a server that does not trace sends on of its caller's trace context: the same, if
    its `traceparent` is well formed (read by OpenTelemetry's W3C propagator); else nothing, as
    a `tracestate` means nothing without its `traceparent`. A `tracestate` that is not well
    formed is dropped, its `traceparent` kept."""
    if given is None:
        return None
    context = trace.get_current_span(_W3C.extract(given.headers())).get_span_context()
    if not context.is_valid:
        return None
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=trace.set_span_in_context(NonRecordingSpan(context)))
    return wire.TraceContext(carrier["traceparent"], carrier.get("tracestate", ""))


def gen_ai_attributes(request: wire.Payload | None, answer: wire.Payload | None,
                      num_tokens: int) -> dict[str, str | int | float | list[str]]:
    """OpenTelemetry's GenAI attributes (semantic conventions 1.37) of a request, from what it asked
    and, if answered, its answer (`num_tokens`: the tokens a one-shot answer counted). Counts and
    settings only: never a prompt, an input or an output."""
    attributes: dict[str, str | int | float | list[str]] = {}
    if isinstance(request, wire.GeneratePayload):
        attributes["gen_ai.operation.name"] = "chat" if request.messages is not None else "text_completion"
        attributes["gen_ai.request.max_tokens"] = request.max_tokens
        attributes["gen_ai.request.temperature"] = request.temperature
        attributes["gen_ai.request.top_p"] = request.top_p
        if request.n != 1:
            attributes["gen_ai.request.choice.count"] = request.n
        if request.seed is not None:
            attributes["gen_ai.request.seed"] = request.seed
    elif isinstance(request, wire.TextPayload | wire.TokensPayload):
        attributes["gen_ai.operation.name"] = "embeddings"
        if answer is not None:
            attributes["gen_ai.usage.input_tokens"] = num_tokens
    if isinstance(answer, wire.GenerationResult):
        attributes["gen_ai.usage.input_tokens"] = answer.num_prompt_tokens
        attributes["gen_ai.usage.output_tokens"] = answer.num_output_tokens
        attributes["gen_ai.response.finish_reasons"] = [answer.finish_reason,
                                                        *(choice.finish_reason for choice in answer.choices)]
    return attributes


def from_environment(clock: Clock, service_name: str = "sluice") -> Tracing:
    """Tracing as the standard `OTEL_*` variables ask: on with an OTLP/HTTP exporter when an
    endpoint is set (`OTEL_SERVICE_NAME`, headers and timeouts are read by the SDK too)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return Tracing()
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none":
        return Tracing()
    if not any(os.environ.get(name) for name in _ENDPOINT_VARIABLES):
        return Tracing()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    log.info("tracing: OpenTelemetry spans go to %s",
             next(os.environ[name] for name in _ENDPOINT_VARIABLES if os.environ.get(name)))
    return Tracing(provider, clock)
