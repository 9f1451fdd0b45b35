"""An `openai-upstream` model inside the worker: bounded calls to the upstream, on the worker's
own event loop (one task per call in flight, no thread).

    Submit ─▶ SlotQueue.offer ─▶ waiting (class, tenant: fair) ─▶ a slot frees ─▶ task: runner.generate
                                                                               │
    ◀── TokenChunk per text delta (streamed) or Started (unary) ◀──────────────┤
    ◀── Result: OK with usage | FAILED (upstream's 4xx, or transient: 503) | EXPIRED
    Cancel ─▶ a waiting call leaves the queue; a running call's task is cancelled, which closes
              the upstream stream (the upstream frees its sequence)

Every call that was admitted is answered exactly once, except one the gateway cancelled.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypedDict, Unpack

from sluice import wire
from sluice.clock import Clock
from sluice.engines.openai_upstream import CallEnd, CallFailure, OpenAIUpstreamRunner, TextDelta
from sluice.priority import priority_from_wire
from sluice.scheduler.slots import SlotQueue
from sluice.tasks import cancel_and_wait

log = logging.getLogger("sluice.worker")


@dataclass(slots=True)
class _Call:
    identity: bytes
    request_id: int
    payload: wire.GeneratePayload
    deadline: float
    queued_at: float
    started_at: float = 0.0
    parts: dict[int, list[str]] = field(default_factory=dict)
    """An unstreamed call's text so far, by choice."""
    logprobs: dict[int, list[wire.TokenLogprob]] = field(default_factory=dict)
    is_relayed: bool = False
    task: asyncio.Task[None] | None = None
    trace: wire.TraceContext | None = None
    """What the upstream call carries (`wire.Submit.trace`): the gateway's request span as its
    parent, or the caller's own trace context; None: nothing."""


class UpstreamLoop:
    def __init__(self, runner: OpenAIUpstreamRunner, reply: wire.Reply, clock: Clock,
                 on_idle: Callable[[], None] = lambda: None) -> None:
        self.runner = runner
        self._reply = reply
        self._clock = clock
        self._on_idle = on_idle
        config = runner.config
        self._slots = SlotQueue(config.max_concurrency, config.max_waiting)
        self._calls: dict[int, _Call] = {}
        self._by_gateway_id: dict[tuple[bytes, int], int] = {}
        self._ids = itertools.count(1)
        self._call_s = config.expected_latency_s  # mean duration of a call, learned as calls end
        self._is_closing = False

    @property
    def is_idle(self) -> bool:
        return not self._calls

    async def start(self) -> None:
        await self.runner.start()

    async def aclose(self) -> None:
        self._is_closing = True
        await cancel_and_wait(call.task for call in self._calls.values() if call.task is not None)
        await self.runner.aclose()

    def submit(self, identity: bytes, message: wire.Submit) -> None:
        payload = message.payload
        if not isinstance(payload, wire.GeneratePayload):
            error = (f"model {message.model} generates text: use /v1/completions, /v1/chat/completions or KServe "
                     "infer over HTTP with a text_input")
            self._reply(identity, wire.Result(message.request_id, wire.Outcome.FAILED,
                                              errors=[wire.ItemError(-1, error)], message=error))
            return
        breaker = self.runner.breaker
        if breaker.retry_after_s() > 0:  # open: answer at once rather than queue for nothing
            self._reply(identity, _unavailable(message.request_id, "upstream unavailable: circuit open after "
                                               "repeated failures", breaker.retry_after_s()))
            return
        now = self._clock.now()
        call_id = next(self._ids)
        priority = priority_from_wire(message.priority)
        if not self._slots.offer(call_id, priority, now + message.timeout_s, message.tenant):
            self._reply(identity, wire.Result(message.request_id, wire.Outcome.REJECTED,
                                              retry_after_s=self._call_s,
                                              message="upstream queue full: too many calls waiting for a slot"))
            return
        self._calls[call_id] = _Call(identity, message.request_id, payload, now + message.timeout_s, now,
                                     trace=message.trace)
        self._by_gateway_id[(identity, message.request_id)] = call_id
        self._pump()

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        """The tenants' fair-share weights for the slot queue; ValueError for a bad one."""
        self._slots.set_tenant_weights(weights)

    def cancel(self, identity: bytes, request_id: int) -> bool:
        """Withdraw a call (the client went away); True if it was this loop's."""
        call_id = self._by_gateway_id.pop((identity, request_id), None)
        if call_id is None:
            return False
        call = self._calls.pop(call_id)
        if call.task is not None:
            call.task.cancel()  # its `finally` frees the slot
        else:
            self._slots.release(call_id)
        return True

    def expire(self) -> None:
        """Answer waiting calls whose deadline has passed (called on the worker's state tick)."""
        for call_id in self._slots.expire(self._clock.now()):
            self._answer_expired(call_id)

    def load(self) -> wire.UpstreamLoad:
        info = self.runner.info
        return wire.UpstreamLoad(info.name, info.version, self._slots.num_running, self._slots.num_waiting,
                                 self._slots.max_running, self._slots.waits_s(self._call_s),
                                 self._call_s / self._slots.max_running)

    # -- calls ---------------------------------------------------------------------------------

    def _pump(self) -> None:
        if self._is_closing:
            return
        decision = self._slots.start_next(self._clock.now(), self._call_s)
        for call_id in decision.expired:
            self._answer_expired(call_id)
        for call_id in decision.started:
            call = self._calls[call_id]
            call.started_at = self._clock.now()
            call.task = asyncio.get_running_loop().create_task(self._run(call_id, call))

    async def _run(self, call_id: int, call: _Call) -> None:
        try:
            timeout_s = call.deadline - self._clock.now()
            async with aclosing(self.runner.generate(call.payload, timeout_s, call.trace)) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        self._relay(call, event)
                    else:
                        self._finish(call_id, call, event)
        except Exception:  # a bug here must not leave the request unanswered
            log.exception("upstream call failed unexpectedly")
            self._finish(call_id, call, CallFailure("internal error while calling the upstream"))
        finally:
            self._slots.release(call_id, self._clock.now())
            if self._calls.pop(call_id, None) is not None:
                self._by_gateway_id.pop((call.identity, call.request_id), None)
            self._pump()
            if not self._calls:
                self._on_idle()

    def _relay(self, call: _Call, delta: TextDelta) -> None:
        if delta.index >= call.payload.n:
            return  # an upstream's answer to a question not asked
        logprobs = list(delta.logprobs) if delta.logprobs and call.payload.logprobs is not None else None
        if call.payload.stream:
            self._reply(call.identity, wire.TokenChunk(call.request_id, delta.text, [], logprobs=logprobs,
                                                       index=delta.index))
        else:
            if not call.is_relayed:
                self._reply(call.identity, wire.Started([call.request_id]))
            call.parts.setdefault(delta.index, []).append(delta.text)
            if logprobs:
                call.logprobs.setdefault(delta.index, []).extend(logprobs)
        call.is_relayed = True

    def _finish(self, call_id: int, call: _Call, event: CallEnd | CallFailure) -> None:
        if call_id not in self._calls:
            return  # cancelled meanwhile: the gateway expects no answer
        now = self._clock.now()
        exec_s = now - call.started_at
        timing = _Timing(queue_s=call.started_at - call.queued_at, exec_s=exec_s, device_s=exec_s)
        if isinstance(event, CallEnd):
            self._call_s += 0.2 * (exec_s - self._call_s)
            result = _generation_result(call, event)
            self._reply(call.identity, wire.Result(
                call.request_id, wire.Outcome.OK, payload=result, batch_size=1,
                num_tokens=event.num_prompt_tokens + event.num_output_tokens, **timing))
        elif now >= call.deadline or event.is_deadline:  # timers fire to the millisecond: trust the runner too
            self._reply(call.identity, wire.Result(call.request_id, wire.Outcome.EXPIRED, **timing,
                                                   message="the deadline passed before the upstream finished"))
        elif event.status and not call.is_relayed:
            error = wire.ItemError(-1, event.message, upstream_status=event.status, param=event.param)
            self._reply(call.identity, wire.Result(call.request_id, wire.Outcome.FAILED, errors=[error],
                                                   message=event.message, **timing))
        else:
            self._reply(call.identity, _unavailable(call.request_id, event.message,
                                                    event.retry_after_s or 1.0, **timing))
        del self._calls[call_id]
        self._by_gateway_id.pop((call.identity, call.request_id), None)

    def _answer_expired(self, call_id: int) -> None:
        call = self._calls.pop(call_id, None)
        if call is None:
            return
        self._by_gateway_id.pop((call.identity, call.request_id), None)
        self._reply(call.identity, wire.Result(call.request_id, wire.Outcome.EXPIRED,
                                               queue_s=self._clock.now() - call.queued_at,
                                               message="the deadline passed while waiting for an upstream slot"))
        if not self._calls:
            self._on_idle()


class _Timing(TypedDict, total=False):
    queue_s: float
    exec_s: float
    device_s: float


def _unavailable(request_id: int, message: str, retry_after_s: float, **timing: Unpack[_Timing]) -> wire.Result:
    error = wire.ItemError(0, message, is_transient=True)
    return wire.Result(request_id, wire.Outcome.FAILED, errors=[error], retry_after_s=retry_after_s,
                       message=message, **timing)


def _generation_result(call: _Call, end: CallEnd) -> wire.GenerationResult:
    """A finished call's answer: its choices' text (unless streamed), log-probabilities if asked
    for, finish reasons, and the usage the upstream reported."""
    is_whole = not call.payload.stream
    wants_logprobs = is_whole and call.payload.logprobs is not None

    def choice(index: int) -> tuple[str, str, list[wire.TokenLogprob] | None]:
        reason = end.finish_reasons[index] if index < len(end.finish_reasons) else "stop"  # one it never ended
        text = "".join(call.parts.get(index, [])) if is_whole else ""
        return text, reason, call.logprobs.get(index, []) if wants_logprobs else None

    text, reason, logprobs = choice(0)
    others = [wire.GeneratedChoice(*choice(i)) for i in range(1, call.payload.n)]
    return wire.GenerationResult(text, reason, end.num_prompt_tokens, end.num_cached_tokens, end.num_output_tokens,
                                 logprobs, choices=others, num_reasoning_tokens=end.num_reasoning_tokens,
                                 num_cache_write_tokens=end.num_cache_write_tokens)
