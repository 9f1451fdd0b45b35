"""`--url` of the commands that call a running server (`sluice top`, `sluice models ...`,
`sluice batch ...`, `sluice bench`), checked as it is parsed: a URL no request could be sent to
(no `http://`, another scheme, a port out of range, a bracket left open) is a usage error that
says so, not a traceback or a wait for a connection that cannot be made."""

from __future__ import annotations

import urllib.parse

import click

__all__ = ["check_server_url"]


def check_server_url(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> str | None:
    """A click callback: `value` if it is an http:// or https:// URL naming a host, else `BadParameter`."""
    if value is None:
        return None
    try:
        parts = urllib.parse.urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0-65535
    except ValueError as exc:
        raise click.BadParameter(f"{value!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise click.BadParameter(f"{value!r} is not the http:// or https:// URL of a server, such as "
                                 "http://127.0.0.1:8000")
    return value
