"""One admitted request at the gateway: its accounting while it runs, and its answer.

    Gateway._admit ──▶ Ticket ──(async with: dispatch, stream)──▶ __aexit__: outcome metric,
                                                                  tenant metrics, settle limits
    worker's wire.Result ──interpret()──▶ InferResult, or the error in `sluice.errors` it means
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from sluice import wire
from sluice.clock import Clock
from sluice.errors import (
    DeadlineExceeded,
    DeviceFailed,
    InvalidInput,
    ItemFailed,
    ModelNotReady,
    Overloaded,
    Unavailable,
    UpstreamRefused,
    WorkerLost,
)
from sluice.gateway.limits import Reservation
from sluice.gateway.tenancy import RequestGroup, Tenancy, rate_limit_headers
from sluice.metrics import GatewayMetrics
from sluice.priority import Priority
from sluice.tracing import Tracing

__all__ = ["InferResult", "Ticket", "interpret"]


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
                 tracing: Tracing | None = None, traceparent: str | None = None,
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
        self._traceparent = traceparent
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
        label = self.priority.label
        now = self._clock.now()
        tokens, device_s = self._usage(outcome)
        if outcome == "ok" and result is not None:
            self._metrics.tenant_completed(self.tenant, label, result.queue_s, device_s,
                                           on_time=now <= self.deadline)
            if isinstance(result.payload, wire.GenerationResult) and not result.is_cached:
                ttft_s = None if self._first_chunk_at is None else self._first_chunk_at - self.started
                self._metrics.generation_done(self.info.name, result.payload, now - self.started, ttft_s)
        else:
            if outcome in ("rejected", "expired"):
                self._metrics.tenant_rejected(self.tenant, label, "overloaded" if outcome == "rejected" else outcome)
            self._metrics.tenant_used(self.tenant, label, device_s)
        self._metrics.request_done(self.info.name, self.info.version, outcome, now - self.started)
        if self._observer is not None:
            self._observer(self, outcome, result)
        if self._tracing is not None and self._tracing.is_enabled:
            self._trace(outcome, result)
        refund = outcome in ("rejected", "unavailable")
        if self._group is not None:
            totals = self._group.leave(tokens, device_s, refund)
            if totals is None:
                return  # the group's last part settles for all of them
            tokens, device_s, refund = totals
        await self._tenancy.settle(self.reservation, tokens, device_s, refund_request=refund)

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
        attributes = {} if result is None else {"sluice.batch_size": result.batch_size,
                                                "sluice.device_seconds": result.device_s,
                                                "sluice.tokens": result.num_tokens}
        self._tracing.request(model=self.info.name, version=self.info.version, tenant=self.tenant,
                              priority=self.priority.label, traceparent=self._traceparent, started=self.started,
                              outcome=outcome, attributes=attributes,
                              queue_s=result.queue_s if result else None, exec_s=result.exec_s if result else None)


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
