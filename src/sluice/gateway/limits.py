"""Per-tenant limits at the gateway: request and token buckets, a concurrency cap, a credit budget.

    admit(tenant, estimated_tokens) ──▶ Reservation ──(request runs)──▶ settle(tokens, device_s)
              │
              └──▶ Refusal(limit, retry_after_s)    nothing consumed

Pure policy over an injected clock. Rules:
- every limit is checked before any is consumed, so a request refused by one limit takes
  nothing from the others;
- tokens are reserved at admission from an estimate and settled with the real count when the
  request completes, so concurrent requests cannot overshoot a tokens-per-minute limit between
  admission and completion (they would, if counted only afterwards). The estimate is a bound (the
  API's: a token per byte of text), so that the reservations of requests in flight cover what they
  can use; it reserves at most a minute's tokens, so a request whose bound is larger waits for a
  full bucket and settles its real count afterwards (taking the bucket below zero if it used more);
- a bucket holds at most one minute's worth, refilled continuously; a request *likely* larger than
  a whole minute's tokens (a second, closer guess; the bound when none is given) is refused
  outright (`too_large`: no wait would let it through), as OpenAI does;
- credits are device-seconds per period (fixed windows on the limiter's clock: `sluice serve`
  gives it the wall clock, so a daily budget resets at 00:00 UTC), charged with the
  device time the tenant's requests actually used; a request is admitted while the period's use is
  under the budget, so the overshoot is at most what the tenant's in-flight requests use.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from sluice.clock import Clock
from sluice.gateway.tenants import Tenant

__all__ = ["LimitStatus", "Refusal", "Reservation", "TenantLimiter", "TokenBucket", "Usage", "format_duration",
           "likely_count", "reserved_tokens", "too_large"]


class TokenBucket:
    def __init__(self, per_min: float, now: float) -> None:
        self.capacity = per_min
        self.rate_per_s = per_min / 60.0
        self.level = per_min
        self._at = now

    def refill(self, now: float) -> None:
        if now > self._at:
            self.level = min(self.capacity, self.level + (now - self._at) * self.rate_per_s)
            self._at = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` can be taken (a request larger than the bucket waits for a full one)."""
        need = min(amount, self.capacity) - self.level
        return 0.0 if need <= 0 else need / self.rate_per_s

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, self.capacity - self.level) / self.rate_per_s

    def adjust(self, delta: float) -> None:
        self.level = min(self.capacity, self.level + delta)


@dataclass(frozen=True, slots=True)
class LimitStatus:
    """One limit's state, for the `x-ratelimit-*` headers."""

    name: str  # "requests" or "tokens"
    limit: float
    remaining: float
    reset_s: float


@dataclass(frozen=True, slots=True)
class Refusal:
    limit: str
    """Which limit refused: "requests", "tokens", "concurrency" or "credits"."""
    retry_after_s: float
    is_final: bool
    """True when retrying within the current period cannot help (an exhausted budget)."""
    statuses: tuple[LimitStatus, ...]
    too_large: bool = False
    """The request alone needs more than the limit allows in a minute: retrying cannot help."""


@dataclass(frozen=True, slots=True)
class Usage:
    """What a tenant has used: device-seconds in all and in the current credit period, and
    requests in flight."""

    device_s: float
    period_device_s: float
    in_flight: int


@dataclass(slots=True)
class Reservation:
    tenant: str
    tokens: float
    statuses: tuple[LimitStatus, ...]
    is_settled: bool = False
    lease_id: str = ""
    """The shared limiter's in-flight entry (`shared_limits`); unused in one process."""
    limits: Tenant | None = None
    """The limits it was admitted under (the shared limiter settles with them)."""
    admitted_at: float = 0.0
    """The limiter's clock at admission: how long the request held its concurrency slot."""


@dataclass(slots=True)
class _TenantState:
    tenant: Tenant
    requests: TokenBucket | None
    tokens: TokenBucket | None
    num_in_flight: int = 0
    period_index: int = 0
    used_device_s: float = 0.0
    used_total_device_s: float = 0.0
    request_s: float | None = None
    """Decayed mean of how long its requests held a concurrency slot (None: none has ended yet)."""
    statuses: tuple[LimitStatus, ...] = field(default=())


class TenantLimiter:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._states: dict[str, _TenantState] = {}
        self._removed: dict[str, _TenantState] = {}
        """Tenants a reload took out (bounded by the names the files have ever had)."""

    def configure(self, tenants: Iterable[Tenant]) -> None:
        """Apply a (re)loaded tenants file. Tenants whose limits did not change keep their state;
        a changed limit keeps what was used of the old one; in-flight counts and credit use carry
        over. A tenant the file no longer names keeps its state aside (its requests in flight
        settle there), so taking it out and putting it back refills nothing either."""
        now = self._clock.now()
        states: dict[str, _TenantState] = {}
        for tenant in tenants:
            old = self._states.get(tenant.name) or self._removed.pop(tenant.name, None)
            states[tenant.name] = _new_state(tenant, old, now)
        self._removed.update((name, state) for name, state in self._states.items() if name not in states)
        self._states = states

    def admit(self, tenant: Tenant, estimated_tokens: float,
              likely_tokens: float | None = None) -> Reservation | Refusal:
        """`estimated_tokens`: a bound on what the request can use (reserved up to a minute's worth);
        `likely_tokens`: what it likely uses (judges `too_large`; None: the bound)."""
        now = self._clock.now()
        state = self._states.get(tenant.name)
        if state is None:  # not in the configured set (a caller's own Tenant): limits start fresh
            state = self._states[tenant.name] = _new_state(tenant, None, now)
        for bucket in (state.requests, state.tokens):
            if bucket is not None:
                bucket.refill(now)
        self._roll_period(state, now)
        statuses = _statuses(state)
        if (refusal := too_large(tenant, likely_count(estimated_tokens, likely_tokens), statuses)) is not None:
            return refusal
        reserved = reserved_tokens(tenant, estimated_tokens)
        refusal = self._check(state, reserved, now)
        if refusal is not None:
            return refusal
        if state.requests is not None:
            state.requests.adjust(-1)
        if state.tokens is not None:
            state.tokens.adjust(-reserved)
        state.num_in_flight += 1
        return Reservation(tenant.name, reserved, _statuses(state), admitted_at=now)

    def settle(self, reservation: Reservation, tokens: float, device_s: float, *,
               refund_request: bool = False) -> None:
        """The request is over: give back unused tokens (or take the excess), charge its device time.
        `refund_request`: the system, not the tenant, refused it (overload), so it does not count."""
        if reservation.is_settled:
            return
        reservation.is_settled = True
        state = self._states.get(reservation.tenant) or self._removed.get(reservation.tenant)
        if state is None:
            return
        state.num_in_flight = max(0, state.num_in_flight - 1)
        state.request_s = decayed_mean(state.request_s, self._clock.now() - reservation.admitted_at)
        if refund_request and state.requests is not None:
            state.requests.adjust(1)
        if state.tokens is not None:
            state.tokens.refill(self._clock.now())
            state.tokens.adjust(reservation.tokens - tokens)
        self._roll_period(state, self._clock.now())
        state.used_device_s += device_s
        state.used_total_device_s += device_s

    def usage(self, tenant: Tenant) -> Usage:
        state = self._states.get(tenant.name)
        if state is None:
            return Usage(0.0, 0.0, 0)
        self._roll_period(state, self._clock.now())
        return Usage(state.used_total_device_s, state.used_device_s, state.num_in_flight)

    def _check(self, state: _TenantState, tokens: float, now: float) -> Refusal | None:
        tenant = state.tenant
        if tenant.max_concurrent and state.num_in_flight >= tenant.max_concurrent:
            return Refusal("concurrency", next_slot_s(state.request_s, state.num_in_flight), False, _statuses(state))
        if tenant.credits_device_s and state.used_device_s >= tenant.credits_device_s:
            period_end = (state.period_index + 1) * tenant.credit_period_s
            return Refusal("credits", max(period_end - now, 1.0), True, _statuses(state))
        for name, bucket, amount in (("requests", state.requests, 1.0), ("tokens", state.tokens, tokens)):
            if bucket is not None and (wait_s := bucket.wait_s(amount)) > 0:
                return Refusal(name, wait_s, False, _statuses(state))
        return None

    @staticmethod
    def _roll_period(state: _TenantState, now: float) -> None:
        if not state.tenant.credits_device_s:
            return
        index = math.floor(now / state.tenant.credit_period_s)
        if index != state.period_index:
            state.period_index, state.used_device_s = index, 0.0


REQUEST_S_WEIGHT = 0.2
"""The weight of each ended request in a tenant's mean request duration."""


def decayed_mean(mean_s: float | None, duration_s: float) -> float:
    """A tenant's mean request duration with one more request's."""
    duration_s = max(duration_s, 0.0)
    return duration_s if mean_s is None else mean_s + REQUEST_S_WEIGHT * (duration_s - mean_s)


def next_slot_s(mean_request_s: float | None, num_in_flight: int) -> float:
    """When a concurrency slot is expected to free (a refusal's Retry-After): the first of
    `num_in_flight` requests to end, their remaining times spread evenly over a typical request's
    duration, is expected after duration / (n + 1). A second until some request has ended."""
    if mean_request_s is None:
        return 1.0
    return max(mean_request_s / (num_in_flight + 1), 0.001)


def reserved_tokens(tenant: Tenant, estimated_tokens: float) -> float:
    """What a request reserves of its tenant's tokens: its bound, at most a minute's worth."""
    return min(estimated_tokens, tenant.tokens_per_min) if tenant.tokens_per_min > 0 else estimated_tokens


def likely_count(estimated_tokens: float, likely_tokens: float | None) -> float:
    """The tokens a request likely uses, which judge `too_large`: its guess, never above its bound."""
    return estimated_tokens if likely_tokens is None else min(likely_tokens, estimated_tokens)


def too_large(tenant: Tenant, tokens: float, statuses: tuple[LimitStatus, ...] = ()) -> Refusal | None:
    """A request that alone needs more tokens than its tenant may use in a minute: refused for good."""
    if tenant.tokens_per_min > 0 and tokens > tenant.tokens_per_min:
        return Refusal("tokens", 0.0, True, statuses, too_large=True)
    return None


def _new_state(tenant: Tenant, old: _TenantState | None, now: float) -> _TenantState:
    """A tenant's state under (possibly new) limits, carrying over what `old` had."""
    requests = _bucket(tenant.requests_per_min, old.requests if old else None, now)
    tokens = _bucket(tenant.tokens_per_min, old.tokens if old else None, now)
    state = _TenantState(tenant, requests, tokens)
    if old is not None:
        state.num_in_flight = old.num_in_flight
        state.period_index, state.used_device_s = old.period_index, old.used_device_s
        state.used_total_device_s = old.used_total_device_s
    return state


def _bucket(per_min: float, old: TokenBucket | None, now: float) -> TokenBucket | None:
    """The bucket under a (re)loaded limit. A changed limit keeps what the tenant has used of the
    old one (a reload is not a way to refill a bucket); a new limit starts full."""
    if per_min <= 0:
        return None
    if old is not None and old.capacity == per_min:
        return old
    bucket = TokenBucket(per_min, now)
    if old is not None:
        old.refill(now)
        bucket.level = per_min - (old.capacity - old.level)
    return bucket


def _statuses(state: _TenantState) -> tuple[LimitStatus, ...]:
    return tuple(
        LimitStatus(name, bucket.capacity, max(0.0, bucket.level), bucket.reset_s())
        for name, bucket in (("requests", state.requests), ("tokens", state.tokens)) if bucket is not None
    )


def format_duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: `20ms`, `1.5s`, `6m0s`, `1h2m3s`."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"
