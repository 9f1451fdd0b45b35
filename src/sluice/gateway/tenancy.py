"""Tenancy at the gateway: keys to tenants, model permissions, limits, and the tenants file's reload.

    key ──authenticate──▶ Tenant ──authorize(model)──▶ admit(tokens) ──▶ Reservation
         401                        403                    429              │ request runs
                                                                           settle(tokens, device_s)

A reload (SIGHUP, or `POST /admin/reload`) swaps in a new directory atomically: requests already
admitted keep their reservation, and the new weights go to the workers' schedulers. A tenants
file that does not load leaves the old one in force, says so in an error log line, and counts
in `sluice_tenants_reloads_total{outcome="failed"}` (`sluice_tenants_reload_failed` reads 1 until
a reload succeeds).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from redis.exceptions import RedisError

from sluice.clock import Clock
from sluice.errors import (
    BudgetExhausted,
    ConfigError,
    ModelNotPermitted,
    PermissionDenied,
    RateLimited,
    Unauthenticated,
)
from sluice.gateway.limits import LimitStatus, Refusal, Reservation, TenantLimiter, format_duration, likely_count
from sluice.gateway.shared_limits import SharedLimiter
from sluice.gateway.tenants import LOCAL_TENANT, Tenant, TenantDirectory, load_tenants
from sluice.metrics import GatewayMetrics, tenant_label
from sluice.priority import Priority

log = logging.getLogger("sluice.tenancy")

__all__ = ["RequestGroup", "Tenancy", "TenantUsage", "rate_limit_headers"]


@dataclass(frozen=True, slots=True)
class TenantUsage:
    name: str
    """As `/metrics` labels it ("local": the one tenant without a tenants file)."""
    weight: float
    priority: str
    device_s: float
    """Device-seconds used since this gateway (or, with shared limits, the Redis) started counting."""
    models: list[str] | None
    limits: dict[str, float]
    """The tenant's limits from the file (0: none)."""
    period_device_s: float
    """Device-seconds charged in the current credit period."""
    in_flight: int


class Tenancy:
    def __init__(self, clock: Clock, metrics: GatewayMetrics, path: Path | None = None,
                 shared: SharedLimiter | None = None, *, limits_clock: Clock | None = None,
                 known_models: Callable[[], Collection[str]] | None = None) -> None:
        """`limits_clock`: the clock of the rate buckets and budget periods (default `clock`); a
        server gives it the wall clock, so that budget periods start on calendar boundaries.
        `known_models`: the models the file's `models` may name, read at start and at each reload
        (the model repository's); None: any."""
        self._known_models = known_models
        self._metrics = metrics
        self._shared = shared
        """Limits kept in Redis for every gateway; None: this gateway's own (`limiter`)."""
        self.directory = self._load(path) if path is not None else TenantDirectory.open()
        self.limiter = TenantLimiter(limits_clock or clock)
        self.limiter.configure(self.directory.tenants.values())
        self._listeners: list[Callable[[dict[str, float]], None]] = []
        if path is not None:
            metrics.tenants_reloaded(None)

    @property
    def is_open(self) -> bool:
        return self.directory.is_open

    def on_weights(self, listener: Callable[[dict[str, float]], None]) -> None:
        """Call `listener(weights)` now and after every reload (the workers' schedulers need them)."""
        self._listeners.append(listener)
        listener(self.weights())

    def weights(self) -> dict[str, float]:
        return {name: tenant.weight for name, tenant in self.directory.tenants.items()}

    def reload(self) -> TenantDirectory:
        """Read the tenants file again. Raises `ConfigError` (and keeps the old one, logged and
        counted) if it is invalid."""
        if self.directory.path is None:
            return self.directory
        try:
            directory = self._load(self.directory.path)
        except ConfigError as exc:
            self._metrics.tenants_reloaded(False)
            log.error("tenants file not reloaded, the previous one stays in force: %s", exc.message)
            raise
        self.directory = directory
        self.limiter.configure(directory.tenants.values())
        for listener in self._listeners:
            listener(self.weights())
        self._metrics.tenants_reloaded(True)
        log.info("tenants file %s reloaded: %d tenants", directory.path, len(directory.tenants))
        return directory

    def _load(self, path: Path) -> TenantDirectory:
        return load_tenants(path, None if self._known_models is None else self._known_models())

    # -- who is calling ------------------------------------------------------------------------

    def authenticate(self, key: str | None) -> Tenant:
        if self.directory.is_open:
            return LOCAL_TENANT
        if not key:
            raise Unauthenticated("this server needs an API key: send 'Authorization: Bearer <key>'")
        tenant = self.directory.tenant_for_key(key)
        if tenant is None:
            if self.directory.is_metrics_key(key):  # a valid key, for something else: not a 401
                raise PermissionDenied("a metrics key reads /metrics and the model statistics, nothing else")
            raise Unauthenticated("the API key is not valid")
        return tenant

    def check_scrape(self, key: str | None, what: str = "/metrics") -> None:
        """Refuse a request presenting `key` that may not read `/metrics` (the tenants file's
        `[metrics]`), or `what` else that shows every tenant's traffic: 403 for a tenant's key,
        401 for none or an unknown one."""
        if self.directory.may_scrape(key):
            return
        if key and self.directory.tenant_for_key(key) is not None:
            raise PermissionDenied(f"{what} needs a metrics or admin key, not a tenant's")
        raise Unauthenticated(f"{what} needs a metrics or admin key: send 'Authorization: Bearer <key>'")

    @property
    def guards_metrics(self) -> bool:
        """`[metrics] access = "keys"`: only metrics and admin keys read `/metrics` and the model statistics."""
        return not self.directory.is_open and self.directory.metrics_hashes is not None

    def is_admin(self, key: str | None) -> bool:
        return bool(key) and not self.directory.is_open and self.directory.is_admin_key(key or "")

    def tenant(self, name: str) -> Tenant:
        """The tenant a request was authenticated as (or that a batch job belongs to)."""
        tenant = self.directory.tenants.get(name)
        if tenant is None:  # removed by a reload since it was authenticated
            raise Unauthenticated(f"tenant {name!r} no longer exists")
        return tenant

    def authorize(self, tenant: Tenant, model: str) -> None:
        if not tenant.may_use(model):
            raise ModelNotPermitted(f"this API key may not use the model {model!r}")

    def visible(self, tenant: Tenant, models: Iterable[str]) -> list[str]:
        return [name for name in models if tenant.may_use(name)]

    # -- limits --------------------------------------------------------------------------------

    async def admit(self, tenant: Tenant, priority: Priority, estimated_tokens: float,
                    likely_tokens: float | None = None) -> Reservation:
        """`estimated_tokens` bounds what the request can use, `likely_tokens` guesses it
        (`TenantLimiter.admit`)."""
        outcome = await self._admit_limits(tenant, estimated_tokens, likely_tokens)
        if isinstance(outcome, Refusal):
            self._metrics.tenant_rejected(tenant.name, priority.label, outcome.limit)
            raise _refusal_error(tenant, outcome, likely_count(estimated_tokens, likely_tokens))
        self._metrics.tenant_admitted(tenant.name, priority.label)
        return outcome

    def settles_locally(self, reservation: Reservation) -> bool:
        """`settle` needs no Redis for this reservation (then it completes without waiting)."""
        return not reservation.lease_id or self._shared is None

    def settle_now(self, reservation: Reservation, tokens: float, device_s: float, *,
                   refund_request: bool = False) -> None:
        """`settle` for a reservation that `settles_locally`, without a task step."""
        self.limiter.settle(reservation, tokens, device_s, refund_request=refund_request)

    async def settle(self, reservation: Reservation, tokens: float, device_s: float, *,
                     refund_request: bool = False) -> None:
        shared = self._shared
        if shared is None or self.settles_locally(reservation):
            self.settle_now(reservation, tokens, device_s, refund_request=refund_request)
            return
        try:
            await shared.settle(reservation, tokens, device_s, refund_request=refund_request)
        except RedisError:
            # kept by the limiter and sent again before its next admission; until then its
            # concurrency slot stays taken (at the latest its lease frees it)
            self._shared_failed()

    async def usage(self) -> list[TenantUsage]:
        usage = []
        for t in self.directory.tenants.values():
            used = self.limiter.usage(t)
            if self._shared is not None and not self.is_open:
                try:
                    used = await self._shared.usage(t)
                except RedisError:
                    self._shared_failed()
            limits = {"requests_per_min": t.requests_per_min, "tokens_per_min": t.tokens_per_min,
                      "max_concurrent": t.max_concurrent, "credits_device_s": t.credits_device_s,
                      "credit_period_s": t.credit_period_s}
            usage.append(TenantUsage(tenant_label(t.name), t.weight, t.priority.label, used.device_s,
                                     None if t.models is None else sorted(t.models), limits,
                                     used.period_device_s, used.in_flight))
        return usage

    async def aclose(self) -> None:
        if self._shared is not None:
            await self._shared.aclose()

    async def _admit_limits(self, tenant: Tenant, estimated_tokens: float,
                            likely_tokens: float | None) -> Reservation | Refusal:
        """Shared limits when a Redis is configured (and a tenants file defines tenants); this
        gateway's own when not, or while Redis cannot be reached: limits then hold per gateway
        rather than refusing every request."""
        if self._shared is not None and not self.is_open:
            try:
                return await self._shared.admit(tenant, estimated_tokens, likely_tokens)
            except RedisError:
                self._shared_failed()
        return self.limiter.admit(tenant, estimated_tokens, likely_tokens)

    def _shared_failed(self) -> None:
        """Counted; logged by the limiter once per outage (when it starts, and when it ends)."""
        self._metrics.shared_limits_error()


class RequestGroup:
    """The parts of one client request that run as generations of their own (a completion's batch
    of prompts): admitted against the tenant's limits once (one request, one concurrency slot, the
    parts' tokens reserved together) and settled once, when the last part that was admitted ends,
    with what they all used. A part admitted after the others have all ended (one answered from
    the cache before another started) is admitted anew."""

    def __init__(self, estimated_tokens: float, likely_tokens: float | None = None) -> None:
        self.estimated_tokens = estimated_tokens
        self.likely_tokens = likely_tokens
        self._admission: asyncio.Future[Reservation] | None = None
        self._num_members = 0
        self._used = (0.0, 0.0)
        self._is_refund = True

    async def admit(self, tenancy: Tenancy, tenant: Tenant, priority: Priority) -> Reservation:
        """The group's reservation, admitting it if this is the first part (its refusal is every
        part's). The caller must `leave` once it holds the reservation."""
        while True:
            if self._admission is None:
                admission = self._admission = asyncio.get_running_loop().create_future()
                try:
                    reservation = await tenancy.admit(tenant, priority, self.estimated_tokens, self.likely_tokens)
                except BaseException as exc:
                    self._admission = None
                    if isinstance(exc, asyncio.CancelledError):
                        admission.cancel()
                    else:
                        admission.set_exception(exc)
                        admission.exception()  # retrieved: a group whose other parts are gone logs nothing
                    raise
                admission.set_result(reservation)
            else:
                reservation = await asyncio.shield(self._admission)
                if reservation.is_settled:  # the others ended while this one waited
                    continue
            self._num_members += 1
            return reservation

    def leave(self, tokens: float, device_s: float, refund_request: bool) -> tuple[float, float, bool] | None:
        """A part ended: None while others run; for the last, what the group used (tokens,
        device seconds, and whether the request is refunded: every part refused for overload)."""
        self._num_members -= 1
        self._used = (self._used[0] + tokens, self._used[1] + device_s)
        self._is_refund = self._is_refund and refund_request
        if self._num_members > 0:
            return None
        totals = (*self._used, self._is_refund)
        self._admission, self._used, self._is_refund = None, (0.0, 0.0), True
        return totals


_MESSAGES = {
    "requests": "requests per minute",
    "tokens": "tokens per minute",
    "concurrency": "concurrent requests",
    "credits": "device-second budget for this period",
}


def _refusal_error(tenant: Tenant, refusal: Refusal, estimated_tokens: float) -> RateLimited:
    headers = rate_limit_headers(refusal.statuses)
    message = f"rate limit reached for {_MESSAGES[refusal.limit]}"
    if refusal.too_large:
        headers["x-should-retry"] = "false"
        return RateLimited(f"request too large: it needs about {estimated_tokens:.0f} tokens, more than the "
                           f"{tenant.tokens_per_min:.0f} {_MESSAGES[refusal.limit]} tenant {tenant.name!r} may use; "
                           "send a smaller request (shorter input, lower max_tokens)", refusal.limit, None, headers)
    if refusal.is_final:
        headers["x-should-retry"] = "false"
        return BudgetExhausted(f"tenant {tenant.name!r} has used its {_MESSAGES[refusal.limit]}; "
                               f"it resets in {format_duration(refusal.retry_after_s)}",
                               refusal.limit, refusal.retry_after_s, headers)
    return RateLimited(f"{message}; retry in {format_duration(refusal.retry_after_s)}", refusal.limit,
                       refusal.retry_after_s, headers)


def rate_limit_headers(statuses: Iterable[LimitStatus]) -> dict[str, str]:
    """OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` headers."""
    headers: dict[str, str] = {}
    for status in statuses:
        headers[f"x-ratelimit-limit-{status.name}"] = f"{status.limit:.0f}"
        headers[f"x-ratelimit-remaining-{status.name}"] = f"{int(status.remaining)}"
        headers[f"x-ratelimit-reset-{status.name}"] = format_duration(status.reset_s)
    return headers
