"""Admin routes (admin scope only; the auth middleware checks the key):

    GET  /admin/tenants   each tenant's weight, class, models, limits, requests in flight, and
                          device-seconds used (in all and in the current credit period)
    POST /admin/reload    read the tenants file again (as SIGHUP does)
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sluice.api.auth import ADMIN_SCOPE_KEY
from sluice.errors import ConfigError, InvalidInput, PermissionDenied
from sluice.gateway import Gateway


def routes(gateway: Gateway) -> list[Route]:
    def check(request: Request) -> None:
        if not request.scope.get(ADMIN_SCOPE_KEY):
            raise PermissionDenied("this route needs an admin key")

    async def tenants(request: Request) -> Response:
        check(request)
        return _json({"object": "list", "data": await gateway.tenancy.usage()})

    async def reload(request: Request) -> Response:
        check(request)
        try:
            directory = gateway.tenancy.reload()
        except ConfigError as exc:
            raise InvalidInput(f"the tenants file was not reloaded (the old one stays): {exc.message}") from exc
        return _json({"reloaded": directory.path is not None, "tenants": sorted(directory.tenants)})

    return [
        Route("/admin/tenants", tenants, methods=["GET"]),
        Route("/admin/reload", reload, methods=["POST"]),
    ]


def _json(content: object) -> Response:
    return Response(msgspec.json.encode(content), media_type="application/json")
