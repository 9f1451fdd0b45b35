"""Authentication: the API key on each request becomes the tenant it is served for.

    request ─▶ AuthMiddleware ─▶ scope["sluice.tenant"] = tenant name ─▶ routes
                 │ no key / unknown key: 401    tenant key on /admin/*: 403
                 │ a valid key on a path no route has: 404 (not the 403 of the key's scope)

Keys come from `Authorization: Bearer <key>` (what the `openai` SDK sends) or `api-key`. A request
that presents its key ambiguously (two `Authorization` headers, two `api-key`, or both naming
different keys, as when a proxy adds its own) is refused with 400: which one counts is not for the
server to guess.
Health probes need no key; `/metrics` checks its own (`[metrics]` in the tenants file), and under
`[metrics] access = "keys"` so do the model statistics (`/v2/models[/{m}[/versions/{v}]]/stats`),
which show every tenant's traffic: a metrics or admin key then reads them, for every model. An
admin key reads them and the repository index (`/v2/repository/index`) in any case, for every
model: it loads and unloads them. Without a tenants file every request is the local tenant's and
no key is asked for. A scope that already names a tenant was built in-process (a batch job's
item, run for the job's owner) and is left as it is: clients cannot set scope keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from sluice.api.common import MONITOR_SCOPE_KEY, TENANT_SCOPE_KEY
from sluice.api.errors import error_response, protocol_of
from sluice.errors import InvalidInput, NotFound, PermissionDenied, SluiceError
from sluice.gateway.tenancy import Tenancy

ADMIN_SCOPE_KEY = "sluice.admin"
_OPEN_PATHS = frozenset({"/metrics", "/v2/health/live", "/v2/health/ready", "/health"})
_ADMIN_PATHS = ("/admin/", "/v2/repository/models/")  # the latter: loading and unloading models


def presented_key(scope: Scope) -> str | None:
    """The API key a request presents, or None; raises `InvalidInput` (400) if it presents more than one."""
    return key_among([(name.decode("latin-1"), value.decode("latin-1"))
                      for name, value in scope["headers"] if name in (b"authorization", b"api-key")])


def key_among(entries: list[tuple[str, str]]) -> str | None:
    """The API key among a request's headers (or gRPC metadata entries) `entries`, given lowercase
    (`key_of`), or None; raises `InvalidInput` if they present it ambiguously: a header twice, or
    `authorization` and `api-key` naming different keys."""
    key = None
    seen: list[str] = []
    for name, value in entries:
        if name not in ("authorization", "api-key"):
            continue
        if name in seen:
            raise InvalidInput(f"the request has more than one {name!r} header: send the API key once")
        seen.append(name)
        found = key_of(name, value)
        if found is not None and key is not None and found != key:
            raise InvalidInput("the 'authorization' and 'api-key' headers name different API keys: send one")
        key = key or found
    return key


def key_of(name: str, value: str) -> str | None:
    """The API key in one header (or gRPC metadata entry): `authorization: Bearer <key>` or `api-key: <key>`."""
    if name == "authorization":
        scheme, _, token = value.partition(" ")
        return token.strip() or None if scheme.lower() == "bearer" else None
    if name == "api-key":
        return value.strip() or None
    return None


def check_admin(key: str | None, tenancy: Tenancy) -> None:
    """Raise the 401 (no key, or an unknown one) or 403 (a tenant's) of a call that needs the admin
    scope; a server without a tenants file is a single user's, who may do anything."""
    if tenancy.is_open or tenancy.is_admin(key):
        return
    inference_tenant(key, tenancy)  # 401 for no key or an unknown one
    raise PermissionDenied("this needs an admin key")


def statistics_reader(key: str | None, tenancy: Tenancy) -> str | None:
    """Who reads the model statistics presenting `key`: under `[metrics] access = "keys"` only a
    metrics or admin key may (else its 401/403, as `/metrics`), and it sees every model (None);
    otherwise as `listing_reader`."""
    if tenancy.guards_metrics:
        tenancy.check_scrape(key, "model statistics")
        return None
    return listing_reader(key, tenancy)


def listing_reader(key: str | None, tenancy: Tenancy) -> str | None:
    """Who reads a listing of the models (the repository index, the model statistics) presenting
    `key`: an admin key, which loads and unloads them, sees every model (None); a tenant's key, the
    models it may use (`inference_tenant`: 401 for no key or an unknown one)."""
    if tenancy.is_admin(key):
        return None
    return inference_tenant(key, tenancy)


def is_statistics_path(path: str) -> bool:
    """`/v2/models/stats`, `/v2/models/{m}/stats` or `/v2/models/{m}/versions/{v}/stats` (`api.triton`)."""
    return path.startswith("/v2/models/") and path.endswith("/stats")


INDEX_PATH = "/v2/repository/index"


def inference_tenant(key: str | None, tenancy: Tenancy) -> str:
    """The tenant an inference call presenting `key` is served for ("" without a tenants file),
    or raises its 401 (no key, or an unknown one) or 403 (an admin key)."""
    if tenancy.is_open:
        return ""
    if tenancy.is_admin(key):
        raise PermissionDenied("an admin key manages tenants; it cannot run inference")
    return tenancy.authenticate(key).name


class AuthMiddleware:
    """`routes`: every route of the app, so that a valid key refused a path's scope (an admin key
    off `/admin`, a tenant's on it) is told that no such route exists (404) when none does, as a
    tenant's key is on an inference path; no key or an unknown one is refused (401) first."""

    def __init__(self, app: ASGIApp, tenancy: Tenancy, routes: Sequence[BaseRoute] = ()) -> None:
        self.app = app
        self.tenancy = tenancy
        self.routes = tuple(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or TENANT_SCOPE_KEY in scope or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            authenticate(scope, self.tenancy)
        except SluiceError as exc:
            if isinstance(exc, PermissionDenied) and self.routes and not self._has_route(scope):
                exc = NotFound(f"no route for {scope['method']} {scope['path']}")
            await error_response(exc, protocol_of(scope["path"]))(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _has_route(self, scope: Scope) -> bool:
        """Whether any route has this path (for any method: a wrong method is not a missing route)."""
        return any(route.matches(scope)[0] is not Match.NONE for route in self.routes)


def authenticate(scope: Scope, tenancy: Tenancy) -> None:
    """Notes in `scope` who a request comes from (a tenant, or the admin), or raises its 401/403."""
    if TENANT_SCOPE_KEY in scope:
        return
    key = presented_key(scope)
    is_admin_route = scope["path"].startswith(_ADMIN_PATHS)
    path = scope["path"]
    if not tenancy.is_open and (is_statistics_path(path) or path == INDEX_PATH):
        reader = statistics_reader(key, tenancy) if is_statistics_path(path) else listing_reader(key, tenancy)
        if reader is None:
            scope[MONITOR_SCOPE_KEY] = True  # every model
        else:
            scope[TENANT_SCOPE_KEY] = reader
        return
    if tenancy.is_open:
        scope[TENANT_SCOPE_KEY] = ""
        scope[ADMIN_SCOPE_KEY] = True  # a server without tenants is a single user's
        return
    if is_admin_route and tenancy.is_admin(key):
        scope[ADMIN_SCOPE_KEY] = True
        return
    tenant = inference_tenant(key, tenancy)
    if is_admin_route:
        raise PermissionDenied("this route needs an admin key")
    scope[TENANT_SCOPE_KEY] = tenant
