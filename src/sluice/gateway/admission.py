"""Admission at the gateway: who a request is for (`Caller`), its deadline, and whether a replica
can still meet it.

The worker's admission stays the authority (`sluice.scheduler`); the gateway predicts from the
replicas' reports what the worker would refuse, so that under overload a request is answered
at once, before its body is read (`Admission.shed_if_overloaded`) or before it is sent
(`excess_s`), rather than after a round trip. Admitted requests get a `Ticket`, which accounts
for them from then on; the ones refused here are accounted for here (`Admission._refused_early`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sluice import wire
from sluice.clock import Clock
from sluice.errors import DeadlineExceeded, InvalidInput, Overloaded, RateLimited
from sluice.gateway.cache import CachePolicy, ResultCache
from sluice.gateway.connection import WorkerConnection
from sluice.gateway.statistics import InferenceStatistics
from sluice.gateway.tenancy import RequestGroup, Tenancy
from sluice.gateway.ticket import InferResult, Ticket
from sluice.metrics import GatewayMetrics
from sluice.priority import Priority, effective_priority
from sluice.tracing import Tracing


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request is for, as the API layer learned it."""

    tenant: str = ""
    priority: Priority | None = None
    """The class the request asked for; it can only lower the tenant's default."""
    estimated_tokens: float = 0.0
    """A bound on the request's tokens, reserved against the tenant's tokens-per-minute limit until
    the real count is known."""
    trace: wire.TraceContext | None = None
    """The caller's W3C trace context (`traceparent`, `tracestate`), if it sent one: the request's
    span joins that trace, and calls to another server carry it on."""
    cache: CachePolicy = CachePolicy.USE
    """What the request lets the result cache do (its `Cache-Control` header)."""
    group: RequestGroup | None = None
    """One part of a client request made of several (a batch of prompts): the tenant's limits
    count the whole request once (`tenancy.RequestGroup`)."""
    background: bool = False
    """A batch job's item (the job executor's, never a client's say): it yields to online work
    on the device (`sluice.scheduler.backlog`)."""
    likely_tokens: float | None = None
    """A guess at its tokens (`estimated_tokens` is a bound): a request likely to need more than a
    minute's worth is refused for good. None: the bound is the guess."""


LOCAL_CALLER = Caller()
"""The caller of a request that names none: the default tenant, its own class, the cache used."""


class Admission:
    """Admits requests to the gateway (`admit`), and refuses early those that cannot meet their
    deadline (`shed_if_overloaded`) or whose body is malformed (`reading`)."""

    def __init__(self, clock: Clock, metrics: GatewayMetrics, tracing: Tracing, tenancy: Tenancy,
                 statistics: InferenceStatistics, cache: ResultCache | None, max_timeout_s: float,
                 replicas: Callable[[wire.ModelInfo], tuple[WorkerConnection, ...]],
                 observer: Callable[[Ticket, str, InferResult | None], None]) -> None:
        """`replicas`: the ready workers' connections that serve a model version, if any.
        `observer`: told of each admitted request's end (`Ticket`)."""
        self._clock = clock
        self._metrics = metrics
        self._tracing = tracing
        self._tenancy = tenancy
        self._statistics = statistics
        self._cache = cache
        self._max_timeout_s = max_timeout_s
        self._replicas = replicas
        self._observer = observer

    def _holds_answer(self, key: bytes | None, policy: CachePolicy) -> bool:
        """This gateway's own store holds an answer for `key` that a request with this
        `Cache-Control` policy may be given: it needs no device, so it is not refused for overload."""
        return (key is not None and policy is CachePolicy.USE and self._cache is not None
                and self._cache.local is not None and key in self._cache.local)

    def shed_if_overloaded(self, info: wire.ModelInfo, timeout_s: float | None, arrived_at: float,
                           caller: Caller | None = None, key: bytes | None = None,
                           default_s: float | None = None) -> None:
        """Refuse now, before the body is parsed, when every ready replica already reports more
        work ahead of this tenant's class than the request's deadline allows: under overload the
        excess costs the gateway as little as possible and gets its answer at once. A request
        whose cache `key` (`Gateway.cache_key`) this gateway holds an answer for is not refused:
        it needs no device. `default_s`: the deadline without a `timeout_s`, as `admit` will set
        it (default: the model's SLO, one batch's)."""
        caller = caller or LOCAL_CALLER
        allowed = self._tenancy.tenant(caller.tenant)
        self._tenancy.authorize(allowed, info.name)  # a 403 is the answer, not a 503
        if self._holds_answer(key, caller.cache):
            return
        deadline = arrived_at + (timeout_s if timeout_s is not None else default_s or info.slo_s)
        now = self._clock.now()
        tenant, priority = allowed.name, effective_priority(allowed.priority, caller.priority)
        if now >= deadline:
            self._refused_early(info, tenant, priority, caller, arrived_at, now, "expired",
                                client_deadline=timeout_s is not None)
            raise DeadlineExceeded("the deadline passed before the request could be dispatched")
        replicas = self._replicas(info)
        excesses = [(excess_s(c, tenant, priority, info, now, deadline), c) for c in replicas if c.is_ready]
        if not excesses:
            return
        least_excess_s, connection = min(excesses, key=lambda pair: pair[0])
        if least_excess_s <= 0:
            return
        self._refused_early(info, tenant, priority, caller, arrived_at, now, "rejected")
        raise overloaded(self._metrics, connection, info, least_excess_s)

    @contextmanager
    def reading(self, info: wire.ModelInfo, tenant: str, arrived_at: float,
                trace: wire.TraceContext | None = None) -> Iterator[None]:
        """Around the reading of a request to `info` (from `resolve`) before it is sent on with
        `infer`: the tenant must be allowed the model first (its 403, not a 400 about its input),
        and an `InvalidInput` raised inside (the client's malformed body, wrong input name, type or
        shape) is counted as the outcome `invalid` and a failed inference in the model's
        statistics, as a `Ticket` counts one the worker refuses. The one place for both
        protocols and transports; `infer` is not called inside (its ticket counts its own).
        With tracing on, the refused request is a span too (in the caller's `trace`)."""
        allowed = self._tenancy.tenant(tenant)
        self._tenancy.authorize(allowed, info.name)
        try:
            yield
        except InvalidInput:
            duration_s = self._clock.now() - arrived_at
            self._metrics.request_done(info.name, info.version, "invalid", duration_s)
            self._statistics.failed(info.name, info.version, duration_s)
            if self._tracing.is_enabled:
                self._tracing.request(model=info.name, version=info.version, tenant=allowed.name,
                                      priority=allowed.priority.label, trace_context=trace,
                                      started=arrived_at, outcome="invalid")
            raise

    def _refused_early(self, info: wire.ModelInfo, tenant: str, priority: Priority, caller: Caller,
                       arrived_at: float, now: float, outcome: str, *, client_deadline: bool = False) -> None:
        """The accounting of a request answered before admission, as a `Ticket` does it for the rest."""
        self._metrics.request_done(info.name, info.version, outcome, now - arrived_at,
                                   client_deadline=client_deadline)
        self._statistics.failed(info.name, info.version, now - arrived_at)
        self._metrics.tenant_rejected(tenant, priority.label, "overloaded" if outcome == "rejected" else outcome)
        if self._tracing.is_enabled:
            self._tracing.request(model=info.name, version=info.version, tenant=tenant, priority=priority.label,
                                  trace_context=caller.trace, started=arrived_at, outcome=outcome)

    async def admit(self, info: wire.ModelInfo, timeout_s: float | None, arrived_at: float | None,
                    caller: Caller | None, default_s: float | None = None) -> Ticket:
        """The ticket of a request the tenant's permission and limits let in (403/429, nothing else
        consumed, if not). `default_s`: the deadline without a `timeout_s` (default: the model's SLO)."""
        started = self._clock.now() if arrived_at is None else arrived_at
        caller = caller or LOCAL_CALLER
        if timeout_s is not None and not 0 < timeout_s <= self._max_timeout_s:
            raise InvalidInput(f"timeout must be in (0, {self._max_timeout_s:g}] seconds", param="timeout")
        tenant = self._tenancy.tenant(caller.tenant)
        self._tenancy.authorize(tenant, info.name)
        priority = effective_priority(tenant.priority, caller.priority)
        try:
            if caller.group is None:
                reservation = await self._tenancy.admit(tenant, priority, caller.estimated_tokens, caller.likely_tokens)
            else:
                reservation = await caller.group.admit(self._tenancy, tenant, priority)
        except RateLimited as refusal:  # counted by tenant and limit in /metrics; traced here
            if self._tracing.is_enabled:
                self._tracing.request(model=info.name, version=info.version, tenant=tenant.name,
                                      priority=priority.label, trace_context=caller.trace, started=started,
                                      outcome="rate_limited", attributes={"sluice.limit": refusal.limit})
            raise
        deadline = started + (timeout_s if timeout_s is not None else default_s or info.slo_s)
        return Ticket(self._metrics, self._tenancy, self._clock, info, tenant.name, priority, reservation, started,
                      deadline, self._tracing, caller.trace, observer=self._observer,
                      client_deadline=timeout_s is not None, group=caller.group, background=caller.background)


def overloaded(metrics: GatewayMetrics, connection: WorkerConnection, info: wire.ModelInfo, excess_s: float,
               num_items: int = 1) -> Overloaded:
    """The early refusal: retry once the excess has drained at the worker's reported rate. The
    demand it turns away is counted as `num_items` typical items (one when the body is not
    read yet: `Admission.shed_if_overloaded`)."""
    work_s = connection.item_s(info.name, info.version) * num_items
    metrics.refused_work(info.name, info.version, work_s)
    drain_rate = connection.state.drain_rate if connection.state is not None else 1.0
    return Overloaded("the work queued ahead would make this request miss its deadline",
                      retry_after_s=max(excess_s / max(drain_rate, 0.05), 0.001))


def excess_s(connection: WorkerConnection, tenant: str, priority: Priority, info: wire.ModelInfo,
             now: float, deadline: float) -> float:
    """How far past `deadline` a request sent to `connection` now is predicted to finish: its
    wait (`tenant_wait_s`) and its own batch, as the worker's admission counts them. 0 when
    it fits, when nothing is queued ahead of it, when the worker has not reported yet, when
    its own batch alone would miss the deadline (the worker answers that one: it is a
    deadline too short, not an overload), or when the worker's predictions for the model are
    provisional (a fresh worker whose warm-up ran slow: the worker decides, and its first
    batches correct them)."""
    if connection.state is None or connection.is_provisional(info.name, info.version):
        return 0.0
    wait_s = tenant_wait_s(connection, tenant, priority, info)
    own_s = connection.newcomer_s(info.name, info.version)
    if wait_s <= 0 or now + own_s > deadline:
        return 0.0
    return max(now + wait_s + own_s - deadline, 0.0)


def tenant_wait_s(connection: WorkerConnection, tenant: str, priority: Priority, info: wire.ModelInfo) -> float:
    """Until a new request's batch could start: the worker's last report for this tenant's
    class, less the time since (the device has been working), plus what this gateway has sent
    for the same tenant and class that the report does not count (it queues behind), at the
    reported drain rate."""
    state = connection.state
    if state is None:
        return 0.0
    wait_s = predicted_wait_s(state, tenant, priority, info)
    if info.kind == "openai-upstream":
        return wait_s
    elapsed_s = max(time.monotonic() - connection.state_at, 0.0)
    sent_s = connection.sent_flow_work_s(tenant, int(priority)) / max(state.drain_rate, 0.05)
    return max(wait_s - elapsed_s, 0.0) + sent_s


def predicted_wait_s(state: wire.WorkerState, tenant: str, priority: Priority,
                     model: wire.ModelInfo | None = None) -> float:
    """What the worker reported for this tenant's class: behind the tenant's own queued work if it
    has some, else what a newcomer to the class waits (higher classes and the running batch).
    For a model served by an upstream server, the wait for a slot to that upstream instead."""
    if model is not None and model.kind == "openai-upstream":
        for load in state.upstreams:
            if (load.model, load.version) == (model.name, model.version):
                return load.waits_s[priority] if priority < len(load.waits_s) else load.waits_s[-1]
        return 0.0
    newcomer: float | None = None
    for wait in state.waits:
        if wait.priority == priority:
            if wait.tenant == tenant:
                return wait.wait_s
            if wait.tenant is None:
                newcomer = wait.wait_s
    return state.work_ahead_s if newcomer is None else newcomer


TEXT_SPECIAL_TOKENS = 4
"""Tokens a tokenizer may add to a text besides its bytes' (begin and end markers, a leading space's)."""


def estimate_text_tokens(texts: list[str], max_tokens_per_text: int = 0) -> float:
    """A bound on a text's tokens before the model's tokenizer has seen it, reserved against the
    tenant's tokens-per-minute limit and settled with the real count afterwards: a token per UTF-8
    byte plus a few special tokens, since no tokenizer makes more than one token of a byte
    (byte-level BPE, WordPiece, SentencePiece with byte fallback). A guess per characters would not
    bound it: digits, punctuation, emoji or CJK text take a token per character or byte, so
    concurrent requests admitted on a guess could overshoot the limit many times over.
    `max_tokens_per_text`: what the model keeps of each text (an embedding model truncates its
    inputs), 0: no bound."""
    bound = max_tokens_per_text if max_tokens_per_text > 0 else math.inf
    return float(sum(min((len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass")))
                         + TEXT_SPECIAL_TOKENS, bound) for text in texts))


def request_cost(info: wire.ModelInfo, payload: wire.Payload) -> float:
    """The cost its items add up to, in the units of the worker's batcher (tokens, or a row's
    elements), as far as the gateway can tell before a worker has seen them: a text's token bound
    (`estimate_text_tokens`, within what the model keeps of it), a token-id list's length, a row's
    elements. Padding only adds to a batch's cost; a text's bound may take more than its tokens (a
    token per byte), which errs toward a longer default deadline rather than a 504 for a request
    that would have fit."""
    if isinstance(payload, wire.TextPayload):
        return estimate_text_tokens(payload.texts, info.max_model_len)
    if isinstance(payload, wire.TokensPayload):
        return float(sum(len(ids) for ids in payload.token_ids))
    if isinstance(payload, wire.TensorPayload):
        return float(wire.num_items(payload) * max(1, math.prod(payload.shape[1:])))
    if isinstance(payload, wire.TensorsPayload):
        per_item = max((math.prod(t.shape[1:]) for t in payload.tensors), default=1)
        return float(wire.num_items(payload) * max(1, per_item))
    return 0.0


def num_batches(info: wire.ModelInfo, payload: wire.Payload) -> int:
    """The batches a request needs at least: its items at the model's max batch size, or its cost
    (`request_cost`) at its max batch cost, whichever needs more. 32 texts of 256 tokens fill one
    batch of minilm's 32 by count, and two by its cost of 4,096 tokens a batch."""
    return batches_for(info, wire.num_items(payload), request_cost(info, payload))


def batches_for(info: wire.ModelInfo, num_items: float, cost: float) -> int:
    """`num_batches` of a request of `num_items` items costing `cost` in all (bounds give a bound)."""
    by_items = math.ceil(num_items / max(info.max_batch_size, 1))
    by_cost = math.ceil(cost / info.max_batch_cost) if info.max_batch_cost > 0 else 1
    return max(1, by_items, by_cost)


def default_timeout_s(info: wire.ModelInfo, num_batches: int) -> float:
    """A request's deadline when its client sets none: the model's SLO (the latency of one batch's
    worth) for each batch it needs (`num_batches`). One text gets the SLO; 2,048 texts, which no
    device runs in one batch's time, get 64 of them instead of a 504, and so do a few texts long
    enough to fill as many batches by their tokens."""
    return info.slo_s * max(num_batches, 1)
