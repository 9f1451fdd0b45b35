"""`sluice models status|traffic|canary|shadow|promote|rollback|load|unload`: calls to a running server's
admin API (`api.admin`, and `api.triton`'s model loading) and their answers in a few lines."""

from __future__ import annotations

import http.client
import json
import math
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import click


def model_path(name: str, action: str = "") -> str:
    return f"/admin/models/{urllib.parse.quote(name, safe='')}{action}"


def repository_path(name: str, action: str) -> str:
    """`load` or `unload`: Triton's repository extension."""
    return f"/v2/repository/models/{urllib.parse.quote(name, safe='')}/{action}"


def admin_call(url: str, admin_key: str | None, method: str, path: str, body: object | None = None,
               timeout_s: float = 30.0) -> Any:
    """The JSON answer of `method path`; a ClickException with the server's message on an error,
    or saying that no answer came within `timeout_s`."""
    headers = {"content-type": "application/json"}
    if admin_key:
        headers["authorization"] = f"Bearer {admin_key}"
    try:
        data = None if body is None else json.dumps(body, allow_nan=False).encode()
    except ValueError:  # nan or inf from a float option: no JSON carries them
        raise click.ClickException("every number given must be finite (not nan or inf)") from None
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        try:
            error = json.loads(exc.read())["error"]
            # the admin API's OpenAI-style envelope, or KServe's {"error": "..."} (load and unload)
            message = error if isinstance(error, str) else error["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        hint = ("; give an admin key (`sluice keys create --admin`) with --admin-key or $SLUICE_ADMIN_KEY"
                if exc.code in (401, 403) else "")
        raise click.ClickException(f"{exc.code}: {message}{hint}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
            raise click.ClickException(f"{url} did not answer within {timeout_s:g} s: what was asked may still be "
                                       "under way there (`sluice models status`)") from None
        raise click.ClickException(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None
    except ValueError as exc:  # not JSON, or a URL that cannot be sent
        raise click.ClickException(f"{url} did not answer as a sluice server does: {exc}") from None


def parse_shares(shares: tuple[str, ...]) -> dict[str, float]:
    """`("1=90", "2=10")` -> `{"1": 90.0, "2": 10.0}`."""
    parsed: dict[str, float] = {}
    for share in shares:
        version, _, weight = share.partition("=")
        if version.strip() in parsed:
            raise click.BadParameter(f"version {version.strip()} is given more than once; give each version once, "
                                     "with all of its weight", param_hint="SHARES")
        try:
            parsed[version.strip()] = float(weight)
            if not math.isfinite(parsed[version.strip()]):
                raise ValueError(weight)
        except ValueError:
            raise click.BadParameter(f"{share!r} is not VERSION=WEIGHT (e.g. 2=10)", param_hint="SHARES") from None
    return parsed


def parse_steps(steps: str | None) -> list[float] | None:
    """`"5,25,50"` -> `[5.0, 25.0, 50.0]`."""
    if steps is None:
        return None
    try:
        parsed = [float(step) for step in steps.split(",")]
        if not all(math.isfinite(step) for step in parsed):
            raise ValueError(steps)
        return parsed
    except ValueError:
        raise click.BadParameter(f"{steps!r} is not a list of percentages such as 5,25,50",
                                 param_hint="--steps") from None


def show(answer: Any, as_json: bool = False) -> None:
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    models = answer["data"] if answer.get("object") == "list" else [answer]
    if not models:
        click.echo("no models are served (`sluice models load NAME` loads one from the model repository)")
    for model in models:
        click.echo(describe(model))


def describe(model: dict[str, Any]) -> str:
    """A model's routing in a few lines, as `sluice models status` prints it."""
    sticky = "" if model["sticky"] is None else (", sticky" if model["sticky"] else ", drawn per request")
    lines = [f"{model['model']}: traffic from {model['split_source']}{sticky}"]
    for version in model["versions"]:
        state = "ready" if version["ready"] else "not ready"
        lines.append(f"  version {version['version']:>4}  {version['traffic_percent']:6.2f}%  {state}")
    if model["versions"] and not any(version["traffic_percent"] for version in model["versions"]):
        lines.append("  none of the versions its split names is served: requests that name no version are refused")
    canary = model.get("canary")
    if canary:
        lines.append(f"  canary: version {canary['version']} against {canary['baseline']}, {canary['status']}"
                     f" at {canary['share_percent']:g}% (step {canary['step']} of {len(canary['steps'])})")
        for version, window in canary["current_step"].items():
            p95 = "-" if window["p95_ms"] is None else f"{window['p95_ms']:.1f} ms"
            lines.append(f"    version {version}: {window['requests']} requests, {window['failed']} failed, "
                         f"p95 {p95}")
        if canary["reason"]:
            lines.append(f"    {canary['reason']}")
    shadow = model.get("shadow")
    if shadow:
        lines.append(f"  shadow: version {shadow['version']} gets a copy of {100 * shadow['share']:g}% of the requests "
                     "routed to the others (answers measured, not returned)")
    return "\n".join(lines)
