"""One admitted request at the gateway: its accounting while it runs, and its answer.

    Admission.admit ──▶ Ticket ──(async with: dispatch, stream)──▶ __aexit__: outcome metric,
                                                                  tenant metrics, settle limits
    worker's wire.Result ──interpret()──▶ InferResult, or the error in `sluice.errors` it means

*After the answer.* The task that writes a one-shot HTTP answer (`api.http_protocol`) calls
`defer_accounting()` first: a ticket closed in that task then leaves its metrics and its local
settlement in the returned list, which the task runs right after writing the answer, in the same
step (nothing else runs in between, so no other request, metrics scrape or admission can see the
ticket unsettled). This takes ~0.1 ms of bookkeeping off a lone request's latency. A settlement
that goes to Redis, or that a request group shares, is not deferred: a client that sends its next
request as soon as it has this answer must find this one's concurrency slot freed.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from sluice import wire
from sluice.clock import Clock
from sluice.errors import (
    DeadlineExceeded,
    DeadlineUnreachable,
    DeviceFailed,
    InvalidInput,
    ItemFailed,
    ModelNotReady,
    Overloaded,
    Unavailable,
    UpstreamRefused,
    WorkerLost,
)
from sluice.gateway.cache import CACHE_HEADER
from sluice.gateway.limits import Reservation
from sluice.gateway.tenancy import RequestGroup, Tenancy, rate_limit_headers
from sluice.metrics import GatewayMetrics
from sluice.priority import Priority
from sluice.tracing import Tracing, gen_ai_attributes, passed_on

__all__ = ["InferResult", "Ticket", "defer_accounting", "interpret", "run_deferred"]

log = logging.getLogger("sluice.gateway")

_DEFERRED: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar(
    "sluice_deferred_accounting", default=None)


def defer_accounting() -> list[Callable[[], None]]:
    """From now on in the calling task, closed tickets leave their local accounting in the list
    returned, for the caller to run once its answer is written (see the module's docstring)."""
    deferred: list[Callable[[], None]] = []
    _DEFERRED.set(deferred)
    return deferred


def run_deferred(deferred: list[Callable[[], None]]) -> None:
    """Run (and empty) what `defer_accounting` collected; a failing one is logged, the rest still run."""
    while deferred:
        account = deferred.pop(0)
        try:
            account()
        except Exception:
            log.exception("a request's accounting failed")



@dataclass(frozen=True, slots=True)
class InferResult:
    model: wire.ModelInfo
    payload: wire.Payload
    num_tokens: int
    queue_s: float
    exec_s: float
    batch_size: int
    device_s: float = 0.0
    headers: dict[str, str] | None = None
    """For the HTTP answer: the tenant's `x-ratelimit-*`, and `x-sluice-cache` if it did not run for
    this request (`gateway.cache`)."""
    is_cached: bool = False
    """Answered from the result cache: nothing ran on a device for this request."""


class Ticket:
    """One admitted request's accounting: the outcome metric, the tenant's metrics, and the
    settlement of its reservation, whatever way it ends (`async with`)."""

    def __init__(self, metrics: GatewayMetrics, tenancy: Tenancy, clock: Clock, info: wire.ModelInfo, tenant: str,
                 priority: Priority, reservation: Reservation, started: float, deadline: float,
                 tracing: Tracing | None = None, trace_context: wire.TraceContext | None = None,
                 observer: Callable[[Ticket, str, InferResult | None], None] | None = None,
                 client_deadline: bool = False, group: RequestGroup | None = None, background: bool = False) -> None:
        self._metrics = metrics
        self._tenancy = tenancy
        self._clock = clock
        self.info = info
        self.tenant = tenant
        self.priority = priority
        self.reservation = reservation
        self.started = started
        self.deadline = deadline
        self._tracing = tracing
        self._trace_context = trace_context
        """The caller's W3C trace context, if it sent one."""
        self._span: Any = None
        self._request: wire.Payload | None = None
        """What was asked (`about`), for the span's GenAI attributes."""
        """The request's span once `outgoing_trace` started it (tracing on)."""
        self._observer = observer
        """Told each outcome and result (the model's canary judges versions by them)."""
        self.client_deadline = client_deadline
        """The deadline is the client's (a header or parameter), not the model's SLO."""
        self.background = background
        """A batch job's item (`Caller.background`)."""
        self._group = group
        """The client request this is a part of, whose reservation it shares (settled by the last part)."""
        self._result: InferResult | None = None
        self._first_chunk_at: float | None = None
        self._last_chunk_at = 0.0
        self._used: tuple[float, float] | None = None
        """(tokens, device seconds) the worker reported so far, whatever the outcome."""
        self._streamed_tokens = 0

    def done(self, result: InferResult) -> None:
        self._result = result

    def about(self, request: wire.Payload) -> None:
        """The request this ticket admits (its span says what it asked for, never its text)."""
        self._request = request

    def outgoing_trace(self) -> wire.TraceContext | None:
        """The trace context the worker's calls to another server carry (an `openai-upstream`'s,
        an `http-single`'s): this request's span, started on first use, with the caller's
        `tracestate`; with tracing off, the caller's own (passed on unchanged if well formed, as
        W3C Trace Context asks of a server that does not trace), or None."""
        if self._tracing is None or not self._tracing.is_enabled:
            return passed_on(self._trace_context)
        if self._span is None:
            self._span = self._tracing.begin(trace_context=self._trace_context, started=self.started)
        return self._tracing.outgoing(self._span)

    def used(self, result: wire.Result) -> None:
        """What the worker reports the request used, also when it did not succeed (a missed
        deadline, a failure): the tenant pays for the device's work. Never less than what its
        streamed chunks already showed."""
        self.charge(result.num_tokens, result.device_s)

    def charge(self, tokens: float, device_s: float) -> None:
        """Tokens and device time the request used (e.g. none of the device's, answered from the cache)."""
        used_tokens, used_device_s = self._used or (0.0, 0.0)
        self._used = (max(used_tokens, tokens), max(used_device_s, device_s))

    def with_limits(self, result: InferResult) -> InferResult:
        """The result with the tenant's `x-ratelimit-*` headers (unchanged if it has no limits)."""
        if not self.reservation.statuses:
            return result
        return replace(result, headers={**(result.headers or {}), **self.limit_headers()})

    def limit_headers(self) -> dict[str, str]:
        """The tenant's `x-ratelimit-*` headers as of its admission (empty if it has no limits)."""
        return rate_limit_headers(self.reservation.statuses)

    def chunk(self, chunk: wire.TokenChunk) -> None:
        self._streamed_tokens += len(chunk.token_ids)
        self._used = (chunk.num_prompt_tokens + self._streamed_tokens, chunk.device_s)
        now = self._clock.now()
        if self._first_chunk_at is None:
            self._first_chunk_at = now
            self._metrics.first_token(self.info.name, now - self.started)
        else:
            self._metrics.inter_token(self.info.name, now - self._last_chunk_at)
        self._last_chunk_at = now

    async def __aenter__(self) -> Ticket:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        result = self._result
        if error is None or (result is not None and isinstance(error, GeneratorExit | asyncio.CancelledError)):
            outcome = "ok"  # (a stream's reader may stop once it has the final result)
        else:
            outcome = next((name for cls, name in _OUTCOME_CLASSES if isinstance(error, cls)), "error")
        ended_at = self._clock.now()
        tokens, device_s = self._usage(outcome)
        refund = outcome in ("rejected", "unavailable")
        deferred = _DEFERRED.get()
        if deferred is not None and self._group is None and self._tenancy.settles_locally(self.reservation):
            deferred.append(functools.partial(self._account, outcome, result, ended_at, tokens, device_s, refund))
            return
        self._record(outcome, result, ended_at, device_s)
        if self._group is not None:
            totals = self._group.leave(tokens, device_s, refund)
            if totals is None:
                return  # the group's last part settles for all of them
            tokens, device_s, refund = totals
        await self._tenancy.settle(self.reservation, tokens, device_s, refund_request=refund)

    def _account(self, outcome: str, result: InferResult | None, ended_at: float, tokens: float, device_s: float,
                 refund: bool) -> None:
        """The whole accounting of a ticket that settles locally, after its answer was written."""
        self._record(outcome, result, ended_at, device_s)
        self._tenancy.settle_now(self.reservation, tokens, device_s, refund_request=refund)

    def _record(self, outcome: str, result: InferResult | None, ended_at: float, device_s: float) -> None:
        """The outcome's metrics, the observer and the trace, as of `ended_at`."""
        label = self.priority.label
        if outcome == "ok" and result is not None:
            self._metrics.tenant_completed(self.tenant, label, None if result.is_cached else result.queue_s, device_s,
                                           on_time=ended_at <= self.deadline)
            if isinstance(result.payload, wire.GenerationResult) and not result.is_cached:
                ttft_s = None if self._first_chunk_at is None else self._first_chunk_at - self.started
                self._metrics.generation_done(self.info.name, result.payload, ended_at - self.started, ttft_s)
        else:  # admitted (counted in `sluice_tenant_admitted_total`), so never a tenant's refusal as well
            self._metrics.tenant_used(self.tenant, label, device_s)
        self._metrics.request_done(self.info.name, self.info.version, outcome, ended_at - self.started,
                                   client_deadline=self.client_deadline)
        if self._observer is not None:
            self._observer(self, outcome, result)
        if self._tracing is not None and self._tracing.is_enabled:
            self._trace(outcome, result)

    def _usage(self, outcome: str) -> tuple[float, float]:
        """(tokens, device seconds) to charge. A request withdrawn before the worker reported
        anything (the client went away from an unstreamed generation) is charged its reserved
        token estimate: the worker may have done all of that work, and charging nothing would
        make hanging up a way around the tenant's limits."""
        if self._used is not None:
            return self._used
        if outcome == "cancelled":
            return self.reservation.tokens, 0.0
        return 0.0, 0.0

    def _trace(self, outcome: str, result: InferResult | None) -> None:
        assert self._tracing is not None
        attributes = gen_ai_attributes(self._request, result.payload if result else None,
                                       result.num_tokens if result else 0)
        ran = result is not None and not result.is_cached
        if result is not None and result.is_cached:  # nothing queued or ran for it: no such spans
            attributes |= {"sluice.cache": (result.headers or {}).get(CACHE_HEADER, "hit"),
                           "sluice.tokens": result.num_tokens}
        elif result is not None:
            attributes |= {"sluice.batch_size": result.batch_size, "sluice.device_seconds": result.device_s,
                           "sluice.tokens": result.num_tokens}
        self._tracing.request(model=self.info.name, version=self.info.version, tenant=self.tenant,
                              priority=self.priority.label, trace_context=self._trace_context, started=self.started,
                              outcome=outcome, attributes=attributes,
                              queue_s=result.queue_s if result and ran else None,
                              exec_s=result.exec_s if result and ran else None, span=self._span)


_OUTCOME_CLASSES: tuple[tuple[type[BaseException], str], ...] = (
    (Overloaded, "rejected"),
    (DeadlineExceeded, "expired"),
    (InvalidInput, "invalid"),  # the client's input (a malformed item, an upstream's 4xx): not a failure of ours
    (DeviceFailed, "failed"),
    (WorkerLost, "failed"),
    (Unavailable, "unavailable"),
    (asyncio.CancelledError, "cancelled"),
    (GeneratorExit, "cancelled"),
)


def is_device_failure(result: wire.Result) -> bool:
    """The request failed for its device's fault alone (every error transient, none an upstream's
    refusal): another replica may well succeed."""
    return (result.outcome is wire.Outcome.FAILED and bool(result.errors)
            and all(e.is_transient and not e.upstream_status for e in result.errors))


def interpret(info: wire.ModelInfo, result: wire.Result) -> InferResult:
    match result.outcome:
        case wire.Outcome.OK:
            assert result.payload is not None
            return InferResult(info, result.payload, result.num_tokens, result.queue_s, result.exec_s,
                               result.batch_size, result.device_s)
        case wire.Outcome.REJECTED:
            raise Overloaded(result.message or "overloaded", retry_after_s=result.retry_after_s)
        case wire.Outcome.EXPIRED:
            raise DeadlineExceeded(result.message or "deadline exceeded")
        case wire.Outcome.UNREACHABLE:
            raise DeadlineUnreachable(result.message or "the deadline cannot be met")
        case wire.Outcome.NOT_FOUND:
            raise ModelNotReady(result.message, retry_after_s=1.0)
        case wire.Outcome.DRAINING:  # (the gateway sends such a request elsewhere first)
            raise Unavailable(result.message or "worker is draining", retry_after_s=result.retry_after_s or 1.0)
        case _:
            refused = next((e for e in result.errors if e.upstream_status), None)
            if refused is not None:
                raise UpstreamRefused(refused.message, refused.upstream_status, refused.param)
            errors = "; ".join(f"item {e.index}: {e.message}" if e.index >= 0 else e.message for e in result.errors)
            if result.errors and all(e.is_transient for e in result.errors):
                raise DeviceFailed(f"the model's device failed: {errors}", retry_after_s=result.retry_after_s or 1.0)
            if any(e.index < 0 for e in result.errors):
                param = next((e.param for e in result.errors if e.param), None)
                raise InvalidInput(errors or result.message, param=param)
            raise ItemFailed(errors or result.message)
