"""Admin routes (admin scope only; the auth middleware checks the key):

    GET  /admin/tenants   each tenant's weight, class, models, limits, requests in flight, and
                          device-seconds used (in all and in the current credit period)
    POST /admin/reload    read the tenants file again (as SIGHUP does)

    GET  /admin/models                    each model's versions, traffic split and canary
    GET  /admin/models/{name}             one of them
    PUT  /admin/models/{name}/traffic     {"traffic": {"1": 90, "2": 10}, "sticky": true}
    DELETE /admin/models/{name}/traffic   back to the split the model declares (model.toml)
    POST /admin/models/{name}/canary      {"version": "2", ...}: move traffic to it step by step,
                                          rolled back on its own if it does worse than the baseline
    POST /admin/models/{name}/promote     the running canary takes all the traffic now
    POST /admin/models/{name}/rollback    stop the canary (its traffic back to its baseline); else
                                          give a promoted canary's traffic back to its baseline, or
                                          undo an operator's last change of the split
    PUT  /admin/models/{name}/shadow      {"version": "2", "share": 0.1}: copy that share of the
                                          requests routed to other versions to version 2 as well,
                                          measured and thrown away (`gateway.shadow`)
    DELETE /admin/models/{name}/shadow    stop copying

Splits and canaries live in the gateway's memory (`gateway.traffic`); gateways that share a
registry share them too (`gateway.shared_traffic`), so a change sent to any of them applies to
all. Without one, a restarted gateway follows the splits the models declare. A shadow is set
per gateway: behind several, set it on each (or on one: it copies that gateway's share).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sluice.api.auth import ADMIN_SCOPE_KEY
from sluice.api.common import decode_json, json_response, read_body
from sluice.errors import ConfigError, Conflict, InvalidInput, ModelNotFound, PermissionDenied, Unavailable
from sluice.gateway import Gateway
from sluice.gateway.shadow import Shadow
from sluice.gateway.traffic import CanaryEvent, CanaryPlan, Split, version_order
from sluice.metrics import tenant_label

_BODY_LIMIT = 64 * 1024
Endpoint = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")


class TrafficBody(msgspec.Struct, forbid_unknown_fields=True):
    traffic: dict[str, float]
    sticky: bool = True


class ShadowBody(msgspec.Struct, forbid_unknown_fields=True):
    version: str
    share: float = 1.0


class CanaryBody(msgspec.Struct, forbid_unknown_fields=True):
    version: str
    baseline: str | None = None
    steps: list[float] | None = None
    step_seconds: float | None = None
    min_requests: int | None = None
    max_error_rate: float | None = None
    max_latency_ratio: float | None = None
    sticky: bool | None = None


def routes(gateway: Gateway) -> list[Route]:
    def check(request: Request) -> None:
        if not request.scope.get(ADMIN_SCOPE_KEY):
            raise PermissionDenied("this route needs an admin key")

    async def tenants(request: Request) -> Response:
        check(request)
        return json_response({"object": "list", "data": await gateway.tenancy.usage()})

    async def reload(request: Request) -> Response:
        check(request)
        try:
            directory = gateway.tenancy.reload()
        except ConfigError as exc:
            raise InvalidInput(f"the tenants file was not reloaded (the old one stays): {exc.message}") from exc
        return json_response({"reloaded": directory.path is not None,
                              "tenants": sorted(tenant_label(name) for name in directory.tenants)})

    async def list_models(request: Request) -> Response:
        check(request)
        names = sorted(gateway.models(include_recovering=True))
        return json_response({"object": "list", "data": [_describe(gateway, name) for name in names]})

    async def get_model(request: Request) -> Response:
        check(request)
        return json_response(_describe(gateway, _model(gateway, request)))

    async def set_traffic(request: Request) -> Response:
        check(request)
        name = _model(gateway, request)
        raw = await read_body(request, _BODY_LIMIT)
        body = decode_json(raw, TrafficBody)
        twice = _named_twice(raw)
        if twice:
            raise InvalidInput(f"the split names version {twice[0]!r} more than once; give each version once, "
                               "with all of its weight", param="traffic")
        served = gateway.models(include_recovering=True).get(name, {})
        for version in body.traffic:
            if version not in served:
                raise InvalidInput(f"model {name!r} has no version {version!r} served "
                                   f"(it has {', '.join(_sorted(served))})", param="traffic")
        try:
            split = Split.of(body.traffic, body.sticky)
        except ValueError as exc:
            raise InvalidInput(str(exc), param="traffic") from None
        return await _changed(gateway, name, gateway.traffic.set_split(name, split))

    async def reset_traffic(request: Request) -> Response:
        check(request)
        name = _model(gateway, request)
        return await _changed(gateway, name, gateway.traffic.set_split(name, None))

    async def canary(request: Request) -> Response:
        check(request)
        name = _model(gateway, request)
        body = decode_json(await read_body(request, _BODY_LIMIT), CanaryBody)
        try:
            gateway.traffic.check_no_canary(name)
        except ValueError as exc:
            raise Conflict(f"{_asked(name, body.version)}: {exc}; one runs at a time: let it finish, or end it "
                           f"first (`sluice models promote {name}` or `sluice models rollback {name}`)") from None
        plan = _canary_plan(gateway, name, body)
        try:
            gateway.traffic.start_canary(name, plan, gateway.now(), gateway.split(name))
        except ValueError as exc:  # the checks above passed: the state changed meanwhile
            raise Conflict(f"{_asked(name, plan.version)}: {exc}; look again (`sluice models status {name}`)") \
                from None
        return await _changed(gateway, name, None, status=201)

    async def set_shadow(request: Request) -> Response:
        check(request)
        name = _model(gateway, request)
        body = decode_json(await read_body(request, _BODY_LIMIT), ShadowBody)
        shadow = Shadow(body.version, body.share)
        try:
            shadow.check()
        except ValueError as exc:
            raise InvalidInput(str(exc), param="share") from None
        served = gateway.models(include_recovering=True).get(name, {})
        if body.version not in served:
            raise ModelNotFound(f"model {name!r} has no version {body.version!r} served (it has "
                                f"{', '.join(_sorted(served))}); load it first (`sluice models load {name}`)")
        if len(served) == 1 or gateway.traffic_shares(name).get((name, body.version), 0.0) >= 1.0:
            raise Conflict(f"cannot shadow model {name!r} with version {body.version!r}: every request that names "
                           "no version goes to it already, so there is nothing to copy to it; move the traffic "
                           f"to another version first (`sluice models traffic {name} VERSION=100`)", param="version")
        gateway.mirror.shadows.start(name, shadow)
        return json_response(_describe(gateway, name))

    async def stop_shadow(request: Request) -> Response:
        check(request)
        name = _model(gateway, request)
        gateway.mirror.shadows.stop(name)
        return json_response(_describe(gateway, name))

    def canary_action(action: str, act: Callable[[str], CanaryEvent | None], why: str, hint: str) -> Endpoint:
        """`promote` or `roll_back` on the model in the path; 409 saying `why` not and what to do
        (`hint`, formatted with the model's `name`) if it had nothing to act on. A canary running
        on another gateway of the cluster is handed to that gateway."""
        async def endpoint(request: Request) -> Response:
            check(request)
            name = _model(gateway, request)
            remote = gateway.traffic.remote_canary(name)
            if remote is not None and gateway.shared_traffic is not None:
                if not await gateway.shared_traffic.command(name, action):
                    raise Unavailable(f"cannot {action} model {name!r}'s canary now: the gateway running it "
                                      f"({(remote.canary or {}).get('owner')}) did not answer; try again shortly "
                                      "(a canary whose gateway is gone is rolled back within seconds)",
                                      retry_after_s=1.0)
                return json_response(_describe(gateway, name))
            try:
                event = act(name)
            except KeyError:
                raise Conflict(f"cannot {action} model {name!r}: {why}; {hint.format(name=name)}") from None
            return await _changed(gateway, name, event)
        return endpoint

    promote = canary_action("promote", gateway.traffic.promote, "it has no canary running to promote",
                            "start one with `sluice models canary {name} VERSION` (POST /admin/models/{name}/canary)")
    rollback = canary_action("rollback", gateway.traffic.roll_back,
                             "it has no canary running, no promoted canary to give back and no operator's change "
                             "of its split to undo", "`sluice models status {name}` shows where its traffic goes")

    prefix = "/admin/models/{name}"
    return [
        Route("/admin/tenants", tenants, methods=["GET"]),
        Route("/admin/reload", reload, methods=["POST"]),
        Route("/admin/models", list_models, methods=["GET"]),
        Route(prefix, get_model, methods=["GET"]),
        Route(prefix + "/traffic", set_traffic, methods=["PUT"]),
        Route(prefix + "/traffic", reset_traffic, methods=["DELETE"]),
        Route(prefix + "/canary", canary, methods=["POST"]),
        Route(prefix + "/shadow", set_shadow, methods=["PUT"]),
        Route(prefix + "/shadow", stop_shadow, methods=["DELETE"]),
        Route(prefix + "/promote", promote, methods=["POST"]),
        Route(prefix + "/rollback", rollback, methods=["POST"]),
    ]


def _model(gateway: Gateway, request: Request) -> str:
    name = request.path_params["name"]
    if name not in gateway.models(include_recovering=True):
        raise gateway.refusal(name, None) or ModelNotFound(f"model {name!r} is not served")
    return name


async def _changed(gateway: Gateway, name: str, event: CanaryEvent | None, status: int = 200) -> Response:
    """After an operator changed `name`'s traffic here: report the canary it ended, tell the other
    gateways (once), answer with the model's routing."""
    if event is not None:
        gateway.canary_event(event)
    await gateway.share_traffic(name)
    return json_response(_describe(gateway, name), status=status)


class _Object(dict[str, Any]):
    """A JSON object as decoded, with the keys it holds more than once (JSON allows it; decoders keep the last)."""

    repeated: list[str]


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    decoded = _Object(pairs)
    decoded.repeated = [key for key, count in Counter(key for key, _ in pairs).items() if count > 1]
    return decoded


def _named_twice(body: bytes) -> list[str]:
    """The versions a split's body (valid JSON: decoded already) names more than once in `traffic`."""
    traffic = json.loads(body, object_pairs_hook=_object).get("traffic")
    return traffic.repeated if isinstance(traffic, _Object) else []


def _asked(name: str, version: str) -> str:
    return f"cannot start a canary of model {name!r} version {version!r}"


def _canary_plan(gateway: Gateway, name: str, body: CanaryBody) -> CanaryPlan:
    """The plan `body` asks for; a 400 (what it asks is wrong) or 409 (not now) saying what was
    asked, why it cannot be done, and what to do."""
    asked = _asked(name, body.version)
    _check_canary_version(gateway, name, body.version, asked, "version")
    shares = {v: share for (_, v), share in gateway.traffic_shares(name).items() if share > 0}
    others = sorted((v for v in shares if v != body.version), key=lambda v: (shares[v], version_order(v)),
                    reverse=True)
    baseline = body.baseline
    if baseline is None:
        if not others:
            candidates = [v for v in _sorted(gateway.models().get(name, {})) if v != body.version]
            which = candidates[0] if len(candidates) == 1 else "VERSION"
            raise Conflict(f"{asked}: no other version has traffic for it to take (all of the model's requests go "
                           f"to version {body.version}); a canary takes its share from its baseline's: give "
                           f"{'the version to compare it with' if which == 'VERSION' else f'version {which}'} "
                           f"traffic first (`sluice models traffic {name} {which}=100`), then start the canary",
                           param="baseline")
        baseline = others[0]
    elif baseline == body.version:
        raise InvalidInput(f"{asked} against itself: a canary is compared with another version; give another "
                           "`baseline` (--baseline), or none for the version with the most traffic", param="baseline")
    _check_canary_version(gateway, name, baseline, asked, "baseline")
    if baseline not in shares:
        instead = [v for v in others if v != baseline]
        raise Conflict(f"{asked} against version {baseline!r}: version {baseline} has no traffic for the canary to "
                       f"take its share from (0% of the model's requests go to it); give it traffic first "
                       f"(`sluice models traffic {name} {baseline}=100`)"
                       + (f", or compare with a version that has some (--baseline {instead[0]})" if instead else ""),
                       param="baseline")
    split = gateway.split(name)
    sticky = body.sticky if body.sticky is not None else (split.sticky if split is not None else True)
    default = CanaryPlan(version=body.version, baseline=baseline, sticky=sticky)
    try:
        plan = replace(
            default, steps=default.steps if body.steps is None else tuple(body.steps),
            step_s=_given(body.step_seconds, default.step_s),
            min_requests=_given(body.min_requests, default.min_requests),
            max_error_rate=_given(body.max_error_rate, default.max_error_rate),
            max_latency_ratio=_given(body.max_latency_ratio, default.max_latency_ratio))
        plan.check()
    except ValueError as exc:
        raise InvalidInput(f"{asked}: {exc}") from None
    return plan


def _check_canary_version(gateway: Gateway, name: str, version: str, asked: str, param: str) -> None:
    """A 400 if no worker serves `version` of `name` (the canary's, or its baseline), a 409 if it
    is not ready yet."""
    role = "the canary's version" if param == "version" else "its baseline"
    served = gateway.models(include_recovering=True).get(name, {})
    if version not in served and (name, version) not in gateway.loading_versions():
        raise InvalidInput(f"{asked}: {role}, version {version}, is not served by any worker (model {name!r} "
                           f"serves {', '.join(_sorted(served))}); put it in the model's folder of the repository "
                           f"and load it first (`sluice models load {name}`, or POST "
                           f"/v2/repository/models/{name}/load)", param=param)
    if version not in gateway.models().get(name, {}):
        raise Conflict(f"{asked}: {role}, version {version}, is not ready yet (a worker is loading or restarting "
                       f"it); start the canary once `sluice models status {name}` shows it ready", param=param)


def _given(value: T | None, default: T) -> T:
    return default if value is None else value


def _sorted(versions: Any) -> list[str]:
    return sorted(versions, key=version_order)


def _describe(gateway: Gateway, name: str) -> dict[str, Any]:
    """A model's versions, where its unversioned traffic goes and why, and its latest canary."""
    now = gateway.now()
    gateway.judge_canary(name)
    versions = gateway.models(include_recovering=True).get(name, {})
    ready = gateway.models().get(name, {})
    split, declared = gateway.split(name), gateway.declared_split(name)
    canary = gateway.traffic.canaries.get(name)
    remote = gateway.traffic.remote_canary(name)
    source = gateway.traffic.source(name) or ("model.toml" if declared is not None else "newest version")
    shares = gateway.traffic_shares(name)
    return {
        "object": "model.routing",
        "model": name,
        "versions": [{"version": v, "ready": v in ready, "traffic_percent": round(100 * shares.get((name, v), 0), 4)}
                     for v in _sorted(versions)],
        "split_source": source,
        "sticky": split.sticky if split is not None else None,
        "declared": None if declared is None else {"traffic": declared.percent(), "sticky": declared.sticky},
        "canary": remote.canary if remote is not None else None if canary is None else canary.describe(now),
        "shadow": None if (shadow := gateway.mirror.shadows.get(name)) is None else shadow.to_json(),
    }

